//! Whole programs: the examples trained in every layout against one process, the forum demo, the GPU kit on the CPU.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod cnn;
mod forum;
mod gpt;
mod gpu_kit;
mod hf;
mod launches;
mod layout;
mod llama;
mod min_gpt;
mod tch_llama;
mod train;
