//! PyTorch and tch-dist ranks in one group: collectives and DDP across the two (plain Gloo, the Python peers do not speak the strict mode).
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod ddp_interop;
mod interop;
mod sync_batch_norm;
