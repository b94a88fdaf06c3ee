//! Pipelines: schedules, the process pipeline, data-parallel stages, memory.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod pipeline;
mod pipeline_data_parallel;
mod pipeline_memory;
mod pipeline_schedule;
