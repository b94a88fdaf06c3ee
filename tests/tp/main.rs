//! Tensor and expert parallelism, device meshes and placements.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod context_parallel;
mod mesh;
mod mesh_3d;
mod moe;
mod parallel_dims;
mod placement;
mod tp;
mod tp_attention;
mod tp_sequence;
mod tp_vocab;
