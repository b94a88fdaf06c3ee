//! PP × DP × TP in one run: 8 ranks on the mesh [("pp", 2), ("dp", 2), ("tp", 2)]. A model of two
//! tensor-parallel MLPs is split into 2 pipeline stages (1F1B, 2 microbatches) over "pp", each stage's
//! MLP runs over "tp", gradients are averaged over "dp", and the gradient norm is clipped over the whole
//! mesh (TP slices summed over tp and pp, the rest over pp). Losses and re-assembled parameters after 3
//! steps equal one process training the full model on the full batch.
use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::mesh::DeviceMesh;
use tch_dist::optim::{clip_grad_norm, Optimizer, Sgd};
use tch_dist::pipeline::schedule::ScheduleKind;
use tch_dist::pipeline::{LayerList, Partition, PipelineConfig, PipelineRank};
use tch_dist::tp::ParallelMlp;
use tch_dist::ReduceOp;

const T: Duration = Duration::from_secs(120);
const D: i64 = 6;
const H: i64 = 8; // divisible by the TP size
const ROWS: i64 = 4; // per data-parallel rank; 2 microbatches of 2
const STEPS: usize = 3;
const LR: f64 = 0.5;
const MAX_NORM: f64 = 0.05;
const TOL: f64 = 1e-5;

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.6).view(shape)
}

/// MLP `i`'s full weights: fc1 [H, D], its bias, fc2 [D, H], its bias.
fn mlp_weights(i: usize) -> [Tensor; 4] {
    let k = i as f64 * 10.0;
    [formula(&[H, D], k + 1.0), formula(&[H], k + 2.0), formula(&[D, H], k + 3.0), formula(&[D], k + 4.0)]
}

/// Data-parallel rank `dp`'s batch at `step` (inputs, targets).
fn batch(step: usize, dp: usize) -> (Tensor, Tensor) {
    let k = step as f64 * 100.0 + dp as f64 * 10.0;
    (formula(&[ROWS, D], k), formula(&[ROWS, D], k + 50.0))
}

fn loss(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

/// One process, the full model, the full batch (both data-parallel ranks' rows): losses and parameters.
fn reference() -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut w = Vec::new();
    for i in 0..2 {
        let p = vs.root() / format!("mlp{i}");
        let full = mlp_weights(i);
        let names = [("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"), ("fc2", "bias")];
        w.push(full.iter().zip(names).map(|(t, (l, n))| (&p / l).var_copy(n, t)).collect::<Vec<_>>());
    }
    let mlp = |x: &Tensor, w: &[Tensor]| x.linear(&w[0], Some(&w[1])).gelu("none").linear(&w[2], Some(&w[3]));
    let mut opt = Sgd::new(vs.trainable_variables(), LR);
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let ((x0, y0), (x1, y1)) = (batch(s, 0), batch(s, 1));
        let (x, y) = (Tensor::cat(&[x0, x1], 0), Tensor::cat(&[y0, y1], 0));
        let l = loss(&mlp(&mlp(&x, &w[0]).tanh(), &w[1]), &y);
        losses.push(l.double_value(&[]));
        l.backward();
        let _ = clip_grad_norm(&vs.trainable_variables(), MAX_NORM, 2.0).unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    (losses, vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect())
}

/// What one rank ends with: its coordinates, its losses (last stage only) and its parameters.
type Out = (Vec<usize>, Vec<f64>, BTreeMap<String, Tensor>);

#[test]
fn pp_dp_tp_on_8_ranks_trains_like_one_process() {
    let (want_losses, want) = reference();
    let res: Vec<Out> = common::run_threads(8, T, |world| {
        let mesh = DeviceMesh::new(&world, &[("pp", 2), ("dp", 2), ("tp", 2)]).unwrap();
        let (tp, dp, pp) = (mesh.group("tp").unwrap(), mesh.group("dp").unwrap(), mesh.group("pp").unwrap());
        let layers = (0..2).fold(LayerList::new(), |l, i| {
            let tp = tp.clone();
            let l = l.add(&format!("mlp{i}"), move |p| {
                let w = mlp_weights(i);
                ParallelMlp::from_full(p, &w[0], &w[1], &w[2], &w[3], tp.clone()).unwrap()
            });
            if i == 0 {
                l.add_fn("tanh", |x| x.tanh())
            } else {
                l
            }
        });
        let part = Partition::sizes(&[2, 1], layers.len()).unwrap();
        let mut stage = PipelineRank::build(
            pp.clone(),
            &layers,
            &part,
            PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 2, chunks: 1, ..Default::default() },
        )
        .unwrap();
        // by name: every rank of a group must reduce the same tensors in the same order
        let mut params: Vec<(String, Tensor)> = stage.var_stores().iter().flat_map(|vs| vs.variables()).collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let mut opt = Sgd::new(params.iter().map(|p| p.1.shallow_clone()).collect(), LR);
        let all: Vec<Tensor> = params.iter().map(|p| p.1.shallow_clone()).collect();
        let dp_rank = mesh.coordinate("dp").unwrap();
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (x, y) = batch(s, dp_rank);
            let report = stage.step(&x, &y, &loss).unwrap();
            if let Some(l) = report.loss {
                let mut l = l.reshape([1]);
                dp.allreduce(&mut l, ReduceOp::Sum).unwrap();
                losses.push(l.double_value(&[0]) / dp.size() as f64);
            }
            // data parallelism: the mean of the dp ranks' gradients
            for (_, p) in &params {
                let mut g = p.grad();
                dp.allreduce(&mut g, ReduceOp::Sum).unwrap();
                let _ = g.g_div_scalar_(dp.size() as f64);
            }
            // the placements say it: TP slices summed over tp, every stage's over pp, fc2's bias once
            let norm = clip_grad_norm(&all, MAX_NORM, 2.0).unwrap().double_value(&[]);
            assert!(norm > 2.0 * MAX_NORM, "step {s}: the test must clip (norm {norm})");
            opt.step().unwrap();
            stage.zero_grad().unwrap();
        }
        let named = params.into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
        (mesh.coordinates().to_vec(), losses, named)
    });
    // the last stage's ranks know the loss: every step, the full model's
    for (coords, losses, _) in &res {
        if coords[0] == 1 {
            assert_eq!(losses.len(), STEPS);
            for (s, (got, want)) in losses.iter().zip(&want_losses).enumerate() {
                assert!((got - want).abs() < TOL, "rank at {coords:?}, step {s}: loss {got} vs {want}");
            }
        }
    }
    // parameters: TP slices joined (fc1 by rows, fc2's weight by columns), per stage and dp rank
    for dp in 0..2 {
        let mut full: BTreeMap<String, Tensor> = BTreeMap::new();
        for pp in 0..2 {
            let of = |tp: usize| &res.iter().find(|r| r.0 == [pp, dp, tp]).unwrap().2;
            for (name, t0) in of(0) {
                let t1 = &of(1)[name];
                let joined = if name.ends_with("fc2.bias") {
                    assert_eq!(t0, t1, "{name}: whole on both TP ranks");
                    t0.copy()
                } else if name.ends_with("fc2.weight") {
                    Tensor::cat(&[t0, t1], 1)
                } else {
                    Tensor::cat(&[t0, t1], 0)
                };
                full.insert(name.clone(), joined);
            }
        }
        assert_eq!(full.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        for (name, t) in &full {
            let d = (t - &want[name]).abs().max().double_value(&[]);
            assert!(d < TOL, "dp rank {dp}: {name} differs from one process by {d}");
        }
    }
    let moved = (&want["mlp0.fc1.weight"] - mlp_weights(0)[0].shallow_clone()).abs().max().double_value(&[]);
    assert!(moved > 1e-3, "training must move the parameters");
}
