//! A unit: a module whose parameters FSDP shards as one (PyTorch's `fully_shard` of a layer or block).
//! Its forward gathers them first and frees them after; a marker on its output gathers them again just
//! before its backward; hooks on them count gradients in, so the unit is reduce-scattered once they are.
use std::sync::Arc;

use tch::{nn, Tensor};

use super::runtime::Runtime;
use crate::dist_module::WithTrain;
use crate::error::Result;
use crate::hooks::{self, GradHook};

/// A module sharded by FSDP (see [`FsdpBuilder::fully_shard`](super::FsdpBuilder::fully_shard)).
pub struct FsdpUnit<M> {
    // First, so the hooks go before anything they point to.
    _hooks: Vec<GradHook>,
    module: M,
    rt: Arc<Runtime>,
    id: usize,
}

impl<M> FsdpUnit<M> {
    pub(crate) fn new(module: M, rt: Arc<Runtime>, id: usize, hooks: Vec<GradHook>) -> Self {
        FsdpUnit { _hooks: hooks, module, rt, id }
    }

    pub fn module(&self) -> &M {
        &self.module
    }
}

/// Hooks counting the gradients of unit `id`'s trainable parameters.
pub(crate) fn grad_hooks(rt: &Arc<Runtime>, id: usize, params: &[Tensor]) -> Result<Vec<GradHook>> {
    params
        .iter()
        .filter(|p| p.requires_grad())
        .map(|p| {
            let weak = Arc::downgrade(rt);
            hooks::on_grad_accumulated(p, move || {
                if let Some(rt) = weak.upgrade() {
                    rt.grad_arrived(id)
                }
            })
        })
        .collect()
}

/// Unit `id`'s forward around `f`: gather (and prefetch), cast floating inputs to the compute dtype (as
/// FSDP2's `cast_forward_inputs`), run, free, and mark the output for the pre-backward gather.
pub(crate) fn forward(rt: &Arc<Runtime>, id: usize, x: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> Result<Tensor> {
    rt.check_finished(id)?;
    rt.begin_forward(id)?;
    let kind = rt.compute_kind(id);
    let x = if x.is_floating_point() && x.kind() != kind { x.f_to_kind(kind)? } else { x.shallow_clone() };
    let y = f(&x);
    rt.end_forward(id, y.requires_grad())?;
    if !y.requires_grad() {
        return Ok(y);
    }
    let weak = Arc::downgrade(rt);
    let (y, _) = hooks::backward_marker(&y, "FsdpPreBackward", move || match weak.upgrade() {
        Some(rt) => rt.pre_backward(id),
        None => Err(crate::Error::invalid("FSDP backward", "the FSDP model was dropped before its backward")),
    })?;
    Ok(y)
}

impl<M> FsdpUnit<M> {
    /// The unit's forward around any call of its module, for a block whose forward takes more than the
    /// activations (a rotary table, an attention mask, positions: captured by `f`, passed as they are).
    /// `x`, the activations, is cast to the compute dtype as [`f_forward`](Self::f_forward) casts it;
    /// `f` gets the module and that `x`.
    ///
    /// ```no_run
    /// # use tch::Tensor;
    /// # struct Block;
    /// # impl Block { fn forward(&self, x: &Tensor, rope: &Tensor) -> Tensor { x * rope } }
    /// # fn f(unit: &tch_dist::fsdp::FsdpUnit<Block>, x: &Tensor, rope: &Tensor) -> tch_dist::Result<Tensor> {
    /// unit.f_forward_with(x, |block, x| block.forward(x, rope))
    /// # }
    /// ```
    pub fn f_forward_with(&self, x: &Tensor, f: impl FnOnce(&M, &Tensor) -> Tensor) -> Result<Tensor> {
        forward(&self.rt, self.id, x, |x| f(&self.module, x))
    }

    /// [`f_forward_with`](Self::f_forward_with), panicking on error as tch's infallible methods do.
    pub fn forward_with(&self, x: &Tensor, f: impl FnOnce(&M, &Tensor) -> Tensor) -> Tensor {
        self.f_forward_with(x, f).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::Module> FsdpUnit<M> {
    /// The unit's forward, errors returned (tch's `f_` convention).
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        forward(&self.rt, self.id, x, |x| self.module.forward(x))
    }
}

impl<M: nn::ModuleT> FsdpUnit<M> {
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        forward(&self.rt, self.id, x, |x| self.module.forward_t(x, train))
    }

    /// [`f_forward_t`](Self::f_forward_t), panicking on error as tch's infallible methods do.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(x, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::Module> nn::Module for FsdpUnit<M> {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.f_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: std::fmt::Debug> std::fmt::Debug for FsdpUnit<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpUnit").field("unit", &self.id).field("module", &self.module).finish()
    }
}

impl<M: nn::ModuleT> nn::ModuleT for FsdpUnit<WithTrain<M>> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}
