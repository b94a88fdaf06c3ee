//! DistributedDataParallel: buckets, hooks, the reducer against PyTorch, join, memory, PowerSGD, and the DistModule trait over every wrapper.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod bucket;
mod ddp;
mod ddp_join;
mod ddp_memory;
mod ddp_powersgd;
mod dist_module;
mod error_kinds;
mod hooks;
