//! What every distributed wrapper offers, as one trait: [`DistModule`]; and [`WithTrain`], which makes a
//! model that is only an `nn::ModuleT` (dropout, batch norm) a `ModuleT` under DDP and FSDP too.
//!
//! The forward is tch's: a wrapper of an `nn::Module` is an `nn::Module` (so an `nn::ModuleT`), a
//! wrapper of a [`WithTrain`] model an `nn::ModuleT`; the trait has their `f_forward` / `f_forward_t`
//! twins, which return errors, so that code generic over a `DistModule` runs its forward too:
//!
//! ```no_run
//! use tch::{nn, nn::ModuleT, Device, Kind, Tensor};
//! use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
//! use tch_dist::{DistModule, WithTrain};
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
//! let norm = model.clip_grad_norm(1.0, 2.0)?;
//! model.zero_grad()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
use tch::{nn, Tensor};

use crate::ddp::DistributedDataParallel;
use crate::error::Result;
use crate::fsdp::{FsdpUnit, FullyShardedDataParallel};
use crate::pipeline::{PipelineRank, Stage};

/// One interface over DDP, FSDP (and HSDP), the plan's models (TP among them), pipeline stages and a
/// rank's pipeline chunks.
pub trait DistModule {
    /// The forward with tch's train flag, errors returned: the `f_` twin of `nn::ModuleT::forward_t`,
    /// which the wrappers implement too (`xs.apply_t(&model, train)`).
    fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor>;

    /// The forward without a train flag (evaluation mode, for a model that has one): the `f_` twin of
    /// `nn::Module::forward`.
    fn f_forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.f_forward_t(xs, false)
    }

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

    /// Clips the gradients so that the whole model's norm is at most `max_norm`; returns the norm before
    /// clipping. Each parameter's placement says which groups its part of the norm is summed over (see
    /// [`crate::optim::clip_grad_norm`]). Collective.
    fn clip_grad_norm(&self, max_norm: f64, norm_type: f64) -> Result<Tensor> {
        crate::optim::clip_grad_norm(&self.parameters(), max_norm, norm_type)
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

impl<M: nn::ModuleT> nn::ModuleT for DistributedDataParallel<WithTrain<M>> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::ModuleT> nn::ModuleT for FullyShardedDataParallel<WithTrain<M>> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::ModuleT> nn::ModuleT for FsdpUnit<WithTrain<M>> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::ModuleT> DistModule for DistributedDataParallel<M> {
    fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        DistributedDataParallel::f_forward_t(self, xs, train)
    }
    fn parameters(&self) -> Vec<Tensor> {
        DistributedDataParallel::parameters(self)
    }
    fn set_requires_gradient_sync(&self, on: bool) {
        DistributedDataParallel::set_requires_gradient_sync(self, on)
    }
    fn requires_gradient_sync(&self) -> bool {
        DistributedDataParallel::requires_gradient_sync(self)
    }
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(DistributedDataParallel::state_dict(self))
    }
    /// Refused once a [`ShardedOptimizer`](crate::zero::ShardedOptimizer) shards the model: it steps its
    /// own gradients (DDP's buckets, or the shards), which need not be the parameters'.
    fn clip_grad_norm(&self, max_norm: f64, norm_type: f64) -> Result<Tensor> {
        if self.sharded() {
            return Err(optimizer_clips("DistributedDataParallel::clip_grad_norm", "ZeRO"));
        }
        crate::optim::clip_grad_norm(&self.parameters(), max_norm, norm_type)
    }
}

/// The error of a model's `clip_grad_norm` under ZeRO (`what`), whose optimizer holds the gradients it
/// steps.
pub(crate) fn optimizer_clips(op: &str, what: &str) -> crate::Error {
    crate::Error::invalid(
        op,
        format!(
            "under {what} the optimizer holds the gradients it steps: call clip_grad_norm on the optimizer \
             (Optimizer::clip_grad_norm)"
        ),
    )
}

impl<M: nn::ModuleT> DistModule for FullyShardedDataParallel<M> {
    fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        FullyShardedDataParallel::f_forward_t(self, xs, train)
    }
    fn parameters(&self) -> Vec<Tensor> {
        FullyShardedDataParallel::parameters(self)
    }
    fn set_requires_gradient_sync(&self, on: bool) {
        FullyShardedDataParallel::set_requires_gradient_sync(self, on)
    }
    fn requires_gradient_sync(&self) -> bool {
        FullyShardedDataParallel::requires_gradient_sync(self)
    }
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        FullyShardedDataParallel::state_dict(self)
    }
    /// The shards' gradients and, after `no_sync`, the parameters' own.
    fn zero_grad(&self) -> Result<()> {
        FullyShardedDataParallel::zero_grad(self)
    }
}

/// One pipeline chunk, on its own: [`PipelineRank`] drives its data-parallel sync per microbatch.
impl DistModule for Stage {
    /// A stage's layers are tch `Module`s: the train flag does not reach them.
    fn f_forward_t(&self, xs: &Tensor, _train: bool) -> Result<Tensor> {
        Stage::f_forward(self, xs)
    }
    fn parameters(&self) -> Vec<Tensor> {
        Stage::parameters(self)
    }
    fn set_requires_gradient_sync(&self, on: bool) {
        Stage::set_requires_gradient_sync(self, on)
    }
    fn requires_gradient_sync(&self) -> bool {
        Stage::requires_gradient_sync(self)
    }
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        Stage::state_dict(self)
    }
    fn zero_grad(&self) -> Result<()> {
        Stage::zero_grad(self)
    }
}

/// A rank's pipeline chunks. Its backwards run inside [`PipelineRank::step`], by the schedule.
impl DistModule for PipelineRank {
    fn f_forward_t(&self, _xs: &Tensor, _train: bool) -> Result<Tensor> {
        Err(crate::Error::invalid(
            "PipelineRank::f_forward_t",
            "a pipeline runs its forwards inside step(x, y, loss), microbatch by microbatch; call step",
        ))
    }
    fn backward(&self, _loss: &Tensor) -> Result<()> {
        Err(crate::Error::invalid(
            "PipelineRank::backward",
            "a pipeline runs its backwards inside step(x, y, loss), microbatch by microbatch; call step",
        ))
    }
    fn parameters(&self) -> Vec<Tensor> {
        PipelineRank::parameters(self)
    }
    fn set_requires_gradient_sync(&self, on: bool) {
        self.chunks().iter().for_each(|c| c.set_requires_gradient_sync(on))
    }
    fn requires_gradient_sync(&self) -> bool {
        self.chunks().iter().all(|c| c.requires_gradient_sync())
    }
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut all = Vec::new();
        for c in self.chunks() {
            all.extend(c.state_dict()?);
        }
        Ok(all)
    }
    fn zero_grad(&self) -> Result<()> {
        PipelineRank::zero_grad(self)
    }
}
