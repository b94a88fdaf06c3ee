//! Sharded data parallelism: FSDP and HSDP, ZeRO-1/2, and the memory plan by stage.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod fsdp;
mod memory_plan;
mod zero;
