//! Tests that need the process to themselves, one at a time: those that read the process-wide allocation
//! counter (FSDP's and the ruler's memory, activation checkpointing's) and those that seed tch's global
//! generator and compare what it draws (TP's initialisation, the plan's layers, the pipeline's layers, the
//! sampler, dropout under recompute), and the one that counts the process's live backward callbacks. Every test here first takes
//! `common::alone()`.
#[path = "../common/mod.rs"]
mod common;

mod backward_callbacks;
mod data;
mod fsdp_memory;
mod memory;
mod parallelize;
mod pipeline_seed;
mod recompute;
mod tp_init;
