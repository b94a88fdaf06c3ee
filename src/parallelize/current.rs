//! The plan a model is being built under, for model code that does not pass one along: inside
//! `let _plan = plan.enter();` (or `plan.build(&vs, || ..)`), `tch_dist::nn`'s `linear` is `plan.linear`,
//! its `embedding` is `plan.embedding`, its `batch_norm2d` is `plan.batch_norm` and its `unit` is
//! `plan.unit`; with no plan entered they give tch's own layers and the block itself. The scope is the
//! thread's, as tch's `no_grad_guard` is, so that a model's constructors keep tch's signatures. It
//! covers building the model; what runs later (a vocabulary-parallel loss) takes the plan itself
//! ([`Plan::cross_entropy`]).
//!
//! ```no_run
//! use tch::Device;
//! use tch_dist::nn::{self, Module};
//! use tch_dist::parallelize::{Plan, Style};
//! # fn main() -> tch_dist::Result<()> {
//! # let mesh = tch_dist::mesh::DeviceMesh::new(&tch_dist::ProcessGroup::from_env()?, &[("tp", 2)])?;
//! // the model's code, as in tch: no plan in its signatures
//! fn mlp(p: &nn::Path) -> impl Module {
//!     let fc = nn::linear(p / "fc", 64, 256, Default::default());
//!     let proj = nn::linear(p / "proj", 256, 64, Default::default());
//!     nn::func(move |xs| xs.apply(&fc).gelu("none").apply(&proj))
//! }
//! let plan = Plan::tensor_parallel(&mesh, "tp")?.style("*.fc", Style::colwise()).style("*.proj", Style::rowwise());
//! let vs = nn::VarStore::new(Device::Cpu);
//! let model = {
//!     let _plan = plan.enter();
//!     mlp(&(vs.root() / "mlp"))
//! };
//! # Ok(()) }
//! ```
use std::cell::RefCell;
use std::marker::PhantomData;

use tch::nn;

use super::layers::{BatchNorm, Embedding, Linear};
use super::parallel::{Parallel, Unit};
use super::plan::Plan;
use crate::error::Result;
use crate::optim::Optimizer;

thread_local! {
    /// The plans entered on this thread, innermost last.
    static ENTERED: RefCell<Vec<Plan>> = const { RefCell::new(Vec::new()) };
}

/// While it lives, this thread builds layers through the plan it came from ([`Plan::enter`]); dropping it
/// returns to the plan entered before (or none).
#[must_use = "the plan is left as soon as the guard is dropped"]
pub struct PlanGuard {
    /// The number of plans entered before this one.
    depth: usize,
    /// The scope is the thread's: the guard must be dropped where it was made.
    _thread: PhantomData<*const ()>,
}

impl Drop for PlanGuard {
    fn drop(&mut self) {
        ENTERED.with(|e| e.borrow_mut().truncate(self.depth));
    }
}

impl Plan {
    /// Builds this thread's layers through this plan until the guard is dropped (see the module docs).
    pub fn enter(&self) -> PlanGuard {
        let depth = ENTERED.with(|e| {
            let mut e = e.borrow_mut();
            e.push(self.clone());
            e.len() - 1
        });
        PlanGuard { depth, _thread: PhantomData }
    }

    /// Builds the model with `build` while this plan is entered, then [`finish`](Plan::finish)es it: the
    /// enter-build-finish of the module docs in one call.
    pub fn build<M>(&self, vs: &nn::VarStore, build: impl FnOnce() -> M) -> Result<Parallel<M>> {
        self.check_optimizer_apart("Plan::build")?;
        self.bind(vs)?;
        let model = {
            let _plan = self.enter();
            build()
        };
        self.finish(vs, model)
    }

    /// [`build`](Plan::build), then [`finish_with_optimizer`](Plan::finish_with_optimizer): the model
    /// and the optimizer its layout needs, together (the only way under ZeRO-1/2, where the optimizer
    /// is part of the layout).
    ///
    /// ```no_run
    /// # fn f(plan: tch_dist::parallelize::Plan, vs: tch::nn::VarStore) -> tch_dist::Result<()> {
    /// use tch_dist::optim::{AdamW, Optimizer};
    /// let (model, mut opt) = plan.build_with_optimizer(&vs, || tch::nn::linear(vs.root() / "fc", 4, 4, Default::default()),
    ///     |params| Box::new(AdamW::new(params, 1e-3)))?;
    /// # Ok(()) }
    /// ```
    pub fn build_with_optimizer<M>(
        &self,
        vs: &nn::VarStore,
        build: impl FnOnce() -> M,
        make: impl Fn(Vec<tch::Tensor>) -> Box<dyn Optimizer + Send>,
    ) -> Result<(Parallel<M>, Box<dyn Optimizer + Send>)> {
        self.bind(vs)?;
        let model = {
            let _plan = self.enter();
            build()
        };
        self.finish_with_optimizer(vs, model, make)
    }
}

/// The plan entered on this thread, innermost; a plan of no parallelism when none is.
pub fn current() -> Plan {
    ENTERED.with(|e| e.borrow().last().cloned()).unwrap_or_default()
}

/// [`Plan::linear`] of the entered plan: tch's `nn::linear` when none is, or its split form.
pub(crate) fn linear(path: &nn::Path, in_dim: i64, out_dim: i64, config: nn::LinearConfig) -> Result<Linear> {
    current().linear(path, in_dim, out_dim, config)
}

/// [`Plan::embedding`] of the entered plan: tch's `nn::embedding` when none is, or its split form.
pub(crate) fn embedding(path: &nn::Path, num: i64, dim: i64, config: nn::EmbeddingConfig) -> Result<Embedding> {
    current().embedding(path, num, dim, config)
}

/// [`Plan::batch_norm`] of the entered plan, 2-d: tch's `nn::batch_norm2d` when none is, or its
/// synchronised form ([`Plan::sync_batch_norm`]).
pub(crate) fn batch_norm2d(path: &nn::Path, out_dim: i64, config: nn::BatchNormConfig) -> Result<BatchNorm> {
    current().batch_norm(path, 2, out_dim, config)
}

/// [`Plan::batch_norm`] of the entered plan, 1-d.
pub(crate) fn batch_norm1d(path: &nn::Path, out_dim: i64, config: nn::BatchNormConfig) -> Result<BatchNorm> {
    current().batch_norm(path, 1, out_dim, config)
}

/// [`Plan::batch_norm`] of the entered plan, 3-d.
pub(crate) fn batch_norm3d(path: &nn::Path, out_dim: i64, config: nn::BatchNormConfig) -> Result<BatchNorm> {
    current().batch_norm(path, 3, out_dim, config)
}

/// [`Plan::unit`] of the entered plan: an FSDP unit of the block when it shards, else the block itself.
pub(crate) fn unit<M>(path: &nn::Path, module: M) -> Result<Unit<M>> {
    current().unit(path, module)
}
