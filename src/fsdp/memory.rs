//! Where an FSDP model's memory goes on this rank.
use super::FullyShardedDataParallel;
use crate::error::Result;
use crate::optim::Optimizer;

/// Bytes an FSDP model holds on this rank, and the allocator's view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FsdpMemory {
    /// This rank's shards of the parameters (those of a unit gathered one parameter at a time live
    /// inside it while it is gathered, in the same dtype; see below).
    pub sharded_parameters: i64,
    /// Units gathered right now: full parameters in the compute dtype (with the shards living inside).
    pub gathered_parameters: i64,
    /// The shards' gradients.
    pub gradient_shards: i64,
    /// Gradients still unsharded in the parameters (accumulating under `no_sync`).
    pub unsharded_gradients: i64,
    /// The optimizer's state; 0 from [`FullyShardedDataParallel::memory_breakdown`].
    pub optimizer_state: i64,
    /// Of the bytes above, those on the offload device ([`super::FsdpOptions::offload`]): the shards, their
    /// gradients and the optimizer state.
    pub offloaded: i64,
    /// Parameter elements whose update this rank computes, read from its shards' placements.
    pub owned_elements: i64,
    /// [`crate::memory::allocated`] and [`crate::memory::peak`] on the compute device.
    pub allocated: i64,
    pub peak: i64,
}

fn bytes(t: &tch::Tensor) -> i64 {
    if t.defined() {
        (t.numel() * t.kind().elt_size_in_bytes()) as i64
    } else {
        0
    }
}

impl<M> FullyShardedDataParallel<M> {
    /// Shards, gathered units and gradients in bytes, plus the compute device's allocated and peak bytes.
    pub fn memory_breakdown(&self) -> Result<FsdpMemory> {
        let mut m = FsdpMemory::default();
        let mut compute = tch::Device::Cpu;
        let mut offloaded = false;
        self.rt.for_each(|_, _, fp| {
            compute = fp.full.device();
            offloaded = fp.offloaded;
            m.sharded_parameters += fp.shard_bytes()?;
            m.gathered_parameters += fp.gathered_bytes()?;
            for s in &fp.slots {
                m.gradient_shards += bytes(&s.shard.grad());
                m.unsharded_gradients += bytes(&s.param.grad());
                m.owned_elements += crate::placement::held_elements(&s.shard);
            }
            Ok(())
        })?;
        if offloaded {
            m.offloaded = m.sharded_parameters + m.gradient_shards;
        }
        m.allocated = crate::memory::allocated(compute)?;
        m.peak = crate::memory::peak(compute)?;
        Ok(m)
    }

    /// [`memory_breakdown`](Self::memory_breakdown) with the optimizer's state (which lives with the
    /// shards, so on the offload device when there is one).
    pub fn memory_breakdown_with(&self, opt: &dyn Optimizer) -> Result<FsdpMemory> {
        let mut m = self.memory_breakdown()?;
        m.optimizer_state = opt.memory().state;
        if m.offloaded > 0 {
            m.offloaded += m.optimizer_state;
        }
        Ok(m)
    }
}
