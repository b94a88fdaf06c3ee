//! Data parallelism inside a pipeline: each of a rank's chunks (stages) runs DDP or FSDP over the ranks
//! that hold the same stage, as PyTorch's pipelining wraps each stage's module in DDP or `fully_shard`.
//!
//! A step runs several backwards per chunk, one per microbatch. Gradients accumulate locally through all
//! but the chunk's last one and are reduced during that one (pipelining's `backward_maybe_with_nosync`),
//! so the reduction of the last microbatch overlaps its own backward, once per step. Under FSDP the units
//! a backward gathers stay gathered until that last backward (pipelining's
//! `set_reshard_after_backward(False)`), so a microbatch does not gather again what the one before
//! left; with `FsdpOptions::reshard_after_forward(false)`, as torchtitan sets under pipelining, each unit
//! is gathered once per step.
use tch::{nn, Tensor};

use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::error::Result;
use crate::fsdp::{FsdpOptions, FullyShardedDataParallel};

/// How each pipeline chunk is data-parallel (see [`PipelineConfig`](super::PipelineConfig)).
#[derive(Clone, Debug, Default)]
pub enum DataParallel {
    /// Every rank of the pipeline group is the only one holding its stage.
    #[default]
    None,
    /// DDP over the options' group: gradients averaged in buckets during the last microbatch's
    /// backward.
    Ddp(DdpOptions),
    /// FSDP over the options' group, or HSDP with a replicate group: each layer of the chunk that has
    /// parameters is a unit; the optimizer steps the shards ([`DistModule::parameters`](crate::DistModule::parameters) of the stage).
    Fsdp(FsdpOptions),
}

/// A chunk's wrapper, holding the hooks on its parameters; the chunk's layers stay where they are.
pub(crate) enum ChunkSync {
    Ddp(DistributedDataParallel<()>),
    Fsdp(FullyShardedDataParallel<()>),
}

impl ChunkSync {
    /// The wrapper for a chunk whose variables are in `vs` (for FSDP, its units are built already).
    pub(crate) fn ddp(vs: &nn::VarStore, opts: &DdpOptions) -> Result<ChunkSync> {
        Ok(ChunkSync::Ddp(DistributedDataParallel::new(vs, (), opts.clone())?))
    }

    /// `f`, the chunk's layers, as this wrapper's forward.
    pub(crate) fn forward(&self, x: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> Result<Tensor> {
        match self {
            ChunkSync::Ddp(d) => d.forward_with(|_| f(x)),
            ChunkSync::Fsdp(m) => m.forward_with(x, |_, x| f(x)),
        }
    }

    pub(crate) fn set_requires_gradient_sync(&self, on: bool) {
        match self {
            ChunkSync::Ddp(d) => d.set_sync(on),
            ChunkSync::Fsdp(m) => m.set_sync(on),
        }
    }

    /// FSDP's units stay gathered after a backward (off) or are freed (on); nothing to keep under DDP.
    pub(crate) fn set_reshard_after_backward(&self, on: bool) {
        if let ChunkSync::Fsdp(m) = self {
            m.set_reshard_after_backward(on);
        }
    }

    /// A step begins: FSDP frees what an earlier forward left gathered (the optimizer may have stepped
    /// since), then keeps what the step's backwards gather.
    pub(crate) fn begin_step(&self) -> Result<()> {
        if let ChunkSync::Fsdp(m) = self {
            m.reshard()?;
            m.set_reshard_after_backward(false);
        }
        Ok(())
    }
}

impl std::fmt::Debug for ChunkSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChunkSync::Ddp(d) => write!(f, "DDP over {}", d.process_group().name()),
            ChunkSync::Fsdp(m) => write!(f, "FSDP over {} ({} units)", m.process_group().name(), m.units().len()),
        }
    }
}
