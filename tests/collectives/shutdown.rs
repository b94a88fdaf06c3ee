//! Groups shut down as PyTorch's `destroy_process_group` shuts them down: a process that returns from
//! `main` with a collective still queued loses none of it (the exit shuts the groups down, pending work
//! first), and `destroy_process_group` ends every group, later calls getting a clear error.
use crate::common;

use std::time::Duration;

use tch::{Device, Kind, Tensor};
use tch_dist::{InitOptions, ReduceOp};

const N: i64 = 1 << 22;

/// Rank 0 posts a large allreduce through the default group (a static: never dropped) and returns at
/// once; the others post theirs seconds later and check the sum. On Gloo the process's exit already
/// waits for a collective its worker thread has started; on NCCL, without the shutdown at exit, the
/// queued kernels die with the process (the GPU kit's `exit-with-work-in-flight` checks that case).
#[test]
#[ignore = "rank process spawned by a_process_returning_with_work_in_flight_loses_none_of_it"]
fn worker_returns_with_work_in_flight() {
    let pg = tch_dist::init_process_group(&InitOptions::from_env().expect("env")).expect("init");
    if pg.rank() != 0 {
        std::thread::sleep(Duration::from_secs(2));
    }
    let mut t = Tensor::full([N], (pg.rank() + 1) as f64, (Kind::Float, Device::Cpu));
    let work = pg.allreduce_async(&mut t, ReduceOp::Sum).expect("post");
    if pg.rank() == 0 {
        // what a program that forgot to wait does: the work and the tensor are dropped, the process ends
        drop(work);
        println!("rank 0 returned");
        return;
    }
    work.wait().expect("the allreduce completes");
    let n = pg.size() as f64;
    let want = n * (n + 1.0) / 2.0;
    let (lo, hi) = (t.min().double_value(&[]), t.max().double_value(&[]));
    assert!(lo == want && hi == want, "sum {lo}..{hi}, want {want}");
    println!("rank {} summed {want}", pg.rank());
}

#[test]
fn a_process_returning_with_work_in_flight_loses_none_of_it() {
    let outs = common::run_ranks_ok(
        &common::test_name!("worker_returns_with_work_in_flight"),
        3,
        &[],
        Duration::from_secs(60),
    );
    let all: String = outs.iter().map(common::show).collect();
    assert!(all.contains("rank 0 returned") && all.contains("rank 2 summed 6"), "{all}");
    assert!(!all.contains("abort"), "{all}");
}

/// `destroy_process_group` shuts down the default group and its subgroups, even while a model still
/// holds a handle: the queued collective completes first, and what comes later is a clear error.
#[test]
#[ignore = "rank process spawned by destroy_process_group_ends_every_group"]
fn worker_destroys_its_groups() {
    let pg = tch_dist::init_process_group(&InitOptions::from_env().expect("env")).expect("init");
    let sub = pg.new_subgroup(&[0, 1], "pair").expect("subgroup").expect("a member");
    let mut t = Tensor::ones([N], (Kind::Float, Device::Cpu));
    let work = sub.allreduce_async(&mut t, ReduceOp::Sum).expect("post");
    tch_dist::destroy_process_group().expect("destroy");
    work.wait().expect("the queued allreduce completed before the shutdown");
    assert_eq!(t.max().double_value(&[]), 2.0);
    assert!(tch_dist::default_group().is_none());
    for (name, g) in [("default", &*pg), ("pair", &sub)] {
        let e = g.allreduce(&mut t, ReduceOp::Sum).expect_err("a shut-down group refuses work");
        let s = e.to_string();
        assert!(s.contains("shut down") && s.contains("destroy_process_group"), "{name}: {s}");
    }
    // twice is fine, as in PyTorch after everything is gone
    tch_dist::destroy_process_group().expect("destroy again");
    println!("rank {} destroyed", pg.rank());
}

#[test]
fn destroy_process_group_ends_every_group() {
    let outs = common::run_ranks_ok(&common::test_name!("worker_destroys_its_groups"), 2, &[], Duration::from_secs(60));
    let all: String = outs.iter().map(common::show).collect();
    assert!(all.contains("rank 0 destroyed") && all.contains("rank 1 destroyed"), "{all}");
}

/// A group dropped as soon as it is built (a rank with nothing to do) never fails its peer's formation:
/// Gloo's connecting side returns once it has sent its greeting, and closing the socket then failed the
/// accepting side with "Connection closed by peer" in 7% of formations under load, before the group
/// waited for every rank at formation.
#[test]
fn a_group_dropped_at_once_never_fails_its_peers_formation() {
    let opts = common::gloo_opts(Duration::from_secs(30));
    let mut failures = Vec::new();
    for round in 0..100 {
        let store = tch_dist::Store::hash().expect("hash store");
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (store, opts) = (store.clone(), opts.clone());
                std::thread::spawn(move || tch_dist::ProcessGroup::new(&store, rank, 2, &opts).map(drop))
            })
            .collect();
        for (rank, h) in ranks.into_iter().enumerate() {
            if let Err(e) = h.join().expect("rank thread") {
                failures.push(format!("round {round}, rank {rank}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
