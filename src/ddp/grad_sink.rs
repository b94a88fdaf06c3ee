//! DDP's interface for a layer above it that shards its buckets (ZeRO-1 and ZeRO-2), the whole of it in
//! this file: the layer fixes the bucket layout (to lay each bucket's parameters out flat and own a
//! slice of it) and may take a synchronised backward's gradients: it gives DDP a sink, which the
//! reducer feeds in bucket order instead of allreducing its own buffers (a reduce-scatter into shards
//! keeps only part of each bucket's reduced gradient).
use tch::Tensor;

use std::sync::Arc;

use super::reducer::{lock, Reducer};
use super::DistributedDataParallel;
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// A destination for bucket gradients, fed by the reducer as gradients become ready. One backward at a
/// time drives it; it is never called with the reducer's lock held, except [`accept`](Self::accept) and
/// [`reset`](Self::reset), which run no collective.
pub(crate) trait GradSink: Send {
    /// Parameter gradient `grad` (undefined for a parameter that got none: zeros), multiplied by `scale`,
    /// goes to elements `offset..offset + numel` of bucket `bucket`'s flat layout.
    fn accept(&mut self, bucket: usize, offset: i64, numel: i64, grad: &Tensor, scale: f64) -> Result<()>;
    /// Every gradient of `bucket` has been accepted: start its reduction.
    fn launch(&mut self, pg: &ProcessGroup, bucket: usize) -> Result<()>;
    /// Waits for every reduction of this backward.
    fn finish(&mut self, pg: &ProcessGroup) -> Result<()>;
    /// Forgets a failed backward's partial buffers.
    fn reset(&mut self);
}

/// A bucket of the layout DDP fixed for good: its parameters (indices in DDP's order) and its flat
/// gradient buffer (empty once gradients go to a [`GradSink`]).
pub(crate) struct FixedBucket {
    pub params: Vec<usize>,
    pub grads: Tensor,
}

/// A DDP model's count of synchronised backwards, for a layer above whose copies of the gradients are
/// stale once another backward has run.
pub(crate) struct BackwardCount(Arc<Reducer>);

impl BackwardCount {
    pub(crate) fn get(&self) -> i64 {
        lock(&self.0.state).backwards
    }
}

impl<M> DistributedDataParallel<M> {
    pub(crate) fn backward_count(&self) -> BackwardCount {
        BackwardCount(self.reducer.clone())
    }

    /// Whether a layer above shards the buckets ([`mark_sharded`](Self::mark_sharded)).
    pub(crate) fn sharded(&self) -> bool {
        lock(&self.reducer.state).sharded
    }

    /// The layer above is built: one per model, and the model may run.
    pub(crate) fn mark_sharded(&self) {
        lock(&self.reducer.state).sharded = true;
    }

    /// Fixes the bucket layout for good; returns each bucket's parameters and gradient buffer (the
    /// averaged gradients after a synchronised backward).
    pub(crate) fn fix_layout(&self) -> Result<Vec<FixedBucket>> {
        self.reducer.fix_layout()
    }

    /// Sends synchronised backwards' gradients to a sink instead of the buckets (see [`GradSink`]).
    /// `owner` names the caller in the error a comm hook gets: the sink reduces buckets itself.
    pub(crate) fn route_to(
        &self,
        owner: &str,
        make: impl FnOnce(&[(i64, Tensor)]) -> Result<Box<dyn GradSink>>,
    ) -> Result<()> {
        self.refuse_comm_hook(owner)?;
        self.reducer.route_to(make).map_err(|e| e.in_op(owner.to_string()))
    }

    /// A sink reduces the buckets itself, so a comm hook would never run: refused before anything
    /// changes.
    pub(crate) fn refuse_comm_hook(&self, owner: &str) -> Result<()> {
        if self.reducer.cfg.comm_hook.is_some() {
            return Err(Error::invalid(
                owner,
                format!("the DDP model has a comm hook, but {owner} reduces its buckets itself; remove the hook"),
            ));
        }
        Ok(())
    }
}
