//! Mixed precision: autocast and GradScaler against PyTorch on the same inputs; autocast under DDP; a
//! forced overflow under ZeRO-2 with float16 parameters skips the step on every rank alike.
use crate::common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::amp::{autocast, GradScaler, GradScalerConfig};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::hooks;
use tch_dist::optim::{AdamW, Optimizer, Sgd};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;

fn pytorch(mode: &str) -> Vec<String> {
    let o = Command::new(common::python()).arg(common::repo_path("tests/py/amp_ref.py")).arg(mode).output().unwrap();
    assert!(o.status.success(), "{}", common::show(&o));
    String::from_utf8_lossy(&o.stdout).lines().map(str::to_string).collect()
}

fn numbers(line: &str) -> Vec<f64> {
    line.split_whitespace().map(|x| x.parse().unwrap()).collect()
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.detach().to_kind(Kind::Double).flatten(0, -1)).unwrap()
}

fn formula(n: i64, k: f64, a: f64) -> Tensor {
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * a + k).sin()
}

#[test]
fn autocast_matches_torch_autocast() {
    let w1 = (formula(128, 0.0, 0.37) * 0.3).view([16, 8]).set_requires_grad(true);
    let b1 = (Tensor::arange(16, (Kind::Float, Device::Cpu)).cos() * 0.1).set_requires_grad(true);
    let w2 = (formula(64, 1.0, 0.11) * 0.3).view([4, 16]).set_requires_grad(true);
    let b2 = (Tensor::zeros([4], (Kind::Float, Device::Cpu)) + 0.05).set_requires_grad(true);
    let x = formula(48, 0.0, 0.23).view([6, 8]);
    let o = autocast(Device::Cpu, Kind::BFloat16, || x.linear(&w1, Some(&b1)).relu().linear(&w2, Some(&b2))).unwrap();
    // outside the region, operations are float32 again
    assert_eq!(x.matmul(&w1.tr()).kind(), Kind::Float);
    o.to_kind(Kind::Float).pow_tensor_scalar(2).mean(Kind::Float).backward();
    let want = pytorch("autocast");
    assert_eq!(want[0], "bfloat16");
    assert_eq!(o.kind(), Kind::BFloat16);
    for (name, t, line) in [
        ("output", &o, &want[1]),
        ("w1.grad", &w1.grad(), &want[2]),
        ("b1.grad", &b1.grad(), &want[3]),
        ("w2.grad", &w2.grad(), &want[4]),
        ("b2.grad", &b2.grad(), &want[5]),
    ] {
        assert_eq!(t.kind() == Kind::Float, name != "output", "{name}: gradients of float32 parameters are float32");
        let (got, exp) = (values(t), numbers(line));
        assert_eq!(got.len(), exp.len(), "{name}");
        for (a, b) in got.iter().zip(&exp) {
            // the same kernels on the same machine
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{name}: {a} vs PyTorch {b}");
        }
    }
}

#[test]
fn grad_scaler_matches_torch_grad_scaler() {
    let want = pytorch("scaler");
    let p = Tensor::zeros([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mut opt = Sgd::new(vec![p.shallow_clone()], 0.1);
    let mut sc = GradScalerConfig { init_scale: 1024.0, growth_interval: 3, ..Default::default() }.build();
    let mut skipped = Vec::new();
    for (step, line) in want.iter().enumerate() {
        let g = Tensor::from_slice(&[
            step as f32 + 1.0,
            if step == 2 || step == 6 { f32::INFINITY } else { -1.0 },
            0.5,
            2.0,
        ]);
        opt.zero_grad().unwrap();
        sc.scale(&(&p * g).sum(Kind::Float)).unwrap().backward();
        if !sc.step(&mut opt).unwrap() {
            skipped.push(step);
        }
        sc.update().unwrap();
        let exp = numbers(line);
        assert_eq!(sc.get_scale(), exp[0], "step {step}: scale");
        for (a, b) in values(&p).iter().zip(&exp[1..]) {
            // SGD's update rounds as in tests/training/optim.rs (a few ulps)
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "step {step}: {a} vs PyTorch {b}");
        }
    }
    assert_eq!(skipped, vec![2, 6]);
}

#[test]
fn grad_scaler_refuses_misuse() {
    let p = Tensor::zeros([2], (Kind::Half, Device::Cpu)).set_requires_grad(true);
    hooks::set_grad(&p, Some(&Tensor::ones([2], (Kind::Half, Device::Cpu)))).unwrap();
    let mut opt = Sgd::new(vec![p.shallow_clone()], 0.1);
    let mut sc = GradScaler::new();
    let e = sc.step(&mut opt).unwrap_err().to_string();
    assert!(e.contains("float16") && e.contains("master"), "{e}");
    let q = Tensor::zeros([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    hooks::set_grad(&q, Some(&Tensor::ones([2], (Kind::Float, Device::Cpu)))).unwrap();
    let mut opt = Sgd::new(vec![q.shallow_clone()], 0.1);
    let mut sc = GradScaler::new();
    sc.step(&mut opt).unwrap();
    assert!(sc.step(&mut opt).unwrap_err().to_string().contains("update"));
    sc.update().unwrap();
    assert!(sc.update().unwrap_err().to_string().contains("step first"));
}

fn model(vs: &nn::VarStore) -> nn::Sequential {
    let r = vs.root();
    nn::seq().add(nn::linear(&r / "a", 5, 7, Default::default())).add_fn(|x| x.relu()).add(nn::linear(
        &r / "b",
        7,
        2,
        Default::default(),
    ))
}

fn batch(step: usize, rank: usize) -> Tensor {
    ((Tensor::arange(20, (Kind::Float, Device::Cpu)) * 0.3 + (step * 10 + rank) as f64).sin()).view([4, 5])
}

#[test]
fn autocast_under_ddp_averages_the_local_autocast_gradients() {
    // DDP's reduced gradient equals the mean of what each rank's autocast backward computes alone
    let out = common::run_threads(2, Duration::from_secs(60), |pg| {
        let pg = Arc::new(pg);
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        common::model::init(&vs, 0.0);
        let lone = nn::VarStore::new(Device::Cpu);
        let lone_net = model(&lone);
        common::model::init(&lone, 0.0);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone())).unwrap();
        let x = batch(0, rank);
        let loss_of = |o: Tensor| o.to_kind(Kind::Float).pow_tensor_scalar(2).mean(Kind::Float);
        let o = ddp.forward_with(|m| autocast(Device::Cpu, Kind::BFloat16, || m.forward(&x)).unwrap()).unwrap();
        assert_eq!(o.kind(), Kind::BFloat16);
        ddp.backward(&loss_of(o)).unwrap();
        loss_of(autocast(Device::Cpu, Kind::BFloat16, || lone_net.forward(&x)).unwrap()).backward();
        let ddp_grads: Vec<Tensor> = vs.trainable_variables().iter().map(|p| p.grad().copy()).collect();
        let mut mean = Vec::new();
        for p in lone.trainable_variables() {
            let mut g = p.grad().copy();
            pg.allreduce(&mut g, tch_dist::group::ReduceOp::Sum).unwrap();
            mean.push(g / 2.0);
        }
        common::model::max_diff(&ddp_grads, &mean)
    });
    for d in out {
        assert!(d < 1e-7, "DDP under autocast vs local mean: {d:e}");
    }
}

#[test]
fn forced_overflow_under_zero2_skips_the_step_on_every_rank() {
    overflow_under_zero2(false);
}

/// The step after a skipped one is taken when the step ends with the model's `zero_grad` rather than the
/// optimizer's: the float32 gradient copies of the skipped step are not read again.
#[test]
fn after_a_skipped_step_zero2_reads_the_new_gradients_whichever_zero_grad_ran() {
    overflow_under_zero2(true);
}

fn overflow_under_zero2(model_zero_grad: bool) {
    // float16 parameters, float32 master weights sharded by ZeRO-2. At step 2, rank 1 alone adds a term
    // whose gradient overflows float16 in the first element of the first bucket, which rank 0 owns: the
    // inf reaches rank 0's gradient shard only, so rank 1 must learn of it from the agreement.
    let out = common::run_threads(2, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let rank = pg.rank();
        let mut vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        common::model::init(&vs, 0.0);
        vs.half();
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone())).unwrap();
        let mut opt = ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(AdamW::new(p, 0.01))).unwrap();
        let first = ddp.bucket_layout()[0][0].clone();
        let target = vs.variables()[&first].shallow_clone();
        let mut sc = GradScaler::new().init_scale(1024.0).growth_interval(2).process_group(pg.clone());
        let mut log = Vec::new();
        for step in 0..6 {
            let before = common::model::params(&vs);
            let mut loss = ddp
                .f_forward(&batch(step, rank).to_kind(Kind::Half))
                .unwrap()
                .to_kind(Kind::Float)
                .pow_tensor_scalar(2)
                .mean(Kind::Float);
            if step == 2 && rank == 1 {
                loss += target.flatten(0, -1).get(0).to_kind(Kind::Float) * 1e3;
            }
            ddp.backward(&sc.scale(&loss).unwrap()).unwrap();
            sc.unscale(&mut opt).unwrap();
            let local_finite = opt.gradients().unwrap().iter().all(|g| g.isfinite().all().int64_value(&[]) == 1);
            let stepped = sc.step(&mut opt).unwrap();
            sc.update().unwrap();
            if model_zero_grad {
                ddp.zero_grad().unwrap();
            } else {
                opt.zero_grad().unwrap();
            }
            let moved = common::model::max_diff(&before, &common::model::params(&vs)) > 0.0;
            log.push((step, local_finite, stepped, moved, sc.get_scale()));
        }
        (log, common::model::params(&vs))
    });
    for (rank, (log, _)) in out.iter().enumerate() {
        for &(step, local_finite, stepped, moved, scale) in log {
            if step == 2 {
                // rank 0 owns the overflowed element; rank 1's own shard stayed finite
                assert_eq!(local_finite, rank == 1, "rank {rank}: local overflow at step 2");
                assert!(!stepped && !moved, "rank {rank}: the overflowed step is skipped");
                assert_eq!(scale, 1024.0, "rank {rank}: the scale backs off from 2048");
            } else {
                assert!(local_finite && stepped && moved, "rank {rank}, step {step}: a good step");
            }
        }
        // grown after two good steps in a row (steps 0-1, then 3-4), halved by the skip at step 2
        let scales: Vec<f64> = log.iter().map(|l| l.4).collect();
        assert_eq!(scales, vec![1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0], "rank {rank}");
    }
    assert_eq!(common::model::max_diff(&out[0].1, &out[1].1), 0.0, "ranks agree after the skip");
}
