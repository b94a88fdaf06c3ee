//! Model-state bytes per rank before running anything: the ZeRO paper's accounting (Rajbhandari et al.,
//! 2020, §5) for data parallelism and ZeRO stages 1–3, at any size and world; for a model built in any
//! layout, its size is read from the placements ([`model_elements`]).
//!
//! Each parameter costs `param` bytes for itself, `grad` for its gradient and `optimizer` for the
//! optimizer's state (the paper's 2 + 2 + K with K = 12 under mixed-precision Adam: float32 master weight,
//! momentum and variance). Stage 1 shards the optimizer state over the N ranks, stage 2 the gradients
//! too, stage 3 the parameters too; a shard is ⌈Ψ/N⌉ elements. These are the same quantities
//! `memory_breakdown` reports for a running model (`tests/sharding/memory_plan.rs` checks the two agree on a
//! small model), so a plan made here predicts what a real run holds, activations and buffers aside.
//!
//! ```
//! use tch_dist::memory::plan::{model_states, Precision};
//! use tch_dist::zero::ZeroStage;
//! // the paper's Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam
//! let gb = |s| model_states(7_500_000_000, 64, s, Precision::MIXED_ADAM).total() as f64 / 1e9;
//! assert_eq!(format!("{:.1}", gb(None)), "120.0"); // DDP: nothing sharded
//! assert_eq!(format!("{:.1}", gb(Some(ZeroStage::Three))), "1.9");
//! ```

use crate::zero::ZeroStage;

/// Bytes per parameter element, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Precision {
    pub param: u64,
    pub grad: u64,
    pub optimizer: u64,
}

impl Precision {
    /// 16-bit parameters and gradients, float32 master weights and Adam moments: 2 + 2 + 12 (the paper's).
    pub const MIXED_ADAM: Precision = Precision { param: 2, grad: 2, optimizer: 12 };
    /// Float32 parameters and gradients, Adam(W) moments: 4 + 4 + 8.
    pub const FP32_ADAM: Precision = Precision { param: 4, grad: 4, optimizer: 8 };
    /// Float32 parameters and gradients, SGD without momentum (no state).
    pub const FP32_SGD: Precision = Precision { param: 4, grad: 4, optimizer: 0 };
}

/// Per-rank bytes of the model states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelStates {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
}

impl ModelStates {
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// The whole model's trainable elements (the paper's Ψ) from a rank that may hold only part of it: each
/// trainable variable of `vs` counts the elements of its global shape as its placement
/// ([`crate::placement`]) records it (FSDP's shard and a tensor-parallel slice count the whole
/// parameter), so that `model_states(model_elements(&vs), world, zero, p)` plans another layout of the
/// same model. A pipeline stage's VarStore counts that stage's variables.
pub fn model_elements(vs: &tch::nn::VarStore) -> u64 {
    vs.trainable_variables()
        .iter()
        .map(|t| match crate::placement::of(t) {
            Some(l) => l.global_shape().iter().product::<i64>() as u64,
            None => t.numel() as u64,
        })
        .sum()
}

/// Per-rank model-state bytes of `params` parameters on `world` ranks, sharded by the ZeRO stage `zero`
/// (stage 3 is FSDP's), or replicated (DDP) with `None`.
pub fn model_states(params: u64, world: u64, zero: Option<ZeroStage>, p: Precision) -> ModelStates {
    let shard = params.div_ceil(world.max(1));
    let (ps, gs, os) = match zero {
        None => (params, params, params),
        Some(ZeroStage::One) => (params, params, shard),
        Some(ZeroStage::Two) => (params, shard, shard),
        Some(ZeroStage::Three) => (shard, shard, shard),
    };
    ModelStates { parameters: ps * p.param, gradients: gs * p.grad, optimizer: os * p.optimizer }
}
