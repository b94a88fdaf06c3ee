//! Gradient clipping under every layout equals `torch.nn.utils.clip_grad_norm_` on the unsharded model
//! (PyTorch run here, on the full batch's gradients): the returned norm, and the parameters after one SGD
//! step of rate 1 (so the step subtracts exactly the clipped gradient). Layouts: plain, DDP, ZeRO-1,
//! ZeRO-2 (also under a GradScaler), the plan's ZeRO-1 and ZeRO-2, FSDP on 2 and 3 ranks, tensor
//! parallel, and TP × DP on 4 ranks; norms 2 and ∞, each clipping (the norm above max_norm). DDP and FSDP
//! also clip through `Optimizer::clip_grad_norm`, which reads the placements of what it steps.
use crate::common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::amp::GradScaler;
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
use tch_dist::mesh::DeviceMesh;
use tch_dist::optim::{clip_grad_norm, GradNorm, Optimizer, Sgd};
use tch_dist::parallelize::Plan;
use tch_dist::tp::layers::ParallelMlp;
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;

const T: Duration = Duration::from_secs(60);
/// Small enough that every case clips.
const MAX_NORM: f64 = 0.05;
const NORMS: [f64; 2] = [2.0, f64::INFINITY];

type Named = BTreeMap<String, Tensor>;

fn formula(shape: &[i64], k: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.8).view(shape)
}

/// Rank `r`'s batch of 2 (inputs, targets); ranks of one data-parallel group get different ones.
fn batch(r: usize, d_out: i64) -> (Tensor, Tensor) {
    (formula(&[2, 4], r as f64 * 3.0), formula(&[2, d_out], r as f64 * 3.0 + 100.0))
}

fn full_batch(world: usize, d_out: i64) -> (Tensor, Tensor) {
    let parts: Vec<(Tensor, Tensor)> = (0..world).map(|r| batch(r, d_out)).collect();
    (
        Tensor::cat(&parts.iter().map(|p| &p.0).collect::<Vec<_>>(), 0),
        Tensor::cat(&parts.iter().map(|p| &p.1).collect::<Vec<_>>(), 0),
    )
}

/// Model A: `a` 4→6, tanh, `b` 6→3 (51 parameters, which neither 2 nor 3 divides).
fn model_a(vs: &nn::VarStore, fsdp: Option<&FsdpBuilder>) -> nn::Sequential {
    let r = vs.root();
    let a = nn::linear(&r / "a", 4, 6, Default::default());
    let b = nn::linear(&r / "b", 6, 3, Default::default());
    tch::no_grad(|| {
        for (i, (_, mut p)) in sorted(vs.variables()).into_iter().enumerate() {
            p.copy_(&formula(&p.size(), i as f64 + 0.5));
        }
    });
    match fsdp {
        None => nn::seq().add(a).add_fn(|x| x.tanh()).add(b),
        Some(f) => {
            let a = f.fully_shard(&(&r / "a"), a).unwrap();
            let b = f.fully_shard(&(&r / "b"), b).unwrap();
            nn::seq().add(a).add_fn(|x| x.tanh()).add(b)
        }
    }
}

/// Model B's full weights: `fc1` 4→6, GELU, `fc2` 6→4 (what `ParallelMlp` computes, sliced).
fn model_b_weights() -> [Tensor; 4] {
    [formula(&[6, 4], 1.0), formula(&[6], 2.0), formula(&[4, 6], 3.0), formula(&[4], 4.0)]
}

fn sorted(m: impl IntoIterator<Item = (String, Tensor)>) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = m.into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn loss(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

/// The unsharded model on the full batch: its parameters and gradients, by name.
struct Reference {
    params: Vec<(String, Tensor)>,
    grads: Vec<Tensor>,
}

fn reference_a(world: usize) -> Reference {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model_a(&vs, None);
    let (x, y) = full_batch(world, 3);
    loss(&m.forward(&x), &y).backward();
    let params = sorted(vs.variables());
    let grads = params.iter().map(|(_, p)| p.grad().copy()).collect();
    Reference { params: params.into_iter().map(|(n, p)| (n, p.detach().copy())).collect(), grads }
}

fn reference_b(dp: usize) -> Reference {
    let vs = nn::VarStore::new(Device::Cpu);
    let names = [("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"), ("fc2", "bias")];
    let w: Vec<Tensor> =
        model_b_weights().iter().zip(names).map(|(t, (l, n))| (vs.root() / l).var_copy(n, t)).collect();
    let (x, y) = full_batch(dp, 4);
    let out = x.linear(&w[0], Some(&w[1])).gelu("none").linear(&w[2], Some(&w[3]));
    loss(&out, &y).backward();
    let params = sorted(vs.variables());
    let grads = params.iter().map(|(_, p)| p.grad().copy()).collect();
    Reference { params: params.into_iter().map(|(n, p)| (n, p.detach().copy())).collect(), grads }
}

/// What PyTorch's clip_grad_norm_ returns and leaves, for the reference's gradients.
struct Clipped {
    total: f64,
    /// the parameters after subtracting the clipped gradients
    after: Named,
}

fn floats(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).unwrap()
}

/// One PyTorch process for all cases.
fn pytorch(cases: &[(&Reference, f64, f64)]) -> Vec<Clipped> {
    let json: Vec<serde_json::Value> = cases
        .iter()
        .map(|(r, p, max)| {
            let grads: Vec<serde_json::Value> =
                r.grads.iter().map(|g| serde_json::json!([g.size(), floats(g)])).collect();
            let p = if p.is_infinite() { serde_json::json!("inf") } else { serde_json::json!(p) };
            serde_json::json!({"grads": grads, "norm_type": p, "max_norm": max})
        })
        .collect();
    let mut child = Command::new(common::python())
        .arg(common::repo_path("tests/py/clip_ref.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(serde_json::to_string(&json).unwrap().as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", common::show(&o));
    let out: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    out.iter()
        .zip(cases)
        .map(|(v, (r, _, _))| {
            let after = r
                .params
                .iter()
                .zip(v["grads"].as_array().unwrap())
                .map(|((n, p), g)| {
                    let g: Vec<f64> = g.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                    (n.clone(), p - Tensor::from_slice(&g).to_kind(Kind::Float).view(p.size().as_slice()))
                })
                .collect();
            Clipped { total: v["total"].as_f64().unwrap(), after }
        })
        .collect()
}

/// A rank's outcome: the norm `clip` returned and the full parameters after the step.
type Got = (f64, Named);

fn assert_same(what: &str, got: &[Got], want: &Clipped) {
    assert!(want.total > MAX_NORM * 2.0, "{what}: the case must clip (PyTorch's norm {})", want.total);
    for (r, (total, after)) in got.iter().enumerate() {
        let rel = (total - want.total).abs() / want.total;
        assert!(rel < 1e-5, "{what}: rank {r}'s norm {total} vs PyTorch's {}", want.total);
        assert_eq!(after.keys().collect::<Vec<_>>(), want.after.keys().collect::<Vec<_>>(), "{what}");
        for (n, t) in after {
            let d = (t - &want.after[n]).abs().max().double_value(&[]);
            assert!(d < 1e-6, "{what}: rank {r}'s {n} differs from PyTorch's clipped step by {d}");
        }
    }
}

fn named(vs: &nn::VarStore) -> Named {
    vs.variables().into_iter().map(|(n, p)| (n, p.detach().copy())).collect()
}

fn plain(p: f64, max_norm: f64) -> Vec<Got> {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model_a(&vs, None);
    let (x, y) = full_batch(2, 3);
    loss(&m.forward(&x), &y).backward();
    let total = clip_grad_norm(&vs.trainable_variables(), max_norm, p).unwrap().double_value(&[]);
    Sgd::new(vs.trainable_variables(), 1.0).step().unwrap();
    vec![(total, named(&vs))]
}

#[derive(Clone, Copy, Debug)]
enum Dp {
    Ddp,
    Zero(ZeroStage),
    ZeroScaled,
    /// the plan's ZeRO, its optimizer from the model
    PlanZero(ZeroStage),
}

fn data_parallel(kind: Dp, p: f64) -> Vec<Got> {
    common::run_threads(2, T, move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model_a(&vs, None);
        if let Dp::PlanZero(stage) = kind {
            let plan = Plan::new().replicate(DdpOptions::default().process_group(Arc::new(pg))).zero(stage).unwrap();
            let (model, mut opt) = plan.finish_with_optimizer(&vs, m, |ps| Box::new(Sgd::new(ps, 1.0))).unwrap();
            let (x, y) = batch(rank, 3);
            model.backward(&loss(&model.f_forward(&x).unwrap(), &y)).unwrap();
            // the parameters' gradients are not what ZeRO's optimizer steps: clipping them is refused
            let e = clip_grad_norm(&model.parameters(), MAX_NORM, p).unwrap_err().to_string();
            assert!(e.contains("opt.clip_grad_norm") && e.contains(&format!("ZeRO-{}", stage.number())), "{e}");
            // the plan's stage reached the optimizer: gradient shards under stage 2 only
            assert_eq!(opt.memory().gradient_shards > 0, stage == ZeroStage::Two, "{stage:?}");
            let t = opt.clip_grad_norm(MAX_NORM, p).unwrap().double_value(&[]);
            opt.step().unwrap();
            return (t, named(&vs));
        }
        let ddp = DistributedDataParallel::new(&vs, m, DdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let (x, y) = batch(rank, 3);
        let out = ddp.f_forward(&x).unwrap();
        let total = match kind {
            Dp::Ddp => {
                ddp.backward(&loss(&out, &y)).unwrap();
                // the optimizer's own clip: its parameters' placements say they are DDP's replicas
                let mut opt = Sgd::new(ddp.parameters(), 1.0);
                let t = opt.clip_grad_norm(MAX_NORM, p).unwrap().double_value(&[]);
                opt.step().unwrap();
                t
            }
            Dp::Zero(stage) => {
                let mut opt = ShardedOptimizer::new(&ddp, stage, |ps| Box::new(Sgd::new(ps, 1.0))).unwrap();
                ddp.backward(&loss(&out, &y)).unwrap();
                let t = opt.clip_grad_norm(MAX_NORM, p).unwrap().double_value(&[]);
                opt.step().unwrap();
                t
            }
            Dp::PlanZero(_) => unreachable!("run above"),
            Dp::ZeroScaled => {
                let mut opt = ShardedOptimizer::new(&ddp, ZeroStage::Two, |ps| Box::new(Sgd::new(ps, 1.0))).unwrap();
                let mut scaler = GradScaler::new().init_scale(1024.0);
                ddp.backward(&scaler.scale(&loss(&out, &y)).unwrap()).unwrap();
                scaler.unscale(&mut opt).unwrap();
                let t = opt.clip_grad_norm(MAX_NORM, p).unwrap().double_value(&[]);
                assert!(scaler.step(&mut opt).unwrap(), "no overflow here");
                t
            }
        };
        (total, named(&vs))
    })
}

/// `through_optimizer`: the optimizer's clip over the shards it steps, else the function over the model's
/// parameters (the same shards).
fn fsdp(world: usize, p: f64, through_optimizer: bool) -> Vec<Got> {
    common::run_threads(world, T, move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let f = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let m = model_a(&vs, Some(&f));
        let model = f.finish(m).unwrap();
        let (x, y) = batch(rank, 3);
        model.backward(&loss(&model.f_forward(&x).unwrap(), &y)).unwrap();
        // this rank's shards alone have a smaller p-norm: the bug clipping per shard would be (the
        // ∞-norm of the rank holding the largest entry is the model's)
        let local = GradNorm::new(p)
            .gradients(model.parameters().iter().map(|t| t.grad()).collect(), &[])
            .total()
            .unwrap()
            .double_value(&[]);
        let mut opt = Sgd::new(model.parameters(), 1.0);
        let total = if through_optimizer {
            opt.clip_grad_norm(MAX_NORM, p)
        } else {
            clip_grad_norm(&model.parameters(), MAX_NORM, p)
        };
        let total = total.unwrap().double_value(&[]);
        let smaller = if p.is_finite() { local < total * 0.999 } else { local <= total };
        assert!(smaller, "rank {rank}: its shards' {p}-norm {local} vs the model's {total}");
        opt.step().unwrap();
        (total, model.state_dict().unwrap().into_iter().collect())
    })
}

/// TP on groups of 2 within `world` ranks (DP over the rest, with DDP); the full parameters rebuilt
/// from the TP ranks' slices.
fn tensor_parallel(world: usize, p: f64) -> Vec<Got> {
    let res = common::run_threads(world, T, move |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", world / 2), ("tp", 2)]).unwrap();
        let (tp_rank, dp_rank) = (mesh.coordinate("tp").unwrap(), mesh.coordinate("dp").unwrap());
        let tp = mesh.group("tp").unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let w = model_b_weights();
        let mlp = ParallelMlp::from_full(&vs.root(), &w[0], &w[1], &w[2], &w[3], tp.clone()).unwrap();
        let ddp = DistributedDataParallel::new(&vs, mlp, DdpOptions::default().mesh(&mesh, "dp").unwrap()).unwrap();
        let (x, y) = batch(dp_rank, 4);
        let out = ddp.forward_with(|m| m.f_forward(&x)).unwrap().unwrap();
        ddp.backward(&loss(&out, &y)).unwrap();
        let m = ddp.module();
        // the layers' placements say which parameters are slices over tp (DDP's replicas count once)
        let _ = m;
        let total = clip_grad_norm(&vs.trainable_variables(), MAX_NORM, p).unwrap().double_value(&[]);
        Sgd::new(vs.trainable_variables(), 1.0).step().unwrap();
        (tp_rank, total, named(&vs))
    });
    // column-parallel fc1 by rows, row-parallel fc2's weight by columns, fc2's bias whole
    let cat = |name: &str, dim: i64, group: &[&(usize, f64, Named)]| {
        Tensor::cat(&group.iter().map(|(_, _, n)| &n[name]).collect::<Vec<_>>(), dim)
    };
    res.chunks(2)
        .flat_map(|pair| {
            let group: Vec<&(usize, f64, Named)> = pair.iter().collect();
            assert_eq!((group[0].0, group[1].0), (0, 1));
            let full: Named = [
                ("fc1.weight".to_string(), cat("fc1.weight", 0, &group)),
                ("fc1.bias".to_string(), cat("fc1.bias", 0, &group)),
                ("fc2.weight".to_string(), cat("fc2.weight", 1, &group)),
                ("fc2.bias".to_string(), group[0].2["fc2.bias"].copy()),
            ]
            .into_iter()
            .collect();
            group.iter().map(|(_, t, _)| (*t, full.copy_named())).collect::<Vec<_>>()
        })
        .collect()
}

trait CopyNamed {
    fn copy_named(&self) -> Named;
}
impl CopyNamed for Named {
    fn copy_named(&self) -> Named {
        self.iter().map(|(n, t)| (n.clone(), t.copy())).collect()
    }
}

#[test]
fn every_layout_clips_like_pytorch_on_the_unsharded_model() {
    let (a2, a3, b1, b2) = (reference_a(2), reference_a(3), reference_b(1), reference_b(2));
    let mut cases: Vec<(&Reference, f64, f64)> = Vec::new();
    for p in NORMS {
        cases.extend([(&a2, p, MAX_NORM), (&a3, p, MAX_NORM), (&b1, p, MAX_NORM), (&b2, p, MAX_NORM)]);
    }
    let want = pytorch(&cases);
    for (i, p) in NORMS.into_iter().enumerate() {
        let [w2, w3, wtp, wtpdp] = [&want[4 * i], &want[4 * i + 1], &want[4 * i + 2], &want[4 * i + 3]];
        assert_same(&format!("plain, norm {p}"), &plain(p, MAX_NORM), w2);
        for kind in [
            Dp::Ddp,
            Dp::Zero(ZeroStage::One),
            Dp::Zero(ZeroStage::Two),
            Dp::ZeroScaled,
            Dp::PlanZero(ZeroStage::One),
            Dp::PlanZero(ZeroStage::Two),
        ] {
            assert_same(&format!("{kind:?}, norm {p}"), &data_parallel(kind, p), w2);
        }
        assert_same(&format!("FSDP on 2 ranks, norm {p}"), &fsdp(2, p, false), w2);
        assert_same(&format!("FSDP on 3 ranks, norm {p}"), &fsdp(3, p, false), w3);
        assert_same(&format!("FSDP on 3 ranks, the optimizer's clip, norm {p}"), &fsdp(3, p, true), w3);
        assert_same(&format!("TP on 2 ranks, norm {p}"), &tensor_parallel(2, p), wtp);
        assert_same(&format!("TP x DP on 4 ranks, norm {p}"), &tensor_parallel(4, p), wtpdp);
    }
}

#[test]
fn a_norm_under_max_norm_leaves_gradients_alone() {
    let r = reference_a(2);
    let want = pytorch(&[(&r, 2.0, 1e3)]);
    let got = plain(2.0, 1e3);
    assert!((got[0].0 - want[0].total).abs() < 1e-5 * want[0].total);
    for (n, p0) in &r.params {
        let unclipped = p0 - &r.grads[r.params.iter().position(|(m, _)| m == n).unwrap()];
        assert!((&got[0].1[n] - unclipped).abs().max().double_value(&[]) < 1e-6, "{n}");
    }
}

/// What PyTorch does at the edges: no gradients, norm 0; a NaN gradient, a NaN norm and NaN gradients
/// (the coefficient is NaN: GradScaler skips such a step); an infinite one, an infinite norm and a zero
/// coefficient (inf times 0 is NaN there), for the 2-norm and the infinity norm alike.
#[test]
fn empty_nan_and_infinite_gradients_are_clipped_as_pytorch_does() {
    for p in [2.0, f64::INFINITY] {
        assert_eq!(GradNorm::new(p).total().unwrap().double_value(&[]), 0.0);
        assert_eq!(GradNorm::new(p).gradients(vec![], &[]).clip(1.0).unwrap().double_value(&[]), 0.0);
        let g = Tensor::from_slice(&[3.0f32, f32::NAN]);
        let total = GradNorm::new(p).gradients(vec![g.shallow_clone()], &[]).clip(1.0).unwrap();
        assert!(total.double_value(&[]).is_nan() && Vec::<f32>::try_from(&g).unwrap().iter().all(|x| x.is_nan()));
        let g = Tensor::from_slice(&[3.0f32, f32::INFINITY]);
        let total = GradNorm::new(p).gradients(vec![g.shallow_clone()], &[]).clip(1.0).unwrap();
        let after = Vec::<f32>::try_from(&g).unwrap();
        assert!(total.double_value(&[]) == f64::INFINITY && after[0] == 0.0 && after[1].is_nan(), "{p}: {after:?}");
        assert_eq!(total.kind(), Kind::Float);
    }
}

#[test]
fn bad_arguments_and_disagreeing_layouts_are_refused_by_name() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = model_a(&vs, None);
    let (x, y) = full_batch(1, 3);
    loss(&m.forward(&x), &y).backward();
    let ps = vs.trainable_variables();
    let e = clip_grad_norm(&ps, 1.0, -1.0).unwrap_err().to_string();
    assert!(e.contains("norm_type"), "{e}");
    let e = clip_grad_norm(&ps, f64::NAN, 2.0).unwrap_err().to_string();
    assert!(e.contains("max_norm"), "{e}");
    // rank 1 describes two sharded parts where rank 0 has one: an error on both, not a Gloo abort
    let errs = common::run_threads(2, T, |pg| {
        let g = Tensor::ones([3], (Kind::Float, Device::Cpu));
        let pg = Arc::new(pg);
        let mut n = GradNorm::new(2.0).gradients(vec![g.copy()], &[&pg]);
        if pg.rank() == 1 {
            n = n.gradients(vec![g], &[&pg]);
        }
        n.total().unwrap_err().to_string()
    });
    for e in errs {
        assert!(e.contains("describe their gradients differently") && e.contains("rank 1"), "{e}");
    }
}

/// As PyTorch's `clip_grad_norm_`: one `_foreach_norm` and one `_foreach_mul_` per device and dtype, so
/// the operators launched do not grow with the number of gradients (6 or 60 of two dtypes: the same counts).
#[test]
fn clipping_launches_one_norm_and_one_scale_per_dtype_whatever_the_number_of_gradients() {
    let launches = |n: usize| {
        let ps: Vec<Tensor> = (0..n)
            .map(|i| {
                let kind = if i % 3 == 0 { Kind::Double } else { Kind::Float };
                let p = Tensor::zeros([4], (kind, Device::Cpu)).set_requires_grad(true);
                let _ = tch_dist::hooks::set_grad(&p, Some(&formula(&[4], i as f64).to_kind(kind)));
                p
            })
            .collect();
        let (total, ops) = tch_dist::reference::count_ops(|| clip_grad_norm(&ps, MAX_NORM, 2.0).unwrap()).unwrap();
        assert!(total.double_value(&[]) > MAX_NORM, "nothing was clipped");
        ops
    };
    let (few, many) = (launches(6), launches(60));
    assert_eq!(few.get("aten::_foreach_norm"), Some(&2), "{few:?}");
    assert_eq!(few.get("aten::_foreach_mul_"), Some(&2), "{few:?}");
    assert_eq!(few, many, "the operators launched grow with the gradients");
}
