//! tch-dist: what `torch.distributed` gives PyTorch users, for tch-rs.
//!
//! Layers, bottom up: a thin C++ shim over libtorch's c10d (the `tch-dist-sys` crate: `csrc/` and its raw
//! FFI); safe wrappers
//! ([`store`], [`group`], [`Work`], [`hooks`], [`memory`]); and the features built on them: [`nn`] is
//! tch's `nn` with the layers a [`parallelize::Plan`] splits.
//!
//! ```no_run
//! use tch_dist::{ProcessGroup, ReduceOp};
//! let pg = ProcessGroup::from_env()?; // as torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! let mut t = tch::Tensor::from_slice(&[pg.rank() as f32]);
//! pg.allreduce(&mut t, ReduceOp::Sum)?;
//! # Ok::<(), tch_dist::Error>(())
//! ```
// tch's convention: `forward` is infallible (it panics with the error), `f_forward` returns it. As
// `nn::Module`s the layers go wherever tch expects one: `nn::seq()`, `Checkpointed`, DDP, FSDP units.
// (Defined before the modules, which use it: macros are in scope after their definition.)
#![warn(unreachable_pub)]
macro_rules! module {
    ($t:ty) => {
        impl tch::nn::Module for $t {
            fn forward(&self, x: &tch::Tensor) -> tch::Tensor {
                self.f_forward(x).unwrap_or_else(|e| panic!("{e}"))
            }
        }
    };
}

mod dtype;
mod ffi;
mod names;
#[cfg(feature = "plot")]
mod plot;
mod random;
mod storage;
mod var_store;

pub mod amp;
pub mod checkpoint;
pub mod context_parallel;
pub mod data;
pub mod ddp;
mod dist_module;
mod error;
pub mod flight;
pub mod fsdp;
pub mod ft;
pub mod group;
pub use ffi::hooks;
pub mod init;
pub mod memory;
pub mod mesh;
pub mod moe;
pub mod nn;
pub mod optim;
pub mod parallel_dims;
pub mod parallelize;
pub mod pipeline;
pub mod placement;
pub mod recompute;
#[cfg(feature = "testing")]
#[doc(hidden)] // libtorch's own bucket assignment and object layouts, for tests to compare with
pub mod reference;
mod settings;
pub use ffi::store;
pub use ffi::stream;
pub mod sync_batch_norm;
pub mod sync_debug;
pub mod throughput;
pub mod timeline;
pub mod tp;
mod work;
pub mod zero;

pub use dist_module::{DistModule, WithTrain};

/// What a training program names most: `use tch_dist::prelude::*;` brings in the [`DistModule`] trait (the
/// wrappers' `backward`, `zero_grad`, `parameters`, `no_sync`, `state_dict`), the layout
/// from degrees, the plan and its styles, and process groups.
pub mod prelude {
    pub use crate::dist_module::{DistModule, WithTrain};
    pub use crate::group::{ProcessGroup, ReduceOp};
    pub use crate::parallel_dims::{ParallelDims, REST};
    pub use crate::parallelize::{Plan, Style};
}
pub use error::{Error, Result};
pub use group::{Backend, BackendConfig, CheckPolicy, Collectives, GroupOptions, P2pOp, ProcessGroup, ReduceOp};
pub use init::{default_group, destroy_process_group, init_process_group, InitOptions};
pub use store::{Store, TcpStoreOptions};
pub use work::Work;

/// The libtorch directory tch-dist was built against (its `lib/`, holding `libtorch_cpu.so`).
pub const LIBTORCH_LIB: &str = ffi::LIBTORCH_LIB;

/// Every Rust block of README.md and docs/ compiles as a doc test (`no_run`: they need a launch), so a
/// renamed or removed method breaks the build, not a reader's first try.
#[cfg(doctest)]
mod docs_compile {
    // the README opens with indented commands: after a line of text they continue its paragraph, not code
    #[doc = "README.md:"]
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/amp.md")]
    struct Amp;
    #[doc = include_str!("../docs/checkpoints.md")]
    struct Checkpoints;
    #[doc = include_str!("../docs/context-parallel.md")]
    struct ContextParallel;
    #[doc = include_str!("../docs/ddp.md")]
    struct Ddp;
    #[doc = include_str!("../docs/expert-parallel.md")]
    struct ExpertParallel;
    #[doc = include_str!("../docs/fault-tolerance.md")]
    struct FaultTolerance;
    #[doc = include_str!("../docs/fsdp.md")]
    struct Fsdp;
    #[doc = include_str!("../docs/parallelize.md")]
    struct Parallelize;
    #[doc = include_str!("../docs/porting.md")]
    struct Porting;
    #[doc = include_str!("../docs/pipeline.md")]
    struct Pipeline;
    #[doc = include_str!("../docs/process-groups.md")]
    struct ProcessGroups;
    #[doc = include_str!("../docs/sync-batch-norm.md")]
    struct SyncBatchNorm;
    #[doc = include_str!("../docs/tchrun.md")]
    struct Tchrun;
    #[doc = include_str!("../docs/tp.md")]
    struct Tp;
    #[doc = include_str!("../docs/zero.md")]
    struct Zero;
}
