//! Tensor parallelism: the sharded MLP's output, input gradient and every (re-assembled) weight gradient
//! equal the unsharded MLP's on 2 and 3 ranks; TP combined with DDP on 4 ranks (2 TP x 2 DP) trains like
//! one process; shapes that do not divide give a clear error.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::mesh::DeviceMesh;
use tch_dist::tp::{ColumnParallelConfig, ColumnParallelLinear, ParallelMlp, RowParallelConfig, RowParallelLinear};
use tch_dist::DistModule;

const T: Duration = Duration::from_secs(60);
/// float32, partial products summed in another order: observed ~1e-7.
const TOL: f64 = 1e-5;
const D: i64 = 6;
const H: i64 = 12; // divisible by 2 and 3

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.5).view(shape)
}

fn full() -> (Tensor, Tensor, Tensor, Tensor) {
    (formula(&[H, D], 1.0), formula(&[H], 2.0), formula(&[D, H], 3.0), formula(&[D], 4.0))
}

fn full_mlp(x: &Tensor, w: &(Tensor, Tensor, Tensor, Tensor)) -> Tensor {
    x.linear(&w.0, Some(&w.1)).gelu("none").linear(&w.2, Some(&w.3))
}

fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn slice(t: &Tensor, dim: i64, rank: usize, parts: usize) -> Tensor {
    let n = t.size()[dim as usize] / parts as i64;
    t.narrow(dim, rank as i64 * n, n)
}

#[test]
fn parallel_mlp_equals_the_full_mlp_forward_and_backward() {
    for world in [2, 3] {
        let res = common::run_threads(world, T, move |pg| {
            let (rank, size) = (pg.rank(), pg.size());
            let pg = Arc::new(pg);
            // reference, with gradients
            let w: Vec<Tensor> = {
                let f = full();
                vec![f.0, f.1, f.2, f.3].into_iter().map(|t| t.set_requires_grad(true)).collect()
            };
            let x_ref = formula(&[5, D], 9.0).set_requires_grad(true);
            let c = formula(&[5, D], 7.0);
            let y_ref = full_mlp(
                &x_ref,
                &(w[0].shallow_clone(), w[1].shallow_clone(), w[2].shallow_clone(), w[3].shallow_clone()),
            );
            (&y_ref * &c).sum(Kind::Float).backward();
            // sharded
            let vs = nn::VarStore::new(Device::Cpu);
            let f = full();
            let mlp = ParallelMlp::from_full(&vs.root(), &f.0, &f.1, &f.2, &f.3, pg).unwrap();
            let x = formula(&[5, D], 9.0).set_requires_grad(true);
            let y = mlp.f_forward(&x).unwrap();
            (&y * &c).sum(Kind::Float).backward();
            let mut worst = diff(&y, &y_ref).max(diff(&x.grad(), &x_ref.grad()));
            worst = worst.max(diff(&mlp.fc1.ws.grad(), &slice(&w[0].grad(), 0, rank, size)));
            worst = worst.max(diff(&mlp.fc1.bs.as_ref().unwrap().grad(), &slice(&w[1].grad(), 0, rank, size)));
            worst = worst.max(diff(&mlp.fc2.ws.grad(), &slice(&w[2].grad(), 1, rank, size)));
            worst = worst.max(diff(&mlp.fc2.bs.as_ref().unwrap().grad(), &w[3].grad()));
            worst
        });
        for (r, d) in res.iter().enumerate() {
            assert!(*d < TOL, "world {world}, rank {r}: max difference {d:e}");
        }
    }
}

#[test]
fn gather_and_scatter_variants_equal_a_full_linear() {
    let res = common::run_threads(2, T, |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let (w, b) = (formula(&[H, D], 1.0), formula(&[H], 2.0));
        let gathered = ColumnParallelConfig { gather_output: true, ..Default::default() };
        let col = ColumnParallelLinear::from_full(&(vs.root() / "c"), &w, Some(&b), pg.clone(), gathered).unwrap();
        let row = RowParallelLinear::from_full(
            &(vs.root() / "r"),
            &formula(&[D, H], 3.0),
            Some(&formula(&[D], 4.0)),
            pg,
            RowParallelConfig { input_is_parallel: false, ..Default::default() },
        )
        .unwrap();
        let x = formula(&[4, D], 5.0).set_requires_grad(true);
        let y = row.f_forward(&col.f_forward(&x).unwrap()).unwrap(); // gathered, then split again on entry
        y.sum(Kind::Float).backward();
        let xr = formula(&[4, D], 5.0).set_requires_grad(true);
        let yr = xr.linear(&w, Some(&b)).linear(&formula(&[D, H], 3.0), Some(&formula(&[D], 4.0)));
        yr.sum(Kind::Float).backward();
        diff(&y, &yr).max(diff(&x.grad(), &xr.grad()))
    });
    for d in res {
        assert!(d < TOL, "{d:e}");
    }
}

#[test]
fn shapes_not_divisible_by_the_tp_size_are_refused() {
    let res = common::run_threads(2, T, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let e =
            ColumnParallelLinear::from_full(&vs.root(), &formula(&[5, D], 1.0), None, Arc::new(pg), Default::default())
                .unwrap_err();
        e.to_string()
    });
    for e in res {
        assert!(
            e.contains("ColumnParallelLinear") && e.contains("(5) is not divisible by the tensor-parallel size 2"),
            "{e}"
        );
    }
}

#[test]
fn tp_and_ddp_on_4_ranks_train_like_one_process() {
    const STEPS: usize = 3;
    const LR: f64 = 0.1;
    let batch = |step: usize, dp: usize| formula(&[4, D], step as f64 * 10.0 + dp as f64 * 3.0);
    let target = |step: usize, dp: usize| formula(&[4, D], step as f64 * 10.0 + dp as f64 * 3.0 + 100.0);
    // one process, unsharded, on both data-parallel shards at once
    let reference = {
        let vs = nn::VarStore::new(Device::Cpu);
        let f = full();
        let w: Vec<Tensor> =
            [&f.0, &f.1, &f.2, &f.3].iter().enumerate().map(|(i, t)| vs.root().var_copy(&format!("w{i}"), t)).collect();
        let mut opt = nn::Sgd::default().build(&vs, LR).unwrap();
        for s in 0..STEPS {
            let x = Tensor::cat(&[batch(s, 0), batch(s, 1)], 0);
            let y = Tensor::cat(&[target(s, 0), target(s, 1)], 0);
            opt.zero_grad();
            let out =
                full_mlp(&x, &(w[0].shallow_clone(), w[1].shallow_clone(), w[2].shallow_clone(), w[3].shallow_clone()));
            out.mse_loss(&y, tch::Reduction::Mean).backward();
            opt.step();
        }
        w.iter().map(|t| t.detach().copy()).collect::<Vec<_>>()
    };
    let res = common::run_threads(4, T, move |world| {
        let mesh = DeviceMesh::new(&world, &[("dp", 2), ("tp", 2)]).unwrap();
        let (tp_rank, dp_rank) = (mesh.coordinate("tp").unwrap(), mesh.coordinate("dp").unwrap());
        let vs = nn::VarStore::new(Device::Cpu);
        let f = full();
        let mlp = ParallelMlp::from_full(&vs.root(), &f.0, &f.1, &f.2, &f.3, mesh.group("tp").unwrap()).unwrap();
        // gradients of TP shards are averaged over the data-parallel group only
        let ddp = DistributedDataParallel::new(&vs, mlp, DdpOptions::default().mesh(&mesh, "dp").unwrap()).unwrap();
        let mut opt = nn::Sgd::default().build(&vs, LR).unwrap();
        for s in 0..STEPS {
            let out = ddp.forward_with(|m| m.f_forward(&batch(s, dp_rank))).unwrap().unwrap();
            ddp.backward(&out.mse_loss(&target(s, dp_rank), tch::Reduction::Mean)).unwrap();
            opt.step();
            ddp.zero_grad().unwrap();
        }
        let m = ddp.module();
        let got = [
            m.fc1.ws.detach().copy(),
            m.fc1.bs.as_ref().unwrap().detach().copy(),
            m.fc2.ws.detach().copy(),
            m.fc2.bs.as_ref().unwrap().detach().copy(),
        ];
        (tp_rank, got)
    });
    for (tp_rank, got) in res {
        let want = [
            slice(&reference[0], 0, tp_rank, 2),
            slice(&reference[1], 0, tp_rank, 2),
            slice(&reference[2], 1, tp_rank, 2),
            reference[3].shallow_clone(),
        ];
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = diff(g, w);
            assert!(d < TOL, "tp rank {tp_rank}, tensor {i}: {d:e}");
        }
    }
}

/// The operators' collectives, forward and backward, are in the flight recorder (they run inside the
/// shim, so the group's own recording does not see them).
#[test]
fn tp_collectives_forward_and_backward_are_in_the_flight_recorder() {
    let res = common::run_threads(2, T, |pg| {
        let rank = pg.rank();
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let f = full();
        let mlp = ParallelMlp::from_full(&vs.root(), &f.0, &f.1, &f.2, &f.3, pg.clone()).unwrap();
        let x = formula(&[5, D], 9.0).set_requires_grad(true);
        mlp.f_forward(&x).unwrap().sum(Kind::Float).backward();
        pg.barrier().unwrap();
        // other tests of this binary record too: this one's shape picks its entries
        let mine: Vec<tch_dist::flight::Entry> =
            tch_dist::flight::entries().into_iter().filter(|e| e.group_rank == rank && e.group_size == 2).collect();
        let find = |what: &str| {
            mine.iter()
                .find(|e| e.op.contains(what) && e.op.contains("Float[5, 6]"))
                .map(|e| (e.op.clone(), e.state.clone()))
                .unwrap_or_else(|| {
                    panic!("rank {rank}: no {what:?} in {:?}", mine.iter().map(|e| &e.op).collect::<Vec<_>>())
                })
        };
        (find("(reduce_from_parallel_region)"), find("(copy_to_parallel_region backward)"))
    });
    for ((fwd, fs), (bwd, bs)) in res {
        assert!(
            fwd.starts_with("allreduce(Sum) of Float[5, 6]") && fs == tch_dist::flight::EntryState::Completed,
            "{fwd}"
        );
        assert!(
            bwd.starts_with("allreduce(Sum) of Float[5, 6]") && bs == tch_dist::flight::EntryState::Completed,
            "{bwd}"
        );
    }
}
