//! Where a synchronised backward's gradients go when they are not to stay in DDP's buckets: a layer above
//! DDP that keeps only part of each bucket's reduced gradient (a reduce-scatter into shards) gives DDP a
//! sink, and DDP's reducer feeds it in bucket order instead of allreducing its own buffers.
use tch::Tensor;

use crate::error::Result;
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
