//! One bucket's parameters moved into one flat buffer, padded to a multiple of the world size, so that
//! rank r's shard is the contiguous slice `[r*len, (r+1)*len)` and the updated shards gather back in place.
use std::collections::VecDeque;

use tch::Tensor;

use crate::error::Result;
use crate::group::ProcessGroup;
use crate::work::Work;

/// Gather steps left running while later buckets step. They allocate nothing (the ring receives in
/// place), so this only caps outstanding requests.
pub(super) const GATHERS_IN_FLIGHT: usize = 64;

pub(crate) struct FlatBucket {
    /// `world * len` elements; the parameters are views into it.
    pub flat: Tensor,
    /// Elements per shard.
    pub len: i64,
    /// Real (unpadded) elements of this rank's shard, `0..=len`.
    pub own: i64,
    /// Where each parameter starts in `flat`, in the order given.
    pub offsets: Vec<i64>,
    rank: i64,
    world: i64,
}

impl FlatBucket {
    /// Copies `params` (one dtype and device, in bucket order) into a new flat buffer and makes each
    /// parameter's data a view of it. One parameter at a time, so the old storage goes as the new comes.
    pub(super) fn new(params: &[Tensor], rank: usize, world: usize) -> Result<FlatBucket> {
        let _g = tch::no_grad_guard();
        let (rank, world) = (rank as i64, world as i64);
        let numel: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let len = (numel + world - 1) / world;
        let flat = Tensor::f_zeros([world * len], (params[0].kind(), params[0].device()))?;
        let mut off = 0i64;
        let mut offsets = Vec::with_capacity(params.len());
        for p in params {
            let n = p.numel() as i64;
            offsets.push(off);
            let view = flat.f_narrow(0, off, n)?.f_view(p.size().as_slice())?;
            view.shallow_clone().f_copy_(p)?;
            p.shallow_clone().f_set_data(&view)?;
            off += n;
        }
        let own = (numel - rank * len).clamp(0, len);
        Ok(FlatBucket { flat, len, own, offsets, rank, world })
    }

    /// This rank's shard of the parameters (a view: updating it updates the model).
    pub(super) fn shard(&self) -> Result<Tensor> {
        Ok(self.flat.f_narrow(0, self.rank * self.len, self.own)?)
    }

    /// Every rank's shard into every rank's buffer, in place (`group::flat`: the engine's algorithm); the last
    /// step is left running in `pending` so the gather overlaps whatever the caller does next.
    pub(super) fn all_gather(
        &self,
        pg: &ProcessGroup,
        bucket: usize,
        pending: &mut VecDeque<Vec<Work>>,
        max_in_flight: usize,
    ) -> Result<()> {
        if self.world > 1 {
            let label = format!("ZeRO gather, bucket {bucket}");
            crate::group::flat::all_gather(pg, &self.flat, self.len, &label, pending, max_in_flight)?;
        }
        Ok(())
    }
}
