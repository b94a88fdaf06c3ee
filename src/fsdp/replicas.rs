//! HSDP's replicate dimension behind an interface: after the reduce-scatter over the shard group, each
//! reduced chunk is summed across the replicas holding the same shards. A fixed group does it with one
//! all-reduce ([`FsdpOptions::replicate_group`](super::FsdpOptions::replicate_group)); fault tolerance
//! plugs in a reduction over the replicas of each step (`tch_dist::ft::Manager::fsdp_replicas`), as
//! torchft's managed process group plugs into FSDP2.
use std::sync::Arc;

use tch::Tensor;

use crate::error::Result;
use crate::group::{ProcessGroup, ReduceOp};

/// How a sharded gradient is summed across the replicas of the model (HSDP).
pub trait Replicas: Send + Sync + std::fmt::Debug {
    /// Replicas whose gradients this step's mean is taken over; read before each reduction.
    fn count(&self) -> usize;
    /// Sums `t` over the replicas, in place, before returning. Called for each reduced chunk (one per
    /// parameter, or one per unit whose parameters travel coalesced), in the same order and with the
    /// same sizes on every replica.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<()>;
    /// The group, when the replicas are a fixed one: FSDP then also starts them from one state, checks
    /// that they built the same units, and records the placement along it (for checkpoints).
    fn group(&self) -> Option<&Arc<ProcessGroup>> {
        None
    }
}

/// A fixed group of replicas: HSDP's plain all-reduce.
#[derive(Debug)]
pub(crate) struct ReplicateGroup(pub(crate) Arc<ProcessGroup>);

impl Replicas for ReplicateGroup {
    fn count(&self) -> usize {
        self.0.size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        if self.0.size() > 1 {
            self.0.allreduce_unverified(&mut t.shallow_clone(), ReduceOp::Sum)?.wait()?;
        }
        Ok(())
    }
    fn group(&self) -> Option<&Arc<ProcessGroup>> {
        Some(&self.0)
    }
}
