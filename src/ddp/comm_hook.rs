//! Communication hooks: how a ready bucket is reduced across ranks, as PyTorch's `register_comm_hook`.
//! A hook gets the bucket ([`GradBucket`]: its flat buffer and per-parameter views) and returns a
//! [`HookFuture`] that, once waited, has left the averaged gradients in the bucket's buffer.
//!
//! As in PyTorch, a hook receives the local gradients as they are (not divided by the world size) and
//! averages them itself. Without a hook DDP runs its own allreduce, which divides while copying the
//! gradients into the bucket (PyTorch's fast path, and its wire protocol).
//!
//! Built in: [`allreduce`], [`fp16_compress`], [`bf16_compress`] (PyTorch's `default_hooks`), and
//! [`PowerSgd`](super::powersgd::PowerSgd). Your own is any type implementing [`CommHook`]:
//!
//! ```
//! use std::sync::Arc;
//! use tch_dist::ddp::comm_hook::{CommHook, GradBucket, HookFuture};
//! use tch_dist::{ProcessGroup, ReduceOp};
//!
//! /// Averages in float64 on the wire.
//! #[derive(Debug)]
//! struct Float64Hook;
//!
//! impl CommHook for Float64Hook {
//!     fn run(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket) -> tch_dist::Result<HookFuture> {
//!         let mut wide = bucket.buffer().f_to_kind(tch::Kind::Double)?.f_div_scalar(pg.size() as f64)?;
//!         let work = pg.allreduce_async(&mut wide, ReduceOp::Sum)?;
//!         let mut buffer = bucket.buffer().shallow_clone();
//!         Ok(HookFuture::after(work).then(move || {
//!             buffer.f_copy_(&wide)?;
//!             Ok(())
//!         }))
//!     }
//! }
//! let _opts = tch_dist::ddp::DdpOptions::default().comm_hook(Arc::new(Float64Hook));
//! ```
use std::sync::Arc;

use tch::{Kind, Tensor};

use crate::error::Result;
use crate::group::{ProcessGroup, ReduceOp};
use crate::work::Work;

/// A bucket handed to a [`CommHook`]: PyTorch's `GradBucket`.
pub struct GradBucket {
    pub(crate) index: usize,
    pub(crate) count: usize,
    pub(crate) buffer: Tensor,
    pub(crate) gradients: Vec<Tensor>,
}

impl GradBucket {
    /// The bucket's position in launch order (0 is reduced first).
    pub fn index(&self) -> usize {
        self.index
    }
    /// Whether this is the last bucket reduced in an iteration.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }
    /// The flat gradient buffer; the averaged result goes back into it.
    pub fn buffer(&self) -> &Tensor {
        &self.buffer
    }
    /// One tensor per parameter, sharing the buffer's memory, in the bucket's order.
    pub fn gradients(&self) -> &[Tensor] {
        &self.gradients
    }
}

type Step = Box<dyn FnOnce() -> Result<()> + Send>;

/// A reduction in progress: a collective to wait for, then steps to run (which may start and wait for
/// further collectives, as PowerSGD's do). DDP waits for each bucket's future, in bucket order, before
/// backward returns.
#[must_use = "the bucket holds the result only after wait()"]
pub struct HookFuture {
    work: Option<Work>,
    steps: Vec<Step>,
}

impl HookFuture {
    /// Already done (the hook did its work synchronously).
    pub fn ready() -> HookFuture {
        HookFuture { work: None, steps: Vec::new() }
    }
    /// Done when `work` is.
    pub fn after(work: Work) -> HookFuture {
        HookFuture { work: Some(work), steps: Vec::new() }
    }
    /// Runs `step` once everything before it has finished.
    pub fn then(mut self, step: impl FnOnce() -> Result<()> + Send + 'static) -> HookFuture {
        self.steps.push(Box::new(step));
        self
    }
    /// Waits for the collective, then runs the steps in order.
    pub fn wait(self) -> Result<()> {
        if let Some(w) = self.work {
            w.wait()?;
        }
        for step in self.steps {
            step()?;
        }
        Ok(())
    }
}

/// How a ready bucket is reduced. `run` starts the reduction and returns without waiting for it, so
/// communication overlaps the rest of backward. Every rank must start the same collectives in the same
/// order. Hooks run inside backward (on autograd's thread for CUDA), hence `Send + Sync`.
pub trait CommHook: Send + Sync + std::fmt::Debug {
    fn run(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket) -> Result<HookFuture>;
    /// Whether buckets must be the same at every iteration. A hook whose collectives include ranks that
    /// may be at another iteration of their own DDP (a fault-tolerant replica that just joined) says
    /// true, and DDP keeps the layout it starts with (cut to the caps, in reverse parameter order)
    /// instead of rebuilding it after the first backward.
    fn fixed_layout(&self) -> bool {
        false
    }
}

/// PyTorch's `allreduce_hook`: divide by the world size, SUM-allreduce.
pub fn allreduce() -> Arc<dyn CommHook> {
    Arc::new(Compress(None))
}

/// PyTorch's `fp16_compress_hook`: cast to float16, divide, allreduce, cast back (half the bytes).
pub fn fp16_compress() -> Arc<dyn CommHook> {
    Arc::new(Compress(Some(Kind::Half)))
}

/// PyTorch's `bf16_compress_hook`: as [`fp16_compress`] in bfloat16 (float32's range).
pub fn bf16_compress() -> Arc<dyn CommHook> {
    Arc::new(Compress(Some(Kind::BFloat16)))
}

/// The allreduce hooks: on the wire in the bucket's dtype, or cast to `self.0`.
#[derive(Debug)]
struct Compress(Option<Kind>);

impl CommHook for Compress {
    fn run(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket) -> Result<HookFuture> {
        let world = pg.size() as f64;
        match self.0 {
            Some(k) if bucket.buffer.kind() != k => {
                let mut wire = bucket.buffer.f_to_kind(k)?;
                let _ = wire.f_div_scalar_(world)?;
                let work = pg.allreduce_unverified(&mut wire, ReduceOp::Sum)?;
                let mut buffer = bucket.buffer.shallow_clone();
                Ok(HookFuture::after(work).then(move || {
                    buffer.f_copy_(&wire)?;
                    Ok(())
                }))
            }
            _ => {
                let mut t = bucket.buffer.shallow_clone();
                let _ = t.f_div_scalar_(world)?;
                Ok(HookFuture::after(pg.allreduce_unverified(&mut t, ReduceOp::Sum)?))
            }
        }
    }
}
