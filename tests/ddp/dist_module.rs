//! One trait over the wrappers: a model that is only an `nn::ModuleT` (its forward depends on the train
//! flag) trains under DDP and under FSDP through the same generic step (`apply_t`, `no_sync`,
//! `backward`, `zero_grad`, `parameters`, `state_dict` of `DistModule`), with FSDP
//! units of `WithTrain` layers inside `nn::seq_t`; on 2 ranks it ends where one process ends. A
//! pipeline refuses a plain backward by name.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::ModuleT, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
use tch_dist::optim::{Optimizer, Sgd};
use tch_dist::pipeline::{LayerList, Partition, PipelineConfig, PipelineRank};
use tch_dist::{DistModule, WithTrain};

const STEPS: usize = 3;
const LR: f64 = 0.1;

/// A layer that is `ModuleT` only: in training it halves its output (as a deterministic dropout would
/// scale), so a wrapper that dropped the flag would train differently.
#[derive(Debug)]
struct Halving(nn::Linear);

impl ModuleT for Halving {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let y = nn::Module::forward(&self.0, xs).tanh();
        if train {
            y * 0.5
        } else {
            y
        }
    }
}

/// Values by shape, not by tch's generator (the rank threads share it).
fn linear(p: nn::Path, i: i64, o: i64) -> nn::Linear {
    let l = nn::linear(p, i, o, Default::default());
    tch::no_grad(|| {
        let n = i * o;
        let w = (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.29 + o as f64).sin() * 0.5;
        l.ws.shallow_clone().copy_(&w.view([o, i]));
        if let Some(b) = &l.bs {
            b.shallow_clone().copy_(&((Tensor::arange(o, (Kind::Float, Device::Cpu)) * 0.3).cos() * 0.1));
        }
    });
    l
}

fn batch(step: usize, rank: usize, micro: usize) -> (Tensor, Tensor) {
    let base = (step * 100 + rank * 10 + micro * 3) as f64;
    let x = ((Tensor::arange(12, (Kind::Float, Device::Cpu)) * 0.3 + base).sin()).view([3, 4]);
    let y = ((Tensor::arange(3, (Kind::Float, Device::Cpu)) * 0.7 + base).cos()).view([3, 1]);
    (x, y)
}

/// One training step of any wrapper: two microbatches, the first without synchronisation, then
/// clipping, the optimizer, and gradients dropped.
fn step<W: DistModule + ModuleT>(w: &W, opt: &mut dyn Optimizer, step: usize, rank: usize) -> f64 {
    let loss = |w: &W, micro| {
        let (x, y) = batch(step, rank, micro);
        // tch's ModuleT: the forward of every wrapper
        let out = x.apply_t(w, true);
        out.mse_loss(&y, tch::Reduction::Mean)
    };
    w.no_sync(|w| w.backward(&loss(w, 0))).unwrap();
    w.backward(&loss(w, 1)).unwrap();
    let norm = opt.clip_grad_norm(0.5, 2.0).unwrap().double_value(&[]);
    opt.step().unwrap();
    w.zero_grad().unwrap();
    assert!(w.parameters().iter().all(|p| !p.grad().defined()), "zero_grad sets gradients to none");
    norm
}

/// One process: the mean over `world` ranks' two microbatches, clipped as a whole.
fn reference(world: usize) -> (Vec<(String, Tensor)>, Vec<f64>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq_t().add(Halving(linear(vs.root() / "l1", 4, 8))).add(Halving(linear(vs.root() / "l2", 8, 1)));
    let mut opt = Sgd::new(vs.trainable_variables(), LR);
    let mut norms = Vec::new();
    for s in 0..STEPS {
        for r in 0..world {
            for micro in 0..2 {
                let (x, y) = batch(s, r, micro);
                (x.apply_t(&net, true).mse_loss(&y, tch::Reduction::Mean) / world as f64).backward();
            }
        }
        norms.push(tch_dist::optim::clip_grad_norm(&vs.trainable_variables(), 0.5, 2.0).unwrap().double_value(&[]));
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    (named, norms)
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.iter().map(|x| &x.0).collect::<Vec<_>>(), b.iter().map(|x| &x.0).collect::<Vec<_>>());
    a.iter().zip(b).map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[])).fold(0.0, f64::max)
}

type Trained = (Vec<(String, Tensor)>, Vec<f64>);
/// A tensor as plain data: the rank closures must return `Send` values.
type Plain = (String, Vec<f32>, Vec<i64>);

fn plain(t: Trained) -> (Vec<Plain>, Vec<f64>) {
    let named =
        t.0.iter().map(|(n, x)| (n.clone(), Vec::<f32>::try_from(x.flatten(0, -1)).unwrap(), x.size())).collect();
    (named, t.1)
}

fn tensors(p: &[Plain]) -> Vec<(String, Tensor)> {
    p.iter().map(|(n, v, s)| (n.clone(), Tensor::from_slice(v).view(s.as_slice()))).collect()
}

#[test]
fn a_module_t_model_trains_under_ddp_and_fsdp_through_one_trait() {
    let (want, want_norms) = reference(2);
    let ddp = common::run_threads(2, Duration::from_secs(60), |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::seq_t().add(Halving(linear(vs.root() / "l1", 4, 8))).add(Halving(linear(vs.root() / "l2", 8, 1)));
        let opts = DdpOptions::default().process_group(Arc::new(pg));
        let model = DistributedDataParallel::new(&vs, WithTrain(net), opts).unwrap();
        let mut opt = Sgd::new(model.parameters(), LR);
        let norms: Vec<f64> = (0..STEPS).map(|s| step(&model, &mut opt, s, rank)).collect();
        plain((DistModule::state_dict(&model).unwrap(), norms))
    });
    let fsdp = common::run_threads(2, Duration::from_secs(60), |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let (p1, p2) = (vs.root() / "l1", vs.root() / "l2");
        // units of ModuleT-only layers, inside tch's own sequence of ModuleT layers
        let net = nn::seq_t()
            .add(fsdp.fully_shard(&p1, WithTrain(Halving(linear(p1.clone(), 4, 8)))).unwrap())
            .add(fsdp.fully_shard(&p2, WithTrain(Halving(linear(p2.clone(), 8, 1)))).unwrap());
        let model = fsdp.finish(WithTrain(net)).unwrap();
        let mut opt = Sgd::new(model.parameters(), LR);
        let norms: Vec<f64> = (0..STEPS).map(|s| step(&model, &mut opt, s, rank)).collect();
        plain((DistModule::state_dict(&model).unwrap(), norms))
    });
    for (what, outs) in [("DDP", ddp), ("FSDP", fsdp)] {
        for (r, (named, norms)) in outs.iter().enumerate() {
            let d = max_diff(&tensors(named), &want);
            assert!(d < 1e-6, "{what} rank {r}: parameters differ from one process by {d}");
            for (a, b) in norms.iter().zip(&want_norms) {
                assert!((a - b).abs() < 1e-5, "{what} rank {r}: norms {norms:?}, one process {want_norms:?}");
            }
        }
    }
    // the clipping bound was reached, and training moved the parameters
    assert!(want_norms[0] > 0.5, "{want_norms:?}");
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = (linear(vs.root() / "l1", 4, 8), linear(vs.root() / "l2", 8, 1));
    let mut start: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    start.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(max_diff(&want, &start) > 1e-3);
}

/// A pipeline rank is not a `DistModule` (its forwards and backwards run inside `step`); it still gives
/// its chunks' values and switches their gradient synchronisation.
#[test]
fn a_pipeline_rank_gives_its_chunks_values_and_sync_setting() {
    let store = tch_dist::Store::hash().unwrap();
    let pg = Arc::new(tch_dist::ProcessGroup::new(&store, 0, 1, &Default::default()).unwrap());
    let layers = LayerList::new().add("l", |p| nn::linear(p, 2, 2, Default::default()));
    let rank =
        PipelineRank::build(pg, &layers, &Partition::sizes(&[1], 1).unwrap(), PipelineConfig::default()).unwrap();
    let names: Vec<String> = rank.state_dict().unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["l.bias", "l.weight"]);
    rank.set_requires_gradient_sync(false);
    assert!(rank.chunks().iter().all(|c| !DistModule::requires_gradient_sync(c)));
}
