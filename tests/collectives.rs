//! Every collective on 2 and 3 ranks, checked element by element, as threads (HashStore) and as
//! processes (TCPStore through the torchrun environment).
mod common;

use std::time::Duration;

use common::scenario::{f32s, scenario};
use tch::{Device, Kind, Tensor};
use tch_dist::{ProcessGroup, ReduceOp};

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
    let outs = common::run_ranks_ok("worker_collectives", 2, &[], Duration::from_secs(120));
    assert!(String::from_utf8_lossy(&outs[1].stdout).contains("rank 1 ok"));
}

#[test]
fn collectives_processes_3_ranks() {
    let outs = common::run_ranks_ok("worker_collectives", 3, &[], Duration::from_secs(120));
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
