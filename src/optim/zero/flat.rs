//! One bucket's parameters moved into one flat buffer, padded to a multiple of the world size, so that
//! rank r's shard is the contiguous slice `[r*len, (r+1)*len)` and the updated shards gather back in place.
use tch::Tensor;

use crate::error::Result;
use std::collections::VecDeque;

use crate::group::ProcessGroup;
use crate::work::Work;

/// Most elements gathered per collective: bounds the transient buffer Gloo allocates (world × this).
pub const GATHER_CHUNK: i64 = 1 << 19;
/// Gathers in flight while the next bucket steps.
pub const GATHERS_IN_FLIGHT: usize = 2;

pub(crate) struct FlatBucket {
    /// `world * len` elements; the parameters are views into it.
    pub flat: Tensor,
    /// Elements per shard.
    pub len: i64,
    /// Real (unpadded) elements of this rank's shard, `0..=len`.
    pub own: i64,
    rank: i64,
    world: i64,
}

impl FlatBucket {
    /// Copies `params` (one dtype and device, in bucket order) into a new flat buffer and makes each
    /// parameter's data a view of it. One parameter at a time, so the old storage goes as the new comes.
    pub fn new(params: &[Tensor], rank: usize, world: usize) -> Result<FlatBucket> {
        let _g = tch::no_grad_guard();
        let (rank, world) = (rank as i64, world as i64);
        let numel: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let len = (numel + world - 1) / world;
        let flat = Tensor::f_zeros([world * len], (params[0].kind(), params[0].device()))?;
        let mut off = 0i64;
        for p in params {
            let n = p.numel() as i64;
            let view = flat.f_narrow(0, off, n)?.f_view(p.size().as_slice())?;
            view.shallow_clone().f_copy_(p)?;
            p.shallow_clone().f_set_data(&view)?;
            off += n;
        }
        let own = (numel - rank * len).clamp(0, len);
        Ok(FlatBucket { flat, len, own, rank, world })
    }

    /// This rank's shard of the parameters (a view: updating it updates the model).
    pub fn shard(&self) -> Result<Tensor> {
        Ok(self.flat.f_narrow(0, self.rank * self.len, self.own)?)
    }

    /// Every rank's shard into every rank's buffer, in pieces of at most [`GATHER_CHUNK`] elements,
    /// started asynchronously; `pending` bounds the pieces in flight to `max_in_flight` (oldest waited
    /// first), so the gather overlaps whatever the caller does next.
    pub fn all_gather(&self, pg: &ProcessGroup, pending: &mut VecDeque<Work>, max_in_flight: usize) -> Result<()> {
        // equal pieces, so a shard just over the limit does not leave a tiny last collective
        let pieces = (self.len + GATHER_CHUNK - 1) / GATHER_CHUNK;
        let piece = (self.len + pieces.max(1) - 1) / pieces.max(1);
        let mut start = 0i64;
        while start < self.len {
            let n = piece.min(self.len - start);
            while pending.len() >= max_in_flight.max(1) {
                if let Some(w) = pending.pop_front() {
                    w.wait()?;
                }
            }
            let mut outs: Vec<Tensor> =
                (0..self.world).map(|r| self.flat.f_narrow(0, r * self.len + start, n)).collect::<std::result::Result<_, _>>()?;
            let input = self.flat.f_narrow(0, self.rank * self.len + start, n)?;
            pending.push_back(pg.all_gather_unverified(&mut outs, &input)?);
            start += n;
        }
        Ok(())
    }
}
