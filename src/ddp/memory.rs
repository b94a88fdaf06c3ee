//! Where DDP's memory goes: parameters, gradients, buckets, and (given the optimizer) its state, master
//! weights and gradient shards.
use std::collections::HashSet;

use tch::Tensor;

use super::DistributedDataParallel;
use crate::error::Result;
use crate::optim::Optimizer;

/// Bytes held by a DDP model on its device, and the allocator's view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DdpMemory {
    pub parameters: i64,
    /// Gradients stored outside the buckets (0 with `gradient_as_bucket_view` once grads are views).
    pub gradients: i64,
    pub buckets: i64,
    /// Optimizer state (all of it, or this rank's shard under ZeRO); 0 from [`DistributedDataParallel::memory_breakdown`].
    pub optimizer_state: i64,
    /// Float32 master copies of 16-bit parameters held by the optimizer.
    pub master_params: i64,
    /// ZeRO-2's gradient shards.
    pub gradient_shards: i64,
    /// Parameter elements whose update this rank computes, read from the placements of what is stepped
    /// (all of them unless sharded: a ZeRO shard's parts of the variables, with the optimizer).
    pub owned_elements: i64,
    /// [`crate::memory::allocated`] on the parameters' device.
    pub allocated: i64,
    pub peak: i64,
}

fn bytes(t: &Tensor) -> i64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as i64
}

impl<M> DistributedDataParallel<M> {
    /// Parameters, gradients and buckets in bytes, plus the device's allocated and peak bytes.
    pub fn memory_breakdown(&self) -> Result<DdpMemory> {
        let st = match self.reducer.state.lock() {
            Ok(s) => s,
            Err(e) => e.into_inner(),
        };
        let device = st.params.first().map_or(tch::Device::Cpu, |p| p.device());
        let mut m = DdpMemory::default();
        let mut bucket_ranges: Vec<(u64, u64)> = Vec::new();
        for b in &st.buckets {
            m.buckets += bytes(&b.flat);
            let start = b.flat.data_ptr() as u64;
            bucket_ranges.push((start, start + bytes(&b.flat) as u64));
        }
        let mut seen = HashSet::new();
        for p in &st.params {
            m.parameters += bytes(p);
            let g = p.grad();
            if g.defined() {
                let ptr = g.data_ptr() as u64;
                let inside = bucket_ranges.iter().any(|&(s, e)| ptr >= s && ptr < e);
                if !inside && seen.insert(ptr) {
                    m.gradients += bytes(&g);
                }
            }
        }
        m.owned_elements = st.params.iter().map(crate::placement::held_elements).sum();
        m.allocated = crate::memory::allocated(device)?;
        m.peak = crate::memory::peak(device)?;
        Ok(m)
    }
}

impl<M> DistributedDataParallel<M> {
    /// [`memory_breakdown`](Self::memory_breakdown) with the optimizer's share: its state, master weights
    /// and gradient shards, and how many parameter elements this rank updates.
    ///
    /// ```no_run
    /// # fn f<M>(ddp: &tch_dist::ddp::DistributedDataParallel<M>, opt: &tch_dist::zero::ShardedOptimizer) -> tch_dist::Result<()> {
    /// let m = ddp.memory_breakdown_with(opt)?;
    /// println!("params {} grads {} state {} (shard of {} elements)", m.parameters, m.buckets + m.gradient_shards, m.optimizer_state, m.owned_elements);
    /// # Ok(()) }
    /// ```
    pub fn memory_breakdown_with(&self, opt: &dyn Optimizer) -> Result<DdpMemory> {
        let mut m = self.memory_breakdown()?;
        let o = opt.memory();
        m.optimizer_state = o.state;
        m.master_params = o.master;
        m.gradient_shards = o.gradient_shards;
        m.owned_elements = o.owned_elements;
        Ok(m)
    }
}
