//! Launching: tchrun, elastic rounds, the environment, fault drills and soaks.
//! One test binary per area: each module is one file of tests.
#[path = "../common/mod.rs"]
mod common;

mod fault_tolerance;
mod faults;
mod init_env;
mod soak;
mod tchrun;
mod tchrun_elastic;
