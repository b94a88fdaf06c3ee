//! Training pieces: optimizers against torch.optim, mixed precision, activation checkpointing, clipping, data, the strict NCCL mode.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod amp;
mod clip;
mod data;
mod optim;
mod recompute;
mod strict_nccl;
