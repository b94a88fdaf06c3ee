//! Activation checkpointing (`recompute::Checkpointed`): gradients equal the model's without it (with
//! dropout and autocast recomputed alike), activations are not kept, and it composes with DDP, ZeRO-2 and
//! tensor-parallel layers; misuse fails the backward with a message, never a wrong gradient.
use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, nn::ModuleT, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::recompute::{checkpoint_with, Checkpointed};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;
use tch_dist::{amp, memory};

const D: i64 = 12;

/// Two blocks (linear, tanh, dropout in train mode, linear) and a head. The ranks-as-threads tests leave
/// dropout out: their threads share one global generator.
fn block(p: nn::Path, dropout: bool) -> nn::SequentialT {
    let p_drop = if dropout { 0.3 } else { 0.0 };
    nn::seq_t()
        .add(nn::linear(&p / "a", D, 32, Default::default()))
        .add_fn(|x| x.tanh())
        .add_fn_t(move |x, train| x.dropout(p_drop, train))
        .add(nn::linear(&p / "b", 32, D, Default::default()))
}

/// `nn::SequentialT` as a `Module` that always trains (dropout on).
#[derive(Debug)]
struct Train(nn::SequentialT);
impl Module for Train {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.0.forward_t(x, true)
    }
}

fn net(vs: &nn::VarStore, checkpointed: bool, dropout: bool) -> nn::Sequential {
    let r = vs.root();
    let (b1, b2) = (Train(block(&r / "b1", dropout)), Train(block(&r / "b2", dropout)));
    let s = if checkpointed {
        nn::seq().add(Checkpointed::new(b1)).add(Checkpointed::new(b2))
    } else {
        nn::seq().add(b1).add(b2)
    };
    s.add(nn::linear(&r / "head", D, 4, Default::default()))
}

/// Deterministic values, the same for every model built here.
fn init(vs: &nn::VarStore) {
    let _g = tch::no_grad_guard();
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, mut p)) in named.into_iter().enumerate() {
        let v = (Tensor::arange(p.numel() as i64, (Kind::Float, Device::Cpu)) * 0.37 + i as f64).sin() * 0.3;
        p.copy_(&v.view(p.size().as_slice()));
    }
}

fn sorted(vs: &nn::VarStore, f: impl Fn(&Tensor) -> Tensor) -> Vec<Tensor> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.iter().map(|(_, t)| f(t)).collect()
}

fn input(seed: i64) -> Tensor {
    ((Tensor::arange(8 * D, (Kind::Float, Device::Cpu)) * 0.1 + seed as f64).sin()).view([8, D])
}

/// Parameter gradients and the input's gradient after one backward, with dropout.
fn gradients(checkpointed: bool, autocast: bool) -> (Vec<Tensor>, Tensor, usize) {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = net(&vs, checkpointed, true);
    init(&vs);
    let x = input(0).set_requires_grad(true);
    tch::manual_seed(7);
    let out = if autocast {
        amp::autocast(Device::Cpu, Kind::BFloat16, || model.forward(&x)).unwrap()
    } else {
        model.forward(&x)
    };
    // draws between forward and backward must not change what the recomputation draws
    let _ = Tensor::rand([1000], (Kind::Float, Device::Cpu));
    out.to_kind(Kind::Float).pow_tensor_scalar(2).sum(Kind::Float).backward();
    let defined = vs.trainable_variables().iter().filter(|p| p.grad().defined()).count();
    (sorted(&vs, |t| t.grad().copy()), x.grad().copy(), defined)
}

#[test]
fn gradients_equal_the_uncheckpointed_model_with_dropout() {
    let _alone = common::alone(); // the global generator: dropout masks, every layer's initialisation
    let (plain, plain_x, n) = gradients(false, false);
    let (ckpt, ckpt_x, m) = gradients(true, false);
    assert_eq!((n, m), (10, 10), "every parameter gets a gradient");
    assert!(plain_x.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    // the same kernels on the same values and the same dropout masks: bit-identical
    assert_eq!(common::model::max_diff(&plain, &ckpt), 0.0);
    assert_eq!(common::model::max_diff(&[plain_x], &[ckpt_x]), 0.0);
}

#[test]
fn autocast_is_recomputed_alike() {
    let _alone = common::alone();
    let (plain, plain_x, _) = gradients(false, true);
    let (ckpt, ckpt_x, _) = gradients(true, true);
    let (fp32, _, _) = gradients(false, false);
    assert!(common::model::max_diff(&plain, &fp32) > 1e-4, "bf16 autocast must change the gradients");
    assert_eq!(common::model::max_diff(&plain, &ckpt), 0.0);
    assert_eq!(common::model::max_diff(&[plain_x], &[ckpt_x]), 0.0);
}

#[test]
fn activations_are_not_kept() {
    let _alone = common::alone();
    memory::install_cpu_counter().unwrap();
    // a wide block: each activation is 256 x 4096 floats = 4 MiB
    let alive_after_forward = |checkpointed: bool| {
        let vs = nn::VarStore::new(Device::Cpu);
        let r = vs.root();
        let wide = nn::seq()
            .add(nn::linear(&r / "a", 64, 4096, Default::default()))
            .add_fn(|x| x.gelu("none"))
            .add_fn(|x| x.tanh())
            .add(nn::linear(&r / "b", 4096, 64, Default::default()));
        let model: Box<dyn Module> = if checkpointed { Box::new(Checkpointed::new(wide)) } else { Box::new(wide) };
        let x = Tensor::randn([256, 64], (Kind::Float, Device::Cpu));
        let before = memory::allocated(Device::Cpu).unwrap();
        let y = model.forward(&x);
        let alive = memory::allocated(Device::Cpu).unwrap() - before;
        y.sum(Kind::Float).backward();
        let grads = vs.trainable_variables().iter().filter(|p| p.grad().defined()).count();
        (alive, grads)
    };
    let (plain, g1) = alive_after_forward(false);
    let (ckpt, g2) = alive_after_forward(true);
    assert_eq!((g1, g2), (4, 4));
    let mib = 1 << 20;
    assert!(plain >= 2 * 4 * mib, "the plain block keeps its activations: {plain} B");
    assert!(ckpt < mib, "the checkpointed block keeps only its output: {ckpt} B (plain {plain} B)");
}

#[test]
fn a_parameter_missing_from_the_first_forward_fails_the_backward() {
    let _alone = common::alone();
    let vs = nn::VarStore::new(Device::Cpu);
    let (w1, w2) = (vs.root().ones("w1", &[D]), vs.root().ones("w2", &[D]));
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    // the first call (discovery) and the forward use w1; the recomputation uses w2 as well
    let (y, params) = checkpoint_with(&input(1), None, move |x| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        Ok(if n < 2 { x * &w1 } else { x * &w1 * &w2 })
    })
    .unwrap();
    assert_eq!(params.len(), 1);
    let e = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(e.contains("used a parameter of shape [12]") && e.contains("gradient would be lost"), "{e}");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[test]
fn an_input_changed_in_place_fails_the_backward() {
    let _alone = common::alone();
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().ones("w", &[D]);
    let mut x = input(2).set_requires_grad(true) * 1.0; // not a leaf, so it can change in place
    let (y, _) = checkpoint_with(&x, None, move |x| Ok(x * &w)).unwrap();
    let _ = tch::no_grad(|| x.f_add_scalar_(1.0)).unwrap();
    let e = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(e.contains("input 0 was modified in place"), "{e}");
}

#[test]
fn an_error_in_the_recomputation_fails_the_backward() {
    let _alone = common::alone();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().ones("w", &[D]);
    let (y, _) = checkpoint_with(&input(3), None, move |x| {
        if c.fetch_add(1, Ordering::SeqCst) >= 2 {
            return Err(tch_dist::Error::Invalid { op: "block".into(), msg: "out of memory (simulated)".into() });
        }
        Ok(x * &w)
    })
    .unwrap();
    let e = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(e.contains("out of memory (simulated)"), "{e}");
}

/// Parameters after 3 steps on 2 ranks: DDP + tch's SGD, or DDP + ZeRO-2 AdamW.
fn train(checkpointed: bool, zero: bool) -> Vec<Vec<Tensor>> {
    common::run_threads(2, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs, checkpointed, false);
        init(&vs);
        let ddp = DistributedDataParallel::new(&vs, model, DdpOptions::default().process_group(pg.clone())).unwrap();
        let mut sgd = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let mut zero_opt = zero.then(|| {
            ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(AdamW::new(p, 0.01)) as Box<dyn Optimizer + Send>)
                .unwrap()
        });
        for step in 0..3 {
            tch::manual_seed(100 + step * 2 + pg.rank() as i64);
            let out = ddp.forward(&input(step + 10 * pg.rank() as i64));
            ddp.backward(&out.pow_tensor_scalar(2).mean(Kind::Float)).unwrap();
            match &mut zero_opt {
                Some(o) => {
                    o.step().unwrap();
                    o.zero_grad().unwrap();
                }
                None => {
                    sgd.step();
                    sgd.zero_grad();
                }
            }
        }
        sorted(&vs, |t| t.detach().copy())
    })
}

#[test]
fn composes_with_ddp_and_zero2() {
    let _alone = common::alone();
    for zero in [false, true] {
        let plain = train(false, zero);
        let ckpt = train(true, zero);
        for r in 0..2 {
            let d = common::model::max_diff(&plain[r], &ckpt[r]);
            assert!(d <= 1e-6, "zero2 {zero}, rank {r}: checkpointed differs by {d}");
        }
        assert_eq!(common::model::max_diff(&ckpt[0], &ckpt[1]), 0.0, "ranks agree");
    }
}

#[test]
fn composes_with_tensor_parallel_layers() {
    let _alone = common::alone();
    let run = |checkpointed: bool| {
        common::run_threads(2, Duration::from_secs(60), move |pg| {
            let pg = Arc::new(pg);
            let vs = nn::VarStore::new(Device::Cpu);
            let w = |shape: &[i64], k: f64| {
                (Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu)) * k).sin().view(shape) * 0.3
            };
            let (w1, b1, w2, b2) = (w(&[32, D], 0.7), w(&[32], 0.3), w(&[D, 32], 0.9), w(&[D], 0.5));
            let mlp = tch_dist::tp::ParallelMlp::from_full(&vs.root(), &w1, &b1, &w2, &b2, pg.clone()).unwrap();
            let model: Box<dyn Module> = if checkpointed { Box::new(Checkpointed::new(mlp)) } else { Box::new(mlp) };
            let x = input(4).set_requires_grad(true);
            model.forward(&x).pow_tensor_scalar(2).sum(Kind::Float).backward();
            let mut g = sorted(&vs, |t| t.grad().copy());
            g.push(x.grad().copy());
            g
        })
    };
    let (plain, ckpt) = (run(false), run(true));
    for r in 0..2 {
        assert!(plain[r].iter().all(|g| g.defined()));
        assert_eq!(common::model::max_diff(&plain[r], &ckpt[r]), 0.0, "rank {r}");
    }
}
