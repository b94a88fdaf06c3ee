//! Wire compatibility: a PyTorch rank (`init_process_group("gloo", init_method="env://")`) and Rust ranks
//! form one group and compute correct collectives, whichever is rank 0; also with the device:backend form
//! of the backend string, whose store layout (a prefix per device type) is the one PyTorch's
//! "cpu:gloo,cuda:nccl" group uses. PyTorch refuses NCCL without a GPU, so here only the Gloo half
//! ("cpu:gloo") is tested; the NCCL half runs in the GPU kit.
use crate::common;

use std::time::Duration;

use tch_dist::ProcessGroup;

#[test]
#[ignore = "rank process spawned by the interop tests"]
fn worker_interop_rust_rank() {
    let pg = ProcessGroup::from_env().expect("init from env");
    assert!(!pg.verifies(), "interop runs with TCH_DIST_VERIFY=0: Python ranks do not send our checks");
    assert_eq!(Ok(pg.backend_config().to_string()), std::env::var("TCH_DIST_BACKEND"));
    common::scenario::scenario(&pg);
    println!("rust rank {} ok", pg.rank());
}

/// Starts `world` ranks; those in `python_ranks` run PyTorch, the others this crate; all ask for
/// `backend` (PyTorch's backend string, which tch-dist reads from TCH_DIST_BACKEND).
fn mixed_group(world: usize, python_ranks: &[usize]) {
    mixed_group_on(world, python_ranks, "gloo");
}

fn mixed_group_on(world: usize, python_ranks: &[usize], backend: &str) {
    let worker = common::test_name!("worker_interop_rust_rank");
    let env = [("TCH_DIST_BACKEND", backend.to_string()), ("TCH_DIST_TIMEOUT_SECS", "60".to_string())];
    let children = common::spawn_mixed(&worker, world, python_ranks, "tests/py/interop_rank.py", &env);
    let outs = common::wait_all(children, Duration::from_secs(120));
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} failed:\n{}", common::show(o));
        let who = if python_ranks.contains(&r) { "python" } else { "rust" };
        let want = format!("{who} rank {r} ok");
        assert!(String::from_utf8_lossy(&o.stdout).contains(&want), "rank {r}:\n{}", common::show(o));
    }
}

#[test]
fn python_rank0_rust_rank1() {
    mixed_group(2, &[0]);
}

#[test]
fn rust_rank0_python_rank1() {
    mixed_group(2, &[1]);
}

#[test]
fn three_ranks_python_in_the_middle() {
    mixed_group(3, &[1]);
}

#[test]
fn device_backend_pairs_share_pytorchs_store_layout_gloo_half() {
    mixed_group_on(2, &[0], "cpu:gloo");
}
