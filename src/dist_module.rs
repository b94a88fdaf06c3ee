//! What every distributed wrapper offers, as one trait: [`DistModule`]; and [`WithTrain`], which makes a
//! model that is only an `nn::ModuleT` (dropout, batch norm) a `ModuleT` under DDP and FSDP too.
//!
//! The trait is what data parallelism adds (gradient synchronisation, the optimizer's parameters, the
//! state and backward) and holds for every wrapper, whatever the model's forward takes. The
//! forward is tch's: a wrapper of an `nn::Module` is an `nn::Module` (so an `nn::ModuleT`), a wrapper of
//! a [`WithTrain`] model an `nn::ModuleT`, each with its `f_forward` / `f_forward_t` twin that returns
//! errors; a model with another forward runs through the wrapper's `forward_with`. Generic code asks
//! for `DistModule + nn::ModuleT`:
//!
//! ```no_run
//! use tch::{nn, nn::ModuleT, Device, Kind, Tensor};
//! use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
//! use tch_dist::prelude::*;
//! let pg = std::sync::Arc::new(tch_dist::ProcessGroup::from_env()?);
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::seq_t()
//!     .add(nn::linear(vs.root() / "l1", 8, 32, Default::default()))
//!     .add_fn_t(|x, train| x.dropout(0.1, train))
//!     .add(nn::linear(vs.root() / "l2", 32, 1, Default::default()));
//! let model = DistributedDataParallel::new(&vs, WithTrain(net), DdpOptions::default().process_group(pg))?;
//! let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
//! // accumulate two microbatches, reduce once
//! model.no_sync(|m| m.backward(&x.apply_t(m, true).mean(Kind::Float)))?;
//! model.backward(&x.apply_t(&model, true).mean(Kind::Float))?;
//! // the whole model's norm, whatever the layout (over what the optimizer steps)
//! let norm = tch_dist::optim::clip_grad_norm(&model.parameters(), 1.0, 2.0)?;
//! model.zero_grad()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
use tch::{nn, Tensor};

use crate::error::Result;

/// One interface over DDP, FSDP (and HSDP), the plan's models (TP among them) and pipeline stages,
/// whatever their model's forward; each implements it in its own module (this one names none of them).
/// `use tch_dist::prelude::*` brings it in. (A pipeline rank is not one: its forwards and backwards run
/// inside `PipelineRank::step`.)
pub trait DistModule {
    /// What the optimizer steps: the parameters, or this rank's shards of them under FSDP.
    fn parameters(&self) -> Vec<Tensor>;

    /// Whether the next backwards reduce gradients across the data-parallel ranks (default true).
    /// False accumulates them locally, and the next synchronised backward reduces the sum: PyTorch's
    /// `require_backward_grad_sync` (DDP) and `set_requires_gradient_sync` (FSDP2).
    fn set_requires_gradient_sync(&self, on: bool);

    /// The setting [`set_requires_gradient_sync`](Self::set_requires_gradient_sync) made.
    fn requires_gradient_sync(&self) -> bool;

    /// This rank's model values by VarStore name: FSDP's gathered from the shards (a collective: every
    /// rank calls it where any rank does; copies on the CPU); elsewhere the variables themselves, a
    /// tensor-parallel slice as this rank holds it, a pipeline rank's own chunks.
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>>;

    /// Drops every gradient (set to none: PyTorch's default, and tch's `Optimizer::zero_grad`).
    fn zero_grad(&self) -> Result<()> {
        crate::hooks::drop_grads(&self.parameters())
    }

    /// Backward of `loss`, errors returned (with their kind: a lost peer stays a peer failure).
    fn backward(&self, loss: &Tensor) -> Result<()> {
        loss.f_backward()?;
        Ok(())
    }

    /// Runs `f` with gradient synchronisation off (PyTorch's `no_sync()`); the setting before it comes
    /// back after, also if `f` panics.
    fn no_sync<R>(&self, f: impl FnOnce(&Self) -> R) -> R
    where
        Self: Sized,
    {
        without_sync(self, Self::requires_gradient_sync, Self::set_requires_gradient_sync, f)
    }
}

/// Runs `f` with `w`'s gradient synchronisation off, and puts the setting back after, also if `f`
/// panics (`no_sync`, also for wrappers of models without a forward).
pub(crate) fn without_sync<W: ?Sized, R>(w: &W, get: fn(&W) -> bool, set: fn(&W, bool), f: impl FnOnce(&W) -> R) -> R {
    struct Restore<'a, W: ?Sized>(&'a W, fn(&W, bool), bool);
    impl<W: ?Sized> Drop for Restore<'_, W> {
        fn drop(&mut self) {
            (self.1)(self.0, self.2);
        }
    }
    let _restore = Restore(w, set, get(w));
    set(w, false);
    f(w)
}

/// A model whose forward takes tch's train flag (`nn::ModuleT` only), to wrap in DDP or FSDP: the
/// wrapper is then an `nn::ModuleT` itself, for `xs.apply_t(&ddp, train)` and `nn::seq_t().add(..)`.
/// (A model that is an `nn::Module` needs no marker: its wrapper is a `Module`, so a `ModuleT` too.
/// Rust's coherence rules allow one of the two impls per wrapper type, hence the marker.)
#[derive(Debug)]
pub struct WithTrain<M>(pub M);

impl<M: nn::ModuleT> nn::ModuleT for WithTrain<M> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.0.forward_t(xs, train)
    }
}
