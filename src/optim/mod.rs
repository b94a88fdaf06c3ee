//! Optimizers in Rust over tch tensors, updating parameters in place (no autograd), so they work with
//! DDP's bucket views and expose their state for checkpoints. The arithmetic follows `torch.optim`'s
//! single-tensor implementations, step for step (`tests/optim.rs` compares with PyTorch).
//!
//! ```no_run
//! use tch_dist::optim::{AdamW, Optimizer};
//! # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let mut opt = AdamW::new(vs.trainable_variables(), 1e-3);
//! // after backward:
//! opt.step()?;
//! opt.zero_grad()?;
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod adamw;
mod sgd;
mod zero;

pub use adamw::AdamW;
pub use sgd::Sgd;
pub use zero::ShardedOptimizer;

use tch::Tensor;

use crate::error::Result;

/// What every optimizer here offers.
pub trait Optimizer {
    /// One update from the parameters' current `.grad` (parameters without a gradient are skipped).
    fn step(&mut self) -> Result<()>;
    /// Zeroes gradients in place, keeping bucket views intact.
    fn zero_grad(&mut self) -> Result<()>;
    /// The optimizer's state as named tensors (e.g. for [`crate::checkpoint`]).
    fn state_dict(&self) -> Vec<(String, Tensor)>;
    /// Restores state saved by [`state_dict`](Self::state_dict); errors name a missing or mis-shaped entry.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()>;
}

pub(crate) fn find<'a>(state: &'a [(String, Tensor)], key: &str, like: &Tensor) -> Result<&'a Tensor> {
    let t = state
        .iter()
        .find(|(n, _)| n == key)
        .map(|(_, t)| t)
        .ok_or_else(|| crate::Error::invalid("load_state_dict", format!("no entry {key:?}")))?;
    if t.size() != like.size() {
        return Err(crate::Error::mismatch("load_state_dict", format!("{key}: saved {:?}, expected {:?}", t.size(), like.size())));
    }
    Ok(t)
}
