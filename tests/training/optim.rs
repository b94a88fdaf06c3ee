//! Our optimizers against torch.optim run by PyTorch on the same parameters and gradients; state
//! round trips; and they keep DDP's bucket views.
use crate::common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::hooks;
use tch_dist::optim::{AdamW, AdamWConfig, Optimizer, SgdConfig};
use tch_dist::DistModule;

// the last one larger than AdamW's CPU chunk (2^16), so chunks are compared with PyTorch too
const SHAPES: [&[i64]; 4] = [&[4, 3], &[5], &[2, 2, 2], &[300, 500]];

fn formula(n: i64, k: f64) -> Tensor {
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.5
}

fn params() -> Vec<Tensor> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| formula(s.iter().product(), i as f64).view(*s).set_requires_grad(true))
        .collect()
}

fn handles(ps: &[Tensor]) -> Vec<Tensor> {
    ps.iter().map(|t| t.shallow_clone()).collect()
}

/// The gradient of step `step` for parameter `i` (tests/py/optim_ref.py draws the same): every third
/// element exactly zero, as behind a dead ReLU (AdamW's second moment stays zero there).
fn gradient(n: i64, step: usize, i: usize) -> Tensor {
    let dead = Tensor::arange(n, (Kind::Int64, Device::Cpu)).remainder(3).eq(0);
    formula(n, step as f64 * 0.7 + i as f64 + 10.0).masked_fill(&dead, 0.0)
}

fn run(opt: &mut dyn Optimizer, ps: &[Tensor], from: usize, to: usize) {
    for step in from..to {
        for (i, p) in ps.iter().enumerate() {
            let g = gradient(p.numel() as i64, step, i).view(p.size().as_slice());
            hooks::set_grad(p, Some(&g)).unwrap();
        }
        opt.step().unwrap();
    }
}

fn pytorch(args: &[&str]) -> Vec<Vec<f64>> {
    let o = Command::new(common::python()).arg(common::repo_path("tests/py/optim_ref.py")).args(args).output().unwrap();
    assert!(o.status.success(), "{}", common::show(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect()
}

/// Every float32 equal to PyTorch's, bit for bit (printed with 10 significant digits: enough to name each
/// float32 exactly).
fn compare_exactly(ps: &[Tensor], want: &[Vec<f64>], what: &str) {
    assert_eq!(ps.len(), want.len());
    for (p, w) in ps.iter().zip(want) {
        let got = Vec::<f32>::try_from(p.detach().flatten(0, -1)).unwrap();
        let w: Vec<f32> = w.iter().map(|&x| x as f32).collect();
        assert_eq!(got, w, "{what}");
    }
}

/// Runs `f` counting ATen's top-level operators, and checks that it called `op` (the multi-tensor path ran)
/// or not at all.
fn calls<R>(op: &str, called: bool, f: impl FnOnce() -> R) -> R {
    let (r, counts) = tch_dist::reference::count_ops(f).unwrap();
    let n = counts.get(op).copied().unwrap_or(0);
    assert_eq!(n > 0, called, "{op} called {n} times; counted: {counts:?}");
    r
}

#[test]
fn sgd_matches_torch_optim_sgd() {
    for (m, d, n, wd) in
        [(0.0, 0.0, false, 0.0), (0.9, 0.1, false, 0.01), (0.9, 0.0, true, 0.01), (0.9, 0.0, true, 0.0)]
    {
        let args = ["sgd", "0.1", &m.to_string(), &d.to_string(), if n { "1" } else { "0" }, &wd.to_string(), "6"];
        // the single-tensor path (the CPU's default), then the multi-tensor one (foreach), each against
        // PyTorch's same path: torch.optim.SGD's calls with the same scalars, the same floats
        for foreach in [false, true] {
            let ps = params();
            let cfg = SgdConfig { momentum: m, dampening: d, nesterov: n, weight_decay: wd, foreach: None };
            let mut opt =
                if foreach { cfg.build(handles(&ps), 0.1).foreach(true) } else { cfg.build(handles(&ps), 0.1) };
            calls("aten::_foreach_add_", foreach, || run(&mut opt, &ps, 0, 6));
            let want = pytorch(&[&args[..], if foreach { &["foreach"][..] } else { &[][..] }].concat());
            compare_exactly(
                &ps,
                &want,
                &format!("SGD momentum {m} dampening {d} nesterov {n} wd {wd} foreach {foreach}"),
            );
        }
    }
}

/// The multi-tensor path (`foreach=True`, the default on CUDA) against PyTorch's, bit for bit; it runs
/// ATen's `_foreach_*` operators (counted), where the CPU's default path runs none.
#[test]
fn foreach_adamw_matches_torch_optim_adamw_foreach() {
    for (b1, b2, eps, wd) in [(0.9, 0.999, 1e-8, 0.01), (0.8, 0.99, 1e-6, 0.1), (0.9, 0.999, 1e-8, 0.0)] {
        let what = format!("foreach AdamW betas ({b1}, {b2}) eps {eps} wd {wd}");
        let ps = params();
        let mut opt = AdamW::new(handles(&ps), 0.01).betas(b1, b2).eps(eps).weight_decay(wd).foreach(true);
        calls("aten::_foreach_lerp_", true, || run(&mut opt, &ps, 0, 6));
        let args = ["adamw", "0.01", &b1.to_string(), &b2.to_string(), &eps.to_string(), &wd.to_string(), "6"];
        compare_exactly(&ps, &pytorch(&[&args[..], &["foreach"]].concat()), &what);
    }
    // PyTorch refuses fused and foreach together; so do we
    let ps = params();
    let mut opt = AdamW::new(handles(&ps), 0.01).fused(true).foreach(true);
    hooks::set_grad(&ps[0], Some(&ps[0].ones_like())).unwrap();
    let e = opt.step().unwrap_err().to_string();
    assert!(e.contains("fused and foreach"), "{e}");
}

/// The fused kernel against PyTorch's `AdamW(fused=True)`: bit for bit (the same ATen kernel). The default
/// path matches it within float32 rounding but not bit for bit (in at least one setting), so the
/// comparison would catch the kernel not running.
#[test]
fn fused_adamw_matches_torch_optim_adamw_fused() {
    let mut differs = false;
    for (b1, b2, eps, wd) in [(0.9, 0.999, 1e-8, 0.01), (0.8, 0.99, 1e-6, 0.1)] {
        let what = format!("fused AdamW betas ({b1}, {b2}) eps {eps} wd {wd}");
        let ps = params();
        let mut opt = AdamW::new(handles(&ps), 0.01).betas(b1, b2).eps(eps).weight_decay(wd).fused(true);
        run(&mut opt, &ps, 0, 6);
        let args = ["adamw", "0.01", &b1.to_string(), &b2.to_string(), &eps.to_string(), &wd.to_string(), "6"];
        let want = pytorch(&[&args[..], &["fused"]].concat());
        compare_exactly(&ps, &want, &format!("{what}: against PyTorch's fused step"));
        let plain = params();
        run(&mut AdamW::new(handles(&plain), 0.01).betas(b1, b2).eps(eps).weight_decay(wd), &plain, 0, 6);
        let diffs: Vec<f64> = ps.iter().zip(&plain).map(|(a, b)| (a - b).abs().max().double_value(&[])).collect();
        assert!(diffs.iter().all(|&d| d < 1e-6), "{what}: fused and default paths differ by {diffs:?}");
        differs |= diffs.iter().any(|&d| d > 0.0);
    }
    assert!(differs, "the default path is bit-identical to the fused one: the comparison shows nothing");
}

#[test]
fn adamw_matches_torch_optim_adamw() {
    for (b1, b2, eps, wd) in [(0.9, 0.999, 1e-8, 0.01), (0.8, 0.99, 1e-6, 0.1)] {
        let ps = params();
        let cfg = AdamWConfig { beta1: b1, beta2: b2, eps, weight_decay: wd, ..Default::default() };
        let mut opt = cfg.build(handles(&ps), 0.01);
        // on the CPU the default is the single-tensor path, as PyTorch's
        calls("aten::_foreach_lerp_", false, || run(&mut opt, &ps, 0, 6));
        let want =
            pytorch(&["adamw", "0.01", &b1.to_string(), &b2.to_string(), &eps.to_string(), &wd.to_string(), "6"]);
        // the same ATen calls with the same scalars as torch.optim's single-tensor path: the same floats
        compare_exactly(&ps, &want, &format!("AdamW betas ({b1}, {b2}) eps {eps} wd {wd}"));
    }
}

#[test]
fn state_round_trips_exactly() {
    let straight = params();
    let mut a = AdamW::new(handles(&straight), 0.01);
    run(&mut a, &straight, 0, 6);

    let resumed = params();
    let mut b = AdamW::new(handles(&resumed), 0.01);
    run(&mut b, &resumed, 0, 3);
    let state: Vec<(String, Tensor)> = b.state_dict().into_iter().map(|(n, t)| (n, t.copy())).collect();
    let mut c = AdamW::new(handles(&resumed), 0.01);
    c.load_state_dict(&state).unwrap();
    run(&mut c, &resumed, 3, 6);
    for (x, y) in straight.iter().zip(&resumed) {
        assert!(x.equal(y));
    }
    // a state of the wrong shape is refused, naming the entry
    let mut bad = AdamW::new(vec![Tensor::zeros([7], (Kind::Float, Device::Cpu)).set_requires_grad(true)], 0.01);
    let e = bad.load_state_dict(&state).unwrap_err().to_string();
    assert!(e.contains("adamw.0.exp_avg"), "{e}");
}

#[test]
fn our_optimizers_keep_ddp_bucket_views() {
    let res = common::run_threads(2, Duration::from_secs(60), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root() / "fc", 4, 3, Default::default());
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let mut opt = AdamW::new(vs.trainable_variables(), 0.01);
        let (mut ptrs, mut outside, mut dropped) = (Vec::new(), Vec::new(), true);
        for s in 0..3 {
            let x = formula(8, s as f64).view([2, 4]);
            ddp.backward(&ddp.f_forward(&x).unwrap().sum(Kind::Float)).unwrap();
            opt.step().unwrap();
            // after the step, before zero_grad: where the gradients the step read live
            ptrs.push(vs.trainable_variables().iter().map(|p| hooks::grad_data_ptr(p).unwrap()).collect::<Vec<_>>());
            outside.push(ddp.memory_breakdown().unwrap().gradients);
            opt.zero_grad().unwrap();
            dropped &= vs.trainable_variables().iter().all(|p| !p.grad().defined());
        }
        (ptrs, outside, dropped)
    });
    for (ptrs, outside, dropped) in res {
        assert!(dropped, "zero_grad sets the gradients to none");
        assert!(ptrs.iter().flatten().all(|&p| p != 0), "every step read a gradient: {ptrs:?}");
        assert_eq!(outside, [0, 0, 0], "gradients must be inside the buckets at every step");
        assert_eq!(ptrs[1], ptrs[2], "the next backward puts gradients back into the same bucket memory");
    }
}

#[test]
fn adamw_in_chunks_equals_adamw_in_one_piece() {
    // 700,000 elements: a contiguous tensor is updated in chunks; the same values seen through a
    // transposed (non-contiguous) view are updated in one piece. Elementwise: they must agree exactly.
    let base = formula(700_000, 0.3).view([700, 1000]);
    let a = base.copy().set_requires_grad(true);
    let b_storage = base.tr().contiguous(); // [1000, 700], holding base transposed
    let b = b_storage.tr().set_requires_grad(true); // [700, 1000] again, non-contiguous
    assert!(!b.is_contiguous());
    let mut oa = AdamW::new(vec![a.shallow_clone()], 0.01);
    let mut ob = AdamW::new(vec![b.shallow_clone()], 0.01);
    for step in 0..3 {
        let g = gradient(700_000, step, 0).view([700, 1000]);
        hooks::set_grad(&a, Some(&g)).unwrap();
        hooks::set_grad(&b, Some(&g.tr().contiguous().tr())).unwrap();
        oa.step().unwrap();
        ob.step().unwrap();
    }
    assert_eq!(common::model::max_diff(&[a.detach()], &[b.detach().contiguous()]), 0.0);
}

/// The default path's two-pass kernel runs where the CPU has AVX2 and FMA, so the comparisons with PyTorch
/// above test it (elsewhere they test ATen's calls, which it falls back to).
#[test]
fn adamw_runs_in_two_passes_where_the_cpu_allows() {
    let variant = tch_dist::optim::two_pass_variant();
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        assert!(variant.is_some(), "no variant of the two-pass AdamW gave ATen's floats on this CPU");
        return;
    }
    eprintln!("skipped: no AVX2 and FMA on this CPU (variant {variant:?})");
}
