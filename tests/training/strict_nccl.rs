//! The strict NCCL mode (GroupOptions::strict_nccl): point-to-point orders that NCCL cannot run fail
//! with an error naming what waits on what, where plain Gloo runs them; what NCCL can run passes.
use crate::common;

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use tch_dist::{Collectives, Error, GroupOptions, P2pOp, ProcessGroup, ReduceOp};

const SHORT: Duration = Duration::from_secs(3);

fn opts(strict: bool, timeout: Duration) -> GroupOptions {
    GroupOptions { strict_nccl: strict, ..common::gloo_opts(timeout) }
}

/// Plain Gloo without agreement checks, as the old ring posted its messages (a checked receive waits for
/// its header before returning, which would block these orders on Gloo too).
fn plain_unchecked() -> GroupOptions {
    GroupOptions { verify: false, ..opts(false, SHORT) }
}

fn ones(n: i64, v: f64) -> Tensor {
    Tensor::full([n], v, (Kind::Float, Device::Cpu))
}

/// The old ring's step, replayed: receive from the peer, then send to it, each posted on its own.
fn unbatched_step(pg: &ProcessGroup) -> tch_dist::Result<()> {
    let peer = 1 - pg.rank();
    let mut into = ones(4, 0.0);
    let r = pg.recv_async(&mut into, peer, 7)?;
    let s = pg.send_async(&ones(4, pg.rank() as f64), peer, 7)?;
    r.wait()?;
    s.wait()
}

/// Runs `f` on a rank, then holds its group until every rank of `world` has its result: a rank whose
/// strict-mode wait ends first would otherwise close its connections, and a peer still waiting would see
/// its peer gone instead of its own timeout.
fn held<T>(
    world: usize,
    f: impl Fn(&ProcessGroup) -> T + Clone + Send + Sync + 'static,
) -> impl Fn(ProcessGroup) -> T + Clone + Send + Sync + 'static {
    let all = std::sync::Arc::new(std::sync::Barrier::new(world));
    move |pg| {
        let out = f(&pg);
        all.wait();
        out
    }
}

#[test]
fn an_unbatched_receive_before_a_send_runs_on_gloo_but_fails_in_the_strict_mode() {
    // Gloo runs each message on its own, so the order NCCL deadlocks on passes
    for r in common::run_threads_with(2, plain_unchecked(), |pg| unbatched_step(&pg)) {
        r.expect("plain Gloo");
    }
    let t0 = Instant::now();
    let errs = common::run_threads_with(2, opts(true, SHORT), held(2, |pg| unbatched_step(pg).expect_err("strict")));
    assert!(t0.elapsed() < SHORT * 3, "the error came after {:?}", t0.elapsed());
    for (rank, e) in errs.iter().enumerate() {
        let s = e.to_string();
        assert!(matches!(e, Error::Timeout { .. }), "rank {rank}: {s}");
        assert!(s.contains("strict NCCL mode") && s.contains("pair stream of ranks 0 and 1"), "rank {rank}: {s}");
        assert!(s.contains(&format!("receive with rank {}", 1 - rank)), "rank {rank}: {s}");
        assert!(s.contains("queued behind it") && s.contains("send of"), "rank {rank}: {s}");
    }
}

/// A ring of unbatched steps on three ranks: each rank's first operation is with a different peer.
fn unbatched_ring(pg: &ProcessGroup) -> tch_dist::Result<()> {
    let (rank, world) = (pg.rank(), pg.size());
    let mut into = ones(4, 0.0);
    let r = pg.recv_async(&mut into, (rank + world - 1) % world, 0)?;
    let s = pg.send_async(&ones(4, 1.0), (rank + 1) % world, 0)?;
    r.wait()?;
    s.wait()
}

#[test]
fn a_ring_of_unbatched_steps_on_three_ranks_waits_in_a_circle_in_the_strict_mode() {
    for r in common::run_threads_with(3, plain_unchecked(), |pg| unbatched_ring(&pg)) {
        r.expect("plain Gloo");
    }
    let errs = common::run_threads_with(3, opts(true, SHORT), held(3, |pg| unbatched_ring(pg).expect_err("strict")));
    for (rank, e) in errs.iter().enumerate() {
        let s = e.to_string();
        assert!(matches!(e, Error::Timeout { .. }), "rank {rank}: {s}");
        assert!(s.contains("two-rank NCCL communicator") && s.contains("batch_isend_irecv"), "rank {rank}: {s}");
    }
}

#[test]
fn a_batched_step_passes_in_the_strict_mode_on_two_and_three_ranks() {
    for world in [2, 3] {
        let got = common::run_threads_with(world, opts(true, SHORT), move |pg| {
            let (rank, world) = (pg.rank(), pg.size());
            let (left, right) = ((rank + world - 1) % world, (rank + 1) % world);
            let into = ones(5, -1.0);
            let mine = ones(5, rank as f64);
            for _ in 0..3 {
                pg.batch_isend_irecv(vec![P2pOp::recv(&into, left), P2pOp::send(&mine, right)])
                    .and_then(|w| w.wait())
                    .expect("batch");
            }
            (left, into.double_value(&[0]))
        });
        for (left, v) in got {
            assert_eq!(v, left as f64, "{world} ranks");
        }
    }
}

#[test]
fn tags_are_ignored_in_the_strict_mode_messages_match_in_posting_order() {
    let got = common::run_threads_with(2, opts(true, SHORT), |pg| {
        if pg.rank() == 0 {
            pg.send(&ones(2, 5.0), 1, 5).expect("send a");
            pg.send(&ones(2, 7.0), 1, 7).expect("send b");
            (0.0, 0.0)
        } else {
            let (mut a, mut b) = (ones(2, 0.0), ones(2, 0.0));
            pg.recv(&mut b, 0, 7).expect("recv tagged 7");
            pg.recv(&mut a, 0, 5).expect("recv tagged 5");
            (b.double_value(&[0]), a.double_value(&[0]))
        }
    });
    // the receive posted first gets the message sent first, whatever the tags say
    assert_eq!(got[1], (5.0, 7.0));
}

#[test]
fn a_size_mismatch_in_the_strict_mode_names_both_ranks_and_shapes() {
    let got = common::run_threads_with(2, opts(true, SHORT), |pg| {
        if pg.rank() == 0 {
            pg.batch_isend_irecv(vec![P2pOp::send(&ones(4, 1.0), 1)]).and_then(|w| w.wait()).map(|_| String::new())
        } else {
            let into = ones(3, 0.0);
            pg.batch_isend_irecv(vec![P2pOp::recv(&into, 0)]).and_then(|w| w.wait()).map(|_| String::new())
        }
    });
    got[0].as_ref().expect("the sender completes");
    let e = got[1].as_ref().expect_err("the receiver refuses");
    let s = e.to_string();
    assert!(matches!(e, Error::Mismatch { .. }), "{s}");
    assert!(s.contains("rank 0 sent Float[4] but rank 1 posted Float[3]") && s.contains("strict NCCL mode"), "{s}");
}

/// The flat collectives of ZeRO and FSDP, each algorithm, under the strict mode.
fn flat(pg: &ProcessGroup) -> (Vec<f64>, Vec<f64>) {
    let (rank, world) = (pg.rank() as i64, pg.size() as i64);
    let mine = Tensor::arange(3, (Kind::Float, Device::Cpu)) + (10 * rank) as f64;
    let mut all = Tensor::zeros([3 * world], (Kind::Float, Device::Cpu));
    pg.all_gather_into_tensor(&mut all, &mine).expect("all_gather_into_tensor");
    let input = Tensor::arange(3 * world, (Kind::Float, Device::Cpu)) * (rank + 1) as f64;
    let mut out = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    pg.reduce_scatter_tensor(&mut out, &input, ReduceOp::Sum).expect("reduce_scatter_tensor");
    (
        Vec::<f64>::try_from(&all.to_kind(Kind::Double)).unwrap(),
        Vec::<f64>::try_from(&out.to_kind(Kind::Double)).unwrap(),
    )
}

#[test]
fn all_gather_into_tensor_and_reduce_scatter_tensor_on_two_and_three_ranks() {
    for world in [2usize, 3] {
        for (rank, (all, out)) in
            common::run_threads_with(world, opts(true, SHORT), |pg| flat(&pg)).into_iter().enumerate()
        {
            let want_all: Vec<f64> = (0..world).flat_map(|r| (0..3).map(move |i| (i + 10 * r) as f64)).collect();
            assert_eq!(all, want_all, "{world} ranks, rank {rank}");
            let sum: f64 = (1..=world).map(|k| k as f64).sum();
            let want_out: Vec<f64> = (0..3).map(|i| (3 * rank + i) as f64 * sum).collect();
            assert_eq!(out, want_out, "{world} ranks, rank {rank}");
        }
    }
}

#[test]
fn every_flat_algorithm_runs_in_the_strict_mode() {
    // the seam's choice is the group's option; each must give the same as the native collective
    for c in [Collectives::Ring, Collectives::Native] {
        let o = GroupOptions { collectives: c, ..opts(true, SHORT) };
        for world in [2, 3] {
            let got = common::run_threads_with(world, o.clone(), |pg| flat(&pg));
            let want = common::run_threads_with(world, opts(false, SHORT), |pg| flat(&pg));
            assert_eq!(got, want, "{c:?}, {world} ranks");
        }
    }
}

/// Rank 0 posts a batched exchange and then an allreduce; rank 1 the allreduce first. Gloo matches each
/// by itself and completes both; NCCL runs a group's collectives and batches on one stream in posting
/// order, so the two ranks would wait on each other for ever.
fn batch_and_allreduce_crossed(pg: &ProcessGroup) -> tch_dist::Result<f64> {
    let peer = 1 - pg.rank();
    let (into, mine) = (ones(4, -1.0), ones(4, pg.rank() as f64));
    let mut sum = ones(4, 1.0);
    let batch = || pg.batch_isend_irecv(vec![P2pOp::recv(&into, peer), P2pOp::send(&mine, peer)]);
    let works = if pg.rank() == 0 {
        let b = batch()?;
        vec![b, pg.allreduce_async(&mut sum, ReduceOp::Sum)?]
    } else {
        let a = pg.allreduce_async(&mut sum, ReduceOp::Sum)?;
        vec![a, batch()?]
    };
    for w in works {
        w.wait()?;
    }
    Ok(sum.double_value(&[0]) + into.double_value(&[0]))
}

#[test]
fn a_collective_and_a_batch_posted_in_different_orders_fail_in_the_strict_mode() {
    // plain Gloo, checks off: both complete (sum 2, and the peer's value)
    let plain = common::run_threads_with(2, plain_unchecked(), |pg| batch_and_allreduce_crossed(&pg).expect("plain"));
    assert_eq!(plain, vec![3.0, 2.0]);
    for verify in [false, true] {
        let t0 = Instant::now();
        let o = GroupOptions { verify, ..opts(true, SHORT) };
        let errs = common::run_threads_with(2, o, held(2, |pg| batch_and_allreduce_crossed(pg).expect_err("strict")));
        assert!(t0.elapsed() < SHORT * 3, "verify {verify}: the error came after {:?}", t0.elapsed());
        for (rank, e) in errs.iter().enumerate() {
            let s = e.to_string();
            assert!(matches!(e, Error::Mismatch { .. }), "verify {verify}, rank {rank}: {s}");
            assert!(s.contains("strict NCCL mode") && s.contains("1st collective or batch"), "rank {rank}: {s}");
            assert!(s.contains("on rank 0") && s.contains("on rank 1"), "rank {rank}: {s}");
            if !verify {
                assert!(s.contains("batch of") && s.contains("allreduce(Sum)"), "rank {rank}: {s}");
            }
        }
    }
}

/// Without a bound device NCCL creates a group's communicator at its first collective, blocking until
/// every rank of the group makes one: a rank that never uses the group leaves the others waiting.
#[test]
fn a_lazily_connected_groups_first_collective_waits_for_every_rank_in_the_strict_mode() {
    let errs = common::run_threads_with(
        3,
        GroupOptions { verify: false, ..opts(true, SHORT) },
        held(3, |pg| {
            if pg.rank() == 2 {
                return None;
            }
            // ranks 0 and 1 exchange in a batch: on Gloo that needs nobody else
            let peer = 1 - pg.rank();
            let into = ones(2, 0.0);
            Some(pg.batch_isend_irecv(vec![P2pOp::recv(&into, peer), P2pOp::send(&ones(2, 1.0), peer)]).err())
        }),
    );
    for (rank, e) in errs.into_iter().enumerate().take(2) {
        let e = e.flatten().unwrap_or_else(|| panic!("rank {rank} must time out"));
        let s = e.to_string();
        assert!(matches!(e, Error::Timeout { .. }), "rank {rank}: {s}");
        assert!(s.contains("creates its NCCL communicator") && s.contains("rank 2 posted none"), "rank {rank}: {s}");
    }
}
