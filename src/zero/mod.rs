//! ZeRO (Rajbhandari et al.), its three stages in one place. Stages 1 and 2 shard over DDP's buckets:
//! each bucket's parameters move into one flat buffer, and rank r owns the r-th contiguous 1/N of every
//! bucket. Stage 3 shards the parameters themselves, gathered unit by unit for forward and backward:
//! that is FSDP (see [`ZeroStage`]).
//! - **Stage 1**: gradients are allreduced as in plain DDP; each rank keeps optimizer state for its
//!   shards only, steps them, and the updated shards are all-gathered into every rank's parameters.
//! - **Stage 2**: in addition, each bucket is reduce-scattered as it becomes ready during backward, so a
//!   rank keeps only its shard of the averaged gradient (parameters have no `.grad` after backward).
//! - **Stage 3** ([`crate::fsdp`], or [`crate::parallelize::Plan::fully_shard`]): parameters, gradients
//!   and optimizer state sharded; any optimizer over the shards.
//! - **Master weights**: with bfloat16 or float16 parameters, each rank keeps a float32 copy of its
//!   shards; the inner optimizer steps that copy, which is cast back into the parameters.
//!
//! Checkpoints: [`Optimizer::state_dict`](crate::optim::Optimizer::state_dict) is this rank's shards (one file per rank);
//! [`ShardedOptimizer::consolidated_state_dict`] is the whole state in the unsharded optimizer's form,
//! loadable on any world size.
//!
//! A parameter that got no gradient (DDP's `find_unused_parameters`) is stepped with a zero gradient:
//! a flat shard cannot skip elements (FSDP behaves the same). Plain SGD then leaves it as it is;
//! momentum or weight decay move it, where unsharded DDP would leave its `.grad` unset and skip it.
//!
//! Per-rank bytes for Ψ parameters and N ranks, Adam: 16Ψ unsharded (float32), 8Ψ + 8Ψ/N stage 1,
//! 4Ψ + 12Ψ/N stage 2; with 16-bit parameters and float32 master weights, the paper's 4Ψ + 12Ψ/N and
//! 2Ψ + 14Ψ/N. `scripts/bench-memory.sh` measures them.
//!
//! Through the plan, one knob picks the stage (stage 3 is the plan's FSDP), and the model is built with
//! the optimizer for it:
//!
//! ```no_run
//! use tch_dist::ddp::DdpOptions;
//! use tch_dist::optim::{AdamW, Optimizer};
//! use tch_dist::parallelize::Plan;
//! use tch_dist::zero::ZeroStage;
//! # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let plan = Plan::new().replicate(DdpOptions::default()).zero(ZeroStage::Two)?;
//! let linear = || tch::nn::linear(vs.root(), 4, 4, Default::default());
//! let (model, mut opt) = plan.build_with_optimizer(&vs, linear, |params| Box::new(AdamW::new(params, 1e-3)))?;
//! // loop: forward, model.backward(&loss)?, opt.clip_grad_norm(1.0, 2.0)?, opt.step()?, opt.zero_grad()?
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Or over a DDP model directly:
//!
//! ```no_run
//! use std::sync::Arc;
//! use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
//! use tch_dist::optim::{AdamW, Optimizer};
//! use tch_dist::zero::{ShardedOptimizer, ZeroStage};
//! # let pg = Arc::new(tch_dist::ProcessGroup::from_env()?);
//! # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! # let net = tch::nn::linear(vs.root(), 4, 4, Default::default());
//! let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg))?;
//! let mut opt = ShardedOptimizer::new(&ddp, ZeroStage::Two, |shards| Box::new(AdamW::new(shards, 1e-3)))?;
//! // loop: ddp.backward(&loss)?; opt.step()?; opt.zero_grad()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
mod consolidate;
mod flat;
mod grad_shards;
mod optimizer;

pub use optimizer::ShardedOptimizer;

/// Which ZeRO stage shards what over the data-parallel ranks (DeepSpeed's `zero_optimization.stage`),
/// each a policy over the same placements: a stage's shards are recorded in [`crate::placement`], where
/// clipping, checkpoints and `memory_breakdown` read them. The plan applies any of them
/// ([`Plan::zero`](crate::parallelize::Plan::zero)) and builds the model with the matching optimizer
/// ([`Plan::build_with_optimizer`](crate::parallelize::Plan::build_with_optimizer)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroStage {
    /// Optimizer state sharded: DDP's allreduce, then each rank steps its shard of every bucket
    /// ([`ShardedOptimizer`]).
    One,
    /// Optimizer state and gradients sharded: DDP's buckets reduce-scattered into shards
    /// ([`ShardedOptimizer`]).
    Two,
    /// Parameters too, gathered unit by unit for forward and backward: FSDP
    /// ([`crate::fsdp::FullyShardedDataParallel`], the plan's
    /// [`fully_shard`](crate::parallelize::Plan::fully_shard)), whose optimizer is any over its shards.
    Three,
}

impl ZeroStage {
    /// The stage's number, as the paper and DeepSpeed name it.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }
}
