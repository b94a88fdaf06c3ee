//! Optimizers in Rust over tch tensors, updating parameters in place (no autograd), so they work with
//! DDP's bucket views and expose their state for checkpoints. The arithmetic follows `torch.optim`'s, on
//! the path PyTorch would take (multi-tensor on CUDA, single-tensor on the CPU, or the one chosen with
//! `foreach`; ATen's fused AdamW on request), bit for bit (`tests/training/optim.rs` compares with PyTorch).
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
mod clip;
mod sgd;
mod tch_optimizer;

#[doc(hidden)]
pub use adamw::two_pass_variant;
pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, GradNorm};
pub use sgd::{Sgd, SgdConfig};
pub use tch_optimizer::TchOptimizer;

use tch::Tensor;

use crate::error::Result;

/// What every optimizer here offers.
pub trait Optimizer {
    /// One update from the parameters' current `.grad` (parameters without a gradient are skipped).
    fn step(&mut self) -> Result<()>;
    /// Drops the gradients it steps (set to none: PyTorch's `zero_grad()` default, tch's
    /// `nn::Optimizer::zero_grad`, and what every [`crate::DistModule::zero_grad`] does); DDP's next
    /// backward puts them back into its buckets.
    fn zero_grad(&mut self) -> Result<()>;
    /// The optimizer's state as named tensors (e.g. for [`crate::checkpoint`]).
    fn state_dict(&self) -> Vec<(String, Tensor)>;
    /// Restores state saved by [`state_dict`](Self::state_dict); errors name a missing or mis-shaped entry.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()>;
    /// The gradient tensors the next [`step`](Self::step) reads, to be modified in place (unscaling by
    /// [`crate::amp::GradScaler`], clipping).
    fn gradients(&mut self) -> Result<Vec<Tensor>>;
    /// What the optimizer holds, in bytes.
    fn memory(&self) -> OptimizerMemory;
    /// The tensors it steps and how their state is keyed, for sharded checkpoints
    /// ([`crate::checkpoint::StateDict::optimizer`]); empty when it cannot say. Where a stepped tensor
    /// lies is read from [`crate::placement`]: a variable (whole, a tensor-parallel slice, FSDP's shard),
    /// or the parts of several that a ZeRO shard holds.
    fn stepped(&self) -> Vec<Stepped> {
        Vec::new()
    }
    /// Clips the gradients the next [`step`](Self::step) reads so that the whole model's gradient has
    /// at most `max_norm`; returns the whole model's norm before clipping (a tensor: no host sync). Each
    /// [`stepped`](Self::stepped) tensor's placement says where its part of the norm is summed (a slice
    /// or shard over its group, a replica nowhere), so this one call serves every layout: the
    /// parameters, tensor-parallel slices, ZeRO's and FSDP's shards. Collective where anything is
    /// sharded; after backward, before the step.
    ///
    /// The default reads [`stepped`](Self::stepped), whose tensors must carry the gradients `step` reads
    /// once [`gradients`](Self::gradients) has run. Every rank of a group something is sharded over must
    /// step a part of it, as ZeRO's empty shards and FSDP's do: a rank that names no group takes part in
    /// no sum.
    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<Tensor> {
        let grads = self.gradients()?;
        let stepped: Vec<Tensor> = self.stepped().into_iter().map(|s| s.tensor).collect();
        if stepped.is_empty() && grads.iter().any(|g| g.defined()) {
            return Err(crate::Error::invalid(
                "Optimizer::clip_grad_norm",
                "this optimizer does not say which tensors it steps (Optimizer::stepped is not \
                 implemented): clip its parameters with optim::clip_grad_norm",
            ));
        }
        GradNorm::new(norm_type).parameters(&stepped).clip(max_norm)
    }
}

/// A boxed optimizer (what [`crate::parallelize::Plan::build_with_optimizer`] returns) is one, so that it goes
/// wherever `&mut dyn Optimizer` is taken (`GradScaler::unscale`, `StateDict::optimizer`).
impl<O: Optimizer + ?Sized> Optimizer for Box<O> {
    fn step(&mut self) -> Result<()> {
        (**self).step()
    }
    fn zero_grad(&mut self) -> Result<()> {
        (**self).zero_grad()
    }
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        (**self).state_dict()
    }
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        (**self).load_state_dict(state)
    }
    fn gradients(&mut self) -> Result<Vec<Tensor>> {
        (**self).gradients()
    }
    fn memory(&self) -> OptimizerMemory {
        (**self).memory()
    }
    fn stepped(&self) -> Vec<Stepped> {
        (**self).stepped()
    }
    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<Tensor> {
        (**self).clip_grad_norm(max_norm, norm_type)
    }
}

/// One tensor an optimizer steps, and the keys of its state in [`Optimizer::state_dict`].
pub struct Stepped {
    pub tensor: Tensor,
    /// Its state keys are `{prefix}{field}` (`adamw.3.exp_avg`).
    pub prefix: String,
    /// The key of its float32 master weights, where kept.
    pub master_key: Option<String>,
}

/// The stepped tensors of an optimizer over `params`, keyed `{name}.{index}.{field}`.
pub(crate) fn stepped_params(name: &str, params: &[Tensor]) -> Vec<Stepped> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| Stepped { tensor: p.shallow_clone(), prefix: format!("{name}.{i}."), master_key: None })
        .collect()
}

/// Bytes an optimizer holds beyond the model's parameters and DDP's gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OptimizerMemory {
    /// Optimizer state (momentum, Adam's moments, step counters).
    pub state: i64,
    /// Float32 master copies of 16-bit parameters.
    pub master: i64,
    /// ZeRO-2's gradient shards.
    pub gradient_shards: i64,
    /// Elements of parameters this rank updates, read from the placements of what it steps (its shards' parts
    /// of the variables; all of them when unsharded).
    pub owned_elements: i64,
}

pub(crate) fn bytes(t: &Tensor) -> i64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as i64
}

/// The defined gradients of `params`.
/// An optimizer skips a parameter without a gradient, unless FSDP manages it (a module's own parameter,
/// empty between uses, whose gradient goes to its shard): one built over those before the model was
/// finished would train nothing, silently.
pub(crate) fn skip_without_grad(what: &str, p: &Tensor) -> Result<()> {
    if crate::placement::of(p).is_some_and(|l| l.local().is_some()) {
        return Err(crate::error::Error::invalid(
            what,
            format!(
                "it steps a {:?} module parameter that FSDP shards (empty between uses, never given a gradient): \
                 build the optimizer over the model's parameters (this rank's shards) after finish",
                p.size()
            ),
        ));
    }
    Ok(())
}

/// `ts` grouped by device and dtype, in order of first appearance (torch's
/// `_group_tensors_by_device_and_dtype`): one multi-tensor launch or one flat message per group.
pub(crate) fn by_device_and_dtype(ts: &[Tensor]) -> Vec<((tch::Device, tch::Kind), Vec<Tensor>)> {
    let mut out: Vec<((tch::Device, tch::Kind), Vec<Tensor>)> = Vec::new();
    for t in ts {
        let key = (t.device(), t.kind());
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(t.shallow_clone()),
            None => out.push((key, vec![t.shallow_clone()])),
        }
    }
    out
}

pub(crate) fn grads_of(params: &[Tensor]) -> Vec<Tensor> {
    params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect()
}

/// State bytes from a state dict, and the parameters' elements.
pub(crate) fn memory_of(state: &[(String, Tensor)], params: &[Tensor]) -> OptimizerMemory {
    OptimizerMemory {
        state: state.iter().map(|(_, t)| bytes(t)).sum(),
        owned_elements: params.iter().map(crate::placement::held_elements).sum(),
        ..Default::default()
    }
}

/// The restored value of a state tensor: `saved` copied into the `current` tensor when it has the same
/// shape and dtype (nothing to copy when it is `saved` itself, as a checkpoint loaded in place leaves
/// it), else a copy of its own.
pub(crate) fn restore(current: Option<&Tensor>, saved: &Tensor) -> Result<Tensor> {
    match current {
        Some(c) if c.size() == saved.size() && c.kind() == saved.kind() => {
            if c.data_ptr() != saved.data_ptr() || c.numel() == 0 {
                let _g = tch::no_grad_guard();
                c.shallow_clone().f_copy_(saved)?;
            }
            Ok(c.shallow_clone())
        }
        _ => Ok(saved.f_detach_copy()?),
    }
}

pub(crate) fn find<'a>(state: &'a [(String, Tensor)], key: &str, like: &Tensor) -> Result<&'a Tensor> {
    let t = state
        .iter()
        .find(|(n, _)| n == key)
        .map(|(_, t)| t)
        .ok_or_else(|| crate::Error::invalid("load_state_dict", format!("no entry {key:?}")))?;
    if t.size() != like.size() {
        return Err(crate::Error::mismatch(
            "load_state_dict",
            format!("{key}: saved {:?}, expected {:?}", t.size(), like.size()),
        ));
    }
    Ok(t)
}
