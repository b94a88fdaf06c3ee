//! ZeRO-2's reduction, DDP's gradient sink: a bucket is reduce-scattered as soon as its last gradient
//! arrives, so each rank keeps only its shard (1/N) of the reduced gradient. Full-size gradients live only in flight: a bucket's buffer
//! exists from its first gradient until its reduction finishes, and at most [`MAX_IN_FLIGHT`] reductions
//! run at once, so the transient memory is a few buckets, not the model.
use std::collections::VecDeque;

use tch::Tensor;

use crate::ddp::GradSink;
use crate::error::Result;
use crate::group::flat::{self, Reduction};
use crate::group::ProcessGroup;

/// Reductions running while backward goes on. One: bucket b reduces while bucket b+1 fills, so at most
/// two bucket buffers are alive (measured on 2 processes sharing 2 cores, a second one bought no speed
/// and cost a bucket of memory).
const MAX_IN_FLIGHT: usize = 1;

pub(crate) struct GradShards {
    world: i64,
    /// Per bucket: elements of one shard; the bucket's buffer holds `world * len` (zero padded).
    pub lens: Vec<i64>,
    /// Per bucket: real elements (the rest of its buffer is padding).
    numels: Vec<i64>,
    /// Per bucket: this rank's shard of the averaged gradient, written by each synchronised backward.
    pub shards: Vec<Tensor>,
    /// Per bucket being filled: its buffer.
    filling: Vec<Option<Tensor>>,
    in_flight: VecDeque<Reduction>,
}

impl GradShards {
    /// `buckets`: (elements, a parameter of the bucket for dtype and device) per bucket.
    pub(super) fn new(buckets: &[(i64, Tensor)], world: usize) -> Result<GradShards> {
        let world = world as i64;
        let mut lens = Vec::with_capacity(buckets.len());
        let mut shards = Vec::with_capacity(buckets.len());
        for (numel, like) in buckets {
            let numel = *numel;
            let len = (numel + world - 1) / world;
            shards.push(Tensor::f_zeros([len], (like.kind(), like.device()))?);
            lens.push(len);
        }
        let numels = buckets.iter().map(|b| b.0).collect();
        let filling = (0..buckets.len()).map(|_| None).collect();
        Ok(GradShards { world, lens, numels, shards, filling, in_flight: VecDeque::new() })
    }

    fn complete_oldest(&mut self, pg: &ProcessGroup) -> Result<()> {
        if let Some(ring) = self.in_flight.pop_front() {
            ring.finish(pg)?;
        }
        Ok(())
    }
}

impl GradSink for GradShards {
    /// Copies one parameter's gradient, scaled, into bucket `b`'s buffer at `offset` (an undefined
    /// gradient, from an unused parameter, writes zeros). The caller then drops the parameter's gradient.
    fn accept(&mut self, b: usize, offset: i64, numel: i64, grad: &Tensor, scale: f64) -> Result<()> {
        let buf = match &self.filling[b] {
            Some(t) => t.shallow_clone(),
            None => {
                let like = &self.shards[b];
                let t = Tensor::f_empty([self.world * self.lens[b]], (like.kind(), like.device()))?;
                // every slot is written once per backward; only the padding needs zeros
                let pad = self.world * self.lens[b] - self.numels[b];
                if pad > 0 {
                    let _ = t.f_narrow(0, self.numels[b], pad)?.f_zero_()?;
                }
                self.filling[b] = Some(t.shallow_clone());
                t
            }
        };
        let mut slot = buf.f_narrow(0, offset, numel)?;
        if grad.defined() {
            // copy and average in one pass
            // (the Tensor overload of mul with out= writes in place; the Scalar one makes a temporary)
            let _ = grad.f_reshape([-1])?.f_mul_out(&slot, &Tensor::from(scale))?;
        } else {
            let _ = slot.f_zero_()?;
        }
        Ok(())
    }

    /// Starts reduce-scattering bucket `b` (already averaged) into its shard.
    fn launch(&mut self, pg: &ProcessGroup, b: usize) -> Result<()> {
        while self.in_flight.len() >= MAX_IN_FLIGHT {
            self.complete_oldest(pg)?;
        }
        let buf = match self.filling[b].take() {
            Some(f) => f,
            None => {
                return Err(crate::Error::invalid(
                    "ZeRO-2 reduction",
                    format!("bucket {b} launched before any of its gradients"),
                ))
            }
        };
        let label = format!("ZeRO-2 reduce-scatter, bucket {b}");
        self.in_flight.push_back(flat::reduce_scatter(pg, buf, self.shards[b].shallow_clone(), None, label)?);
        Ok(())
    }

    /// Waits for every reduction of this backward.
    fn finish(&mut self, pg: &ProcessGroup) -> Result<()> {
        while !self.in_flight.is_empty() {
            self.complete_oldest(pg)?;
        }
        Ok(())
    }

    /// Ends an iteration (after a failed backward, forgets its buffers).
    fn reset(&mut self) {
        self.in_flight.clear();
        self.filling.iter_mut().for_each(|f| *f = None);
    }
}
