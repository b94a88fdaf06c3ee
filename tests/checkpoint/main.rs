//! Checkpoints: single-file, sharded, resharded across layouts.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod checkpoint;
mod checkpoint_reshard;
mod checkpoint_sharded;
mod hf;
