//! Collectives and their failures: every operation against its reference, bad input named, lost peers and timeouts typed (run plain and in the strict NCCL mode).
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod collectives;
mod failures;
mod shutdown;
