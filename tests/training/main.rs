//! Training pieces: optimizers against torch.optim, mixed precision, clipping, the strict NCCL mode,
//! SyncBatchNorm.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod amp;
mod clip;
mod optim;
mod strict_nccl;
mod sync_batch_norm;
