//! Every collective on 2 and 3 ranks, checked element by element, as threads (HashStore) and as
//! processes (TCPStore through the torchrun environment).
use crate::common;

use std::time::Duration;

use common::scenario::{f32s, scenario};
use tch::{Device, Kind, Tensor};
use tch_dist::{CheckPolicy, Error, GroupOptions, ProcessGroup, ReduceOp};

const T: Duration = Duration::from_secs(60);

#[test]
fn collectives_threads_2_ranks() {
    common::run_threads(2, T, |pg| scenario(&pg));
}

#[test]
fn collectives_threads_2_ranks_unverified() {
    common::run_threads(2, T, |mut pg| {
        pg.set_verify(false);
        scenario(&pg)
    });
}

/// NCCL's check-once policy, on Gloo: the scenario (collectives, batches, pairwise send/recv, each
/// repeated) runs with every rank making the same decisions, on 2 and 3 ranks; and the first call of a
/// kind still catches a disagreement, in a collective and in a send/recv, after calls of other kinds.
#[test]
fn the_check_once_policy_decides_alike_on_every_rank() {
    for world in [2, 3] {
        let opts = GroupOptions { checks: CheckPolicy::Once, ..common::gloo_opts(T) };
        common::run_threads_with(world, opts, |pg| {
            for _ in 0..3 {
                scenario(&pg);
            }
        });
    }
    let opts = GroupOptions { checks: CheckPolicy::Once, ..common::gloo_opts(T) };
    let errs = common::run_threads_with(2, opts, |pg| {
        let cpu = (Kind::Float, Device::Cpu);
        let mut t = Tensor::ones([5], cpu);
        pg.allreduce(&mut t, ReduceOp::Sum).unwrap();
        pg.allreduce(&mut t, ReduceOp::Sum).unwrap();
        // the first broadcast, of another shape on each rank
        let mut odd = Tensor::ones([3 + pg.rank() as i64], cpu);
        let collective = pg.broadcast(&mut odd, 0).unwrap_err();
        // the pair's first send and receive, of other shapes
        let p2p = if pg.rank() == 0 {
            pg.send(&Tensor::ones([6], cpu), 1, 0).err()
        } else {
            pg.recv(&mut Tensor::zeros([4], cpu), 0, 0).err()
        };
        (collective, p2p)
    });
    for (r, (collective, p2p)) in errs.into_iter().enumerate() {
        assert!(matches!(collective, Error::Mismatch { .. }), "rank {r}: {collective}");
        if r == 1 {
            let e = p2p.expect("the receiver refuses a tensor of another shape");
            assert!(e.to_string().contains("rank 0 sent Float[6]"), "{e}");
        }
    }
}

#[test]
fn collectives_threads_3_ranks() {
    common::run_threads(3, T, |pg| scenario(&pg));
}

#[test]
#[ignore = "rank process spawned by the *_processes tests"]
fn worker_collectives() {
    let pg = ProcessGroup::from_env().expect("init from env");
    scenario(&pg);
    println!("rank {} ok", pg.rank());
}

#[test]
fn collectives_processes_2_ranks() {
    let outs = common::run_ranks_ok(&common::test_name!("worker_collectives"), 2, &[], Duration::from_secs(120));
    assert!(String::from_utf8_lossy(&outs[1].stdout).contains("rank 1 ok"));
}

#[test]
fn collectives_processes_3_ranks() {
    let outs = common::run_ranks_ok(&common::test_name!("worker_collectives"), 3, &[], Duration::from_secs(120));
    assert!(String::from_utf8_lossy(&outs[2].stdout).contains("rank 2 ok"));
}

#[test]
fn bad_arguments_are_refused_with_names() {
    common::run_threads(2, T, |pg| {
        let mut outs = vec![Tensor::zeros([3], (Kind::Float, Device::Cpu))];
        let e = pg.all_gather(&mut outs, &Tensor::zeros([3], (Kind::Float, Device::Cpu))).unwrap_err();
        assert!(e.to_string().contains("1 output tensors for 2 ranks"), "{e}");
        let mut outs: Vec<Tensor> = (0..2).map(|_| Tensor::zeros([4], (Kind::Float, Device::Cpu))).collect();
        let e = pg.all_gather(&mut outs, &Tensor::zeros([3], (Kind::Float, Device::Cpu))).unwrap_err();
        assert!(e.to_string().contains("tensor 0 is Float[4]"), "{e}");
        let e = pg.send(&Tensor::zeros([1], (Kind::Float, Device::Cpu)), 5, 0).unwrap_err();
        assert!(e.to_string().contains("rank 5 is out of range"), "{e}");
        let mut it = Tensor::zeros([1], (Kind::Int64, Device::Cpu));
        let e = pg.allreduce(&mut it, ReduceOp::Avg).unwrap_err();
        assert!(e.to_string().contains("floating-point"), "{e}");
        // the group still works after refused calls
        let mut t = Tensor::ones([2], (Kind::Float, Device::Cpu));
        pg.allreduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(f32s(&t), vec![2.0, 2.0]);
    });
}
