//! FSDP (ZeRO-3): after training, the parameters equal single-process training with the same optimizer
//! (the full batch's gradient taken as the mean of the ranks' batches), on 2 and 3 ranks, with units of
//! 25, 35, 5 and 1 parameters (no world size here divides any; with 3 ranks some shards are empty), in
//! float32 and with bfloat16 compute; with resharding off, without prefetching, with gradient
//! accumulation, an unused parameter, offload and auto-wrap, and as HSDP (2 and 3 ranks a shard group, 2
//! replicas); each rank holds its shards only.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::fsdp::{FsdpBuilder, FsdpMemory, FsdpOptions, FullyShardedDataParallel};
use tch_dist::mesh::DeviceMesh;
use tch_dist::optim::{AdamW, Optimizer, Sgd};
use tch_dist::recompute::Checkpointed;
use tch_dist::DistModule;

const LR: f64 = 0.05;
const STEPS: usize = 4;

/// See `build`.
#[derive(Debug)]
struct Net {
    l1: Box<dyn Module>,
    l2: Box<dyn Module>,
    unused: Box<dyn Module>,
    l3: Box<dyn Module>,
    scale: Box<dyn Module>,
    use_unused: bool,
    /// `l1` is l1, tanh, pad and l2 in one sequence (auto-wrap)
    fused: bool,
}

fn between(h: &Tensor) -> Tensor {
    h.tanh().pad([0, 1], "constant", Some(0.5))
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = if self.fused { self.l1.forward(x) } else { self.l2.forward(&between(&self.l1.forward(x))) };
        let mut y = self.l3.forward(&h.tanh());
        if self.use_unused {
            y = &y + self.unused.forward(&y) * 0.0;
        }
        self.scale.forward(&y)
    }
}

/// Deterministic values by variable name, shifted by `shift` (ranks start different; rank 0's win).
fn init(vs: &nn::VarStore, shift: f64) {
    let _g = tch::no_grad_guard();
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, mut p)) in named.into_iter().enumerate() {
        let v = (Tensor::arange(p.numel() as i64, (Kind::Float, Device::Cpu)) * 0.37 + i as f64).sin() * 0.4 + shift;
        p.copy_(&v.view(p.size().as_slice()));
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Setup {
    /// ranks sharing the shards (the shard group)
    world: usize,
    /// HSDP: replicas of the shards (0 or 1: plain FSDP)
    replicas: usize,
    bf16: bool,
    /// reduce-scatter in float32 (with bf16 compute)
    reduce_f32: bool,
    keep_after_forward: bool,
    no_prefetch: bool,
    /// backwards per step, all but the last under no_sync
    accumulate: usize,
    /// a unit with a parameter that gets no gradient (trained with plain SGD, which leaves it alone)
    unused: bool,
    offload: bool,
    checkpointed: bool,
    /// l3 a unit too (the root holds no parameter) and every unit checkpointed around
    all_checkpointed: bool,
    auto_wrap: bool,
    /// the biases (5 elements) gathered once per iteration, in a unit of their own
    small: bool,
    /// the group under NCCL's rules (the strict mode): one all-gather and one reduce-scatter per unit,
    /// whatever the environment says
    nccl_rules: bool,
}

/// The model, its layers wrapped as units when `fsdp` is given: l1 (25 parameters), l2 (6→5: 35),
/// `unused` (1→1 without bias: 1), scale (1), and l3 (5→1 without bias: 5) left to the root.
fn build(vs: &nn::VarStore, fsdp: Option<&FsdpBuilder>, shift: f64, s: Setup) -> Net {
    let r = vs.root();
    let nb = nn::LinearConfig { bias: false, ..Default::default() };
    let (p1, p2, pu, ps) = (&r / "l1", &r / "l2", &r / "unused", &r / "scale");
    let l1 = nn::linear(&p1, 4, 5, Default::default());
    let l2 = nn::linear(&p2, 6, 5, Default::default());
    let unused = nn::linear(&pu, 1, 1, nb);
    let l3 = nn::linear(&r / "l3", 5, 1, nb);
    let gain = ps.ones("gain", &[1]);
    init(vs, shift);
    let scale = nn::func(move |x| x * &gain);
    type M = Box<dyn Module>;
    let p3 = &r / "l3";
    let l3: M = match fsdp {
        Some(f) if s.all_checkpointed => Box::new(Checkpointed::new(f.fully_shard(&p3, l3).unwrap())),
        _ => Box::new(l3),
    };
    let (l1, l2, unused, scale): (M, M, M, M) = match fsdp {
        None => (Box::new(l1), Box::new(l2), Box::new(unused), Box::new(scale)),
        Some(f) if s.all_checkpointed => (
            Box::new(Checkpointed::new(f.fully_shard(&p1, l1).unwrap())),
            Box::new(Checkpointed::new(f.fully_shard(&p2, l2).unwrap())),
            Box::new(Checkpointed::new(f.fully_shard(&pu, unused).unwrap())),
            Box::new(Checkpointed::new(f.fully_shard(&ps, scale).unwrap())),
        ),
        Some(f) if s.checkpointed => (
            Box::new(f.fully_shard(&p1, Checkpointed::new(l1)).unwrap()), // checkpoint inside a unit
            Box::new(Checkpointed::new(f.fully_shard(&p2, l2).unwrap())), // and around one
            Box::new(f.fully_shard(&pu, unused).unwrap()),
            Box::new(f.fully_shard(&ps, scale).unwrap()),
        ),
        Some(f) if s.auto_wrap => {
            // l1 (25) is under 30, with l2 (35) over it: one unit of both
            let w = f.auto_wrap(30).add(&p1, l1).unwrap().add_fn(between).add(&p2, l2).unwrap();
            (
                Box::new(w.build().unwrap()),
                Box::new(nn::func(|x| x.shallow_clone())),
                Box::new(f.fully_shard(&pu, unused).unwrap()),
                Box::new(f.fully_shard(&ps, scale).unwrap()),
            )
        }
        Some(f) => (
            Box::new(f.fully_shard(&p1, l1).unwrap()),
            Box::new(f.fully_shard(&p2, l2).unwrap()),
            Box::new(f.fully_shard(&pu, unused).unwrap()),
            Box::new(f.fully_shard(&ps, scale).unwrap()),
        ),
    };
    Net { l1, l2, unused, l3, scale, use_unused: s.unused, fused: s.auto_wrap && fsdp.is_some() }
}

fn batch(step: usize, rank: usize, micro: usize) -> (Tensor, Tensor) {
    let base = (step * 100 + rank * 10 + micro * 3) as f64;
    let x = ((Tensor::arange(12, (Kind::Float, Device::Cpu)) * 0.3 + base).sin()).view([3, 4]);
    let y = ((Tensor::arange(3, (Kind::Float, Device::Cpu)) * 0.7 + base).cos()).view([3, 1]);
    (x, y)
}

fn optimizer(params: Vec<Tensor>, s: Setup) -> Box<dyn Optimizer> {
    if s.unused {
        Box::new(Sgd::new(params, LR))
    } else {
        Box::new(AdamW::new(params, LR))
    }
}

/// Single process: the mean of the ranks' gradients (computed one rank's batch at a time, in bfloat16
/// for `bf16`, summed in float32) steps float32 parameters.
fn reference(s: Setup) -> Vec<(String, Tensor)> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = build(&vs, None, 0.0, s);
    let mut vs16 = nn::VarStore::new(Device::Cpu);
    let net16 = build(&vs16, None, 0.0, s);
    vs16.bfloat16();
    let names: Vec<String> = {
        let mut n: Vec<String> = vs.variables().into_keys().collect();
        n.sort();
        n
    };
    let master: Vec<Tensor> = names.iter().map(|n| vs.variables()[n].shallow_clone()).collect();
    let copies: Vec<Tensor> = names.iter().map(|n| vs16.variables()[n].shallow_clone()).collect();
    let mut opt = optimizer(master.iter().map(|t| t.shallow_clone()).collect(), s);
    for step in 0..STEPS {
        let sums: Vec<Tensor> = master.iter().map(|p| p.zeros_like()).collect();
        let mut touched = vec![false; sums.len()];
        if s.bf16 {
            tch::no_grad(|| copies.iter().zip(&master).for_each(|(c, m)| c.shallow_clone().copy_(m)));
        }
        let ranks = s.world * s.replicas.max(1);
        for micro in 0..s.accumulate.max(1) {
            for r in 0..ranks {
                let params = if s.bf16 { &copies } else { &master };
                params.iter().for_each(|p| tch_dist::hooks::set_grad(p, None).unwrap());
                let (x, y) = batch(step, r, micro);
                let out = if s.bf16 { net16.forward(&x.to_kind(Kind::BFloat16)) } else { net.forward(&x) };
                out.to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean).backward();
                tch::no_grad(|| {
                    for ((acc, p), t) in sums.iter().zip(params).zip(touched.iter_mut()) {
                        let g = p.grad();
                        if g.defined() {
                            *t = true;
                            let _ = acc.shallow_clone().g_add_(&(g.to_kind(Kind::Float) / ranks as f64));
                        }
                    }
                });
            }
        }
        // a parameter no backward reached has no gradient, and the optimizer leaves it alone
        for ((p, g), t) in master.iter().zip(&sums).zip(&touched) {
            tch_dist::hooks::set_grad(p, if *t { Some(g) } else { None }).unwrap();
        }
        opt.step().unwrap();
    }
    names.into_iter().zip(master.iter().map(|t| t.detach().copy())).collect()
}

struct Out {
    state: Vec<(String, Tensor)>,
    mem: FsdpMemory,
    placeholder_numel: usize,
    units: Vec<String>,
}

fn train(s: Setup) -> Vec<Out> {
    let mut group = common::gloo_opts(Duration::from_secs(60));
    group.strict_nccl |= s.nccl_rules;
    common::run_threads_with(s.world * s.replicas.max(1), group, move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let mut opts = if s.replicas > 1 {
            let mesh = DeviceMesh::new(&pg, &[("replicate", s.replicas), ("shard", s.world)]).unwrap();
            FsdpOptions::default().mesh(&mesh, &["replicate", "shard"]).unwrap()
        } else {
            FsdpOptions::default().process_group(Arc::new(pg))
        };
        if s.bf16 {
            opts = opts.param_dtype(Kind::BFloat16);
        }
        if s.reduce_f32 {
            opts = opts.reduce_dtype(Kind::Float);
        }
        if s.offload {
            opts = opts.offload(Device::Cpu);
        }
        opts = opts.reshard_after_forward(!s.keep_after_forward).prefetch(if s.no_prefetch { 0 } else { 1 });
        // 6: under l1's and l2's weights (20, 30), over their biases (5); `unused` and `scale` hold one
        // parameter of 1 element each and keep it
        opts = opts.gather_once_below(if s.small { 6 } else { 0 });
        let fsdp = FsdpBuilder::new(&vs, opts).unwrap();
        let net = build(&vs, Some(&fsdp), rank as f64, s);
        let model = fsdp.finish(net).unwrap();
        let mut opt = optimizer(model.parameters(), s);
        for step in 0..STEPS {
            for micro in 0..s.accumulate.max(1) {
                let (x, y) = batch(step, rank, micro);
                let run = |m: &FullyShardedDataParallel<Net>| {
                    let out = m.f_forward(&x).unwrap().to_kind(Kind::Float);
                    m.backward(&out.mse_loss(&y, tch::Reduction::Mean)).unwrap();
                };
                if micro + 1 < s.accumulate {
                    model.no_sync(run)
                } else {
                    run(&model)
                }
            }
            opt.step().unwrap();
            if step + 1 < STEPS {
                model.zero_grad().unwrap();
            }
        }
        let mem = model.memory_breakdown_with(opt.as_ref()).unwrap();
        let placeholder_numel = vs.variables()["l1.weight"].numel();
        Out { state: model.state_dict().unwrap(), mem, placeholder_numel, units: model.units() }
    })
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.iter().map(|x| &x.0).collect::<Vec<_>>(), b.iter().map(|x| &x.0).collect::<Vec<_>>());
    a.iter().zip(b).map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[])).fold(0.0, f64::max)
}

fn check(s: Setup, tol: f64) -> Vec<Out> {
    let reference = reference(s);
    let outs = train(s);
    for (r, o) in outs.iter().enumerate() {
        let d = max_diff(&o.state, &reference);
        assert!(d <= tol, "{s:?}: rank {r} differs from the single process by {d}");
        assert_eq!(max_diff(&o.state, &outs[0].state), 0.0, "{s:?}: ranks disagree");
        assert_eq!(o.placeholder_numel, 0, "a sharded parameter reads as empty between steps");
        assert_eq!(o.mem.gathered_parameters, 0, "{s:?}: nothing stays gathered after backward");
    }
    // the moved parameters: far from where they started (rank 0's init)
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = build(&vs, None, 0.0, s);
    let mut start: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    start.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(max_diff(&reference, &start) > 0.01, "training must move the parameters");
    outs
}

/// Observed: bit-identical on 2 ranks; on 3, within 1e-7 (the ranks' gradients summed in another order).
const TOL: f64 = 1e-6;

#[test]
fn fp32_equals_single_process_on_2_and_3_ranks() {
    for world in [2, 3] {
        let outs = check(Setup { world, ..Default::default() }, TOL);
        // each rank holds its shards only: each parameter split into `world` padded chunks
        let params = [("l1.bias", 5i64), ("l1.weight", 20), ("l2.bias", 5), ("l2.weight", 30), ("unused.weight", 1)];
        let params = params.iter().chain(&[("scale.gain", 1), ("l3.weight", 5)]);
        let own_of = |n: i64, r: i64| {
            let chunk = (n + world as i64 - 1) / world as i64;
            (n - r * chunk).clamp(0, chunk)
        };
        for (r, o) in outs.iter().enumerate() {
            let own: i64 = params.clone().map(|&(_, n)| own_of(n, r as i64)).sum();
            assert_eq!(o.mem.owned_elements, own, "rank {r} of {world}");
            assert_eq!(o.mem.sharded_parameters, 4 * own);
            // rank 0 owns the one element of `unused`, which no backward reached: no gradient, no state
            let stepped = own - (r == 0) as i64;
            assert_eq!(o.mem.gradient_shards, 4 * stepped);
            let state = o.mem.optimizer_state;
            // plus a step counter (8 bytes) per parameter stepped
            assert!(state >= 8 * stepped && state <= 8 * stepped + 8 * 7, "{:?}", o.mem);
            assert_eq!(o.units, ["l1", "l2", "unused", "scale", "root"]);
        }
        assert_eq!(outs.iter().map(|o| o.mem.owned_elements).sum::<i64>(), 67);
    }
}

/// One rank: nothing to reduce, the gradient is the shard's gradient (and no other rank's chunk of the
/// gathered buffer is free to receive into).
#[test]
fn one_rank_equals_single_process() {
    check(Setup { world: 1, ..Default::default() }, TOL);
    check(Setup { world: 1, keep_after_forward: true, ..Default::default() }, TOL);
}

/// HSDP: shards within 2 (and 3) ranks, replicated across 2: each replica reduce-scatters its ranks'
/// gradients, then the replicas sum their chunks; every rank equals the single process over all 4 (6)
/// ranks' batches, and holds the shards of its shard group only.
#[test]
fn hsdp_shards_within_and_replicates_across() {
    for world in [2, 3] {
        let outs = check(Setup { world, replicas: 2, ..Default::default() }, TOL);
        assert_eq!(outs[0].mem.owned_elements, outs[world].mem.owned_elements, "replicas hold the same shards");
        assert_eq!(outs.iter().map(|o| o.mem.owned_elements).sum::<i64>(), 2 * 67);
    }
    check(Setup { world: 2, replicas: 2, small: true, accumulate: 2, ..Default::default() }, TOL);
    check(Setup { world: 2, replicas: 2, keep_after_forward: true, ..Default::default() }, TOL);
}

#[test]
fn resharding_off_and_no_prefetch_change_nothing() {
    check(Setup { world: 2, keep_after_forward: true, ..Default::default() }, TOL);
    check(Setup { world: 3, no_prefetch: true, ..Default::default() }, TOL);
}

#[test]
fn bf16_compute_with_f32_shards() {
    // float32 reduction: the same sums as the reference, in another order
    let outs = check(Setup { world: 2, bf16: true, reduce_f32: true, ..Default::default() }, TOL);
    assert!(outs.iter().all(|o| o.state.iter().all(|(_, t)| t.kind() == Kind::Float)));
    check(Setup { world: 3, bf16: true, reduce_f32: true, ..Default::default() }, TOL);
    // bfloat16 reduction (FSDP2's default): each rank's gradient rounded to bfloat16 before the sum
    check(Setup { world: 2, bf16: true, ..Default::default() }, 2e-2);
}

#[test]
fn gradient_accumulation_under_no_sync() {
    check(Setup { world: 2, accumulate: 3, ..Default::default() }, TOL);
}

#[test]
fn a_parameter_without_gradient_is_reduced_as_zeros() {
    check(Setup { world: 3, unused: true, ..Default::default() }, TOL);
}

#[test]
fn offload_keeps_shards_and_state_on_their_own_device() {
    let outs = check(Setup { world: 2, offload: true, ..Default::default() }, TOL);
    for o in &outs {
        let m = o.mem;
        assert_eq!(m.offloaded, m.sharded_parameters + m.gradient_shards + m.optimizer_state, "{m:?}");
    }
}

#[test]
fn activation_checkpointing_inside_and_around_units() {
    check(Setup { world: 2, checkpointed: true, ..Default::default() }, TOL);
}

#[test]
fn every_unit_checkpointed_around_with_a_root_without_parameters() {
    check(Setup { world: 2, all_checkpointed: true, unused: true, ..Default::default() }, TOL);
}

#[test]
fn auto_wrap_by_size() {
    let outs = check(Setup { world: 2, auto_wrap: true, ..Default::default() }, TOL);
    assert_eq!(outs[0].units, ["l1+l2", "unused", "scale", "root"]);
}

/// Under NCCL's rules a unit is gathered in one all-gather and reduced in one reduce-scatter (FSDP2's
/// copy-in, collective, copy-out), whatever the environment chooses for the tests above: every setup
/// still equals one process.
#[test]
fn one_collective_per_unit_equals_single_process() {
    let one = Setup { nccl_rules: true, ..Default::default() };
    for world in [2, 3] {
        check(Setup { world, ..one }, TOL);
    }
    check(Setup { world: 2, replicas: 2, ..one }, TOL);
    check(Setup { world: 2, bf16: true, reduce_f32: true, ..one }, TOL);
    check(Setup { world: 3, bf16: true, ..one }, 2e-2);
    check(Setup { world: 2, accumulate: 3, ..one }, TOL);
    check(Setup { world: 2, keep_after_forward: true, no_prefetch: true, ..one }, TOL);
    check(Setup { world: 3, offload: true, unused: true, ..one }, TOL);
    check(Setup { world: 2, checkpointed: true, small: true, ..one }, TOL);
}

/// The collectives of one step, counted in the flight recorder on a group of the test's own name with
/// native collectives (one entry per call): in a first step each unit, l1 and l2 (4 parameters) and l3
/// (2), is gathered in forward and again in backward, and reduced once: one collective per unit under
/// NCCL's rules, one per parameter on Gloo.
#[test]
fn under_nccl_rules_a_unit_is_one_all_gather_and_one_reduce_scatter() {
    let count = |nccl_rules: bool| -> (bool, usize, usize) {
        let name = if nccl_rules { "one-per-unit" } else { "one-per-parameter" };
        let mut group = common::gloo_opts(Duration::from_secs(60));
        group.strict_nccl = nccl_rules;
        group.collectives = tch_dist::Collectives::Native;
        let counts = common::run_threads_with(2, group.clone(), move |world| {
            let pg = Arc::new(world.new_subgroup(&[0, 1], name).unwrap().unwrap());
            let vs = nn::VarStore::new(Device::Cpu);
            let opts = FsdpOptions::default().process_group(pg.clone()).gather_once_below(0);
            let fsdp = FsdpBuilder::new(&vs, opts).unwrap();
            let r = vs.root();
            let (p1, p2, p3) = (&r / "l1", &r / "l2", &r / "l3");
            let l1 = nn::linear(&p1, 4, 5, Default::default());
            let l2 = nn::linear(&p2, 5, 5, Default::default());
            let l3 = nn::linear(&p3, 5, 1, Default::default());
            init(&vs, 0.0);
            let a = fsdp.fully_shard_paths(&["l1".into(), "l2".into()], nn::seq().add(l1).add(l2)).unwrap();
            let b = fsdp.fully_shard(&p3, l3).unwrap();
            let model = fsdp.finish(nn::seq().add(a).add(b)).unwrap();
            let (x, y) = batch(0, pg.rank(), 0);
            let after = tch_dist::flight::entries().last().map_or(0, |e| e.id);
            world.barrier().unwrap();
            model.backward(&model.f_forward(&x).unwrap().mse_loss(&y, tch::Reduction::Mean)).unwrap();
            world.barrier().unwrap();
            let mine = |what: &str| {
                tch_dist::flight::entries()
                    .iter()
                    .filter(|e| e.id > after && e.group.contains(name) && e.group_rank == pg.rank())
                    .filter(|e| e.label.starts_with(what))
                    .count()
            };
            // the recorder keeps its last entries only: other tests' may have pushed this one's out
            let kept = tch_dist::flight::entries().first().is_none_or(|e| e.id <= after + 1);
            (kept, mine("FSDP all-gather"), mine("FSDP reduce-scatter"))
        });
        counts[0]
    };
    let count = |nccl_rules: bool| -> (usize, usize) {
        for _ in 0..5 {
            if let (true, gathers, reductions) = count(nccl_rules) {
                return (gathers, reductions);
            }
        }
        panic!("the flight recorder dropped this test's entries five times")
    };
    assert_eq!(count(true), (2 + 2, 1 + 1), "under NCCL's rules");
    assert_eq!(count(false), (2 * 4 + 2 * 2, 4 + 2), "on Gloo");
}

#[test]
fn small_parameters_are_gathered_once_per_iteration() {
    for world in [2, 3] {
        let outs = check(Setup { world, small: true, ..Default::default() }, TOL);
        assert_eq!(outs[0].units, ["l1", "l2", "unused", "scale", "small", "root"]);
    }
    check(Setup { world: 2, small: true, bf16: true, reduce_f32: true, ..Default::default() }, TOL);
    check(Setup { world: 3, small: true, bf16: true, ..Default::default() }, 2e-2);
    check(Setup { world: 2, small: true, accumulate: 3, ..Default::default() }, TOL);
    check(Setup { world: 2, small: true, checkpointed: true, ..Default::default() }, TOL);
    check(Setup { world: 3, small: true, keep_after_forward: true, no_prefetch: true, ..Default::default() }, TOL);
    check(Setup { world: 2, small: true, offload: true, unused: true, ..Default::default() }, TOL);
}

#[test]
fn the_reference_is_full_batch_training() {
    // the mean of the ranks' gradients is the full batch's gradient: one process on the whole batch
    let s = Setup { world: 2, ..Default::default() };
    let vs = nn::VarStore::new(Device::Cpu);
    let net = build(&vs, None, 0.0, s);
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let used: Vec<Tensor> =
        named.iter().filter(|(n, _)| !n.starts_with("unused")).map(|(_, t)| t.shallow_clone()).collect();
    let mut opt = AdamW::new(used, LR);
    for step in 0..STEPS {
        let parts: Vec<(Tensor, Tensor)> = (0..2).map(|r| batch(step, r, 0)).collect();
        let x = Tensor::cat(&[&parts[0].0, &parts[1].0], 0);
        let y = Tensor::cat(&[&parts[0].1, &parts[1].1], 0);
        opt.zero_grad().unwrap();
        net.forward(&x).mse_loss(&y, tch::Reduction::Mean).backward();
        opt.step().unwrap();
    }
    let full: Vec<(String, Tensor)> = named.iter().map(|(n, t)| (n.clone(), t.detach().copy())).collect();
    let d = max_diff(&full, &reference(s));
    assert!(d < 1e-5, "{d}");
}

/// Named tensors as plain data (tensors are neither Clone nor Sync, the rank closures must be both).
type Plain = Vec<(String, Vec<f32>, Vec<i64>)>;

fn plain(state: &[(String, Tensor)]) -> Plain {
    state.iter().map(|(n, t)| (n.clone(), Vec::<f32>::try_from(t.reshape([-1])).unwrap(), t.size())).collect()
}

fn tensors(p: &Plain) -> Vec<(String, Tensor)> {
    p.iter().map(|(n, v, s)| (n.clone(), Tensor::from_slice(v).view(s.as_slice()))).collect()
}

/// Runs `f` on `world` ranks, each with its own FsdpBuilder over the model of `build`.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, nn::VarStore, FsdpBuilder) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    common::run_threads(world, Duration::from_secs(60), move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(Arc::new(pg))).unwrap();
        f(rank, vs, fsdp)
    })
}

#[test]
fn full_state_dict_reloads_on_another_world_size_and_sharded_on_the_same() {
    let s = Setup { world: 2, ..Default::default() };
    // trained on 2 ranks
    let saved = plain(&train(s).remove(0).state);
    // loaded on 3: the full parameters come back
    let back = on_ranks(3, move |rank, vs, fsdp| {
        let model = fsdp.finish(build(&vs, None, 9.0 + rank as f64, s)).unwrap();
        model.load_state_dict(&tensors(&saved)).unwrap();
        let full = model.state_dict().unwrap();
        let sharded = model.sharded_state_dict().unwrap();
        // a sharded checkpoint: changed parameters, then loaded back
        let (x, _) = batch(0, rank, 0);
        let before = model.f_forward(&x).unwrap();
        tch::no_grad(|| {
            model.parameters().iter().for_each(|p| {
                let _ = p.shallow_clone().fill_(1.0);
            })
        });
        let changed = model.f_forward(&x).unwrap();
        model.load_sharded_state_dict(&sharded).unwrap();
        let after = model.f_forward(&x).unwrap();
        (full, before, changed, after)
    });
    let saved = tensors(&plain(&train(s).remove(0).state));
    for (full, before, changed, after) in back {
        assert_eq!(max_diff(&full, &saved), 0.0);
        assert!((&before - &changed).abs().max().double_value(&[]) > 1e-3);
        assert_eq!((&before - &after).abs().max().double_value(&[]), 0.0);
    }
}

#[test]
fn sharded_state_of_another_world_size_is_refused_by_name() {
    let s = Setup { world: 2, ..Default::default() };
    let saved = on_ranks(2, move |rank, vs, fsdp| {
        let model = fsdp.finish(build(&vs, None, rank as f64, s)).unwrap();
        plain(&model.sharded_state_dict().unwrap())
    });
    let e = on_ranks(3, move |rank, vs, fsdp| {
        let model = fsdp.finish(build(&vs, None, rank as f64, s)).unwrap();
        model.load_sharded_state_dict(&tensors(&saved[rank.min(1)])).unwrap_err().to_string()
    });
    assert!(
        e[0].contains("l1.bias was saved as 5 elements over 2 ranks") && e[0].contains("here it is 5 over 3"),
        "{}",
        e[0]
    );
}

#[test]
fn bad_units_are_refused_by_name() {
    let errs = on_ranks(2, |rank, vs, fsdp| {
        let r = vs.root();
        let a = nn::linear(&r / "a", 3, 3, Default::default());
        let b = nn::linear(&r / "b", 3, 4, Default::default());
        let empty = fsdp.fully_shard(&(&r / "nothing"), nn::func(|x| x.shallow_clone())).unwrap_err().to_string();
        let whole = fsdp.fully_shard(&r, nn::func(|x| x.shallow_clone())).unwrap_err().to_string();
        // rank 1 wraps b where rank 0 wraps a: different units, caught before any data moves
        let mismatch = if rank == 0 {
            fsdp.fully_shard(&(&r / "a"), a).map(|_| ()).unwrap_err().to_string()
        } else {
            fsdp.fully_shard(&(&r / "b"), b).map(|_| ()).unwrap_err().to_string()
        };
        (empty, whole, mismatch)
    });
    for (empty, whole, mismatch) in errs {
        assert!(empty.contains("no parameters under nothing"), "{empty}");
        assert!(whole.contains("use FsdpBuilder::finish"), "{whole}");
        assert!(
            mismatch.contains("ranks built different units")
                && mismatch.contains("rank 0: 2 parameters, 12 elements")
                && mismatch.contains("rank 1: 2 parameters, 16 elements"),
            "{mismatch}"
        );
    }
    let mixed = on_ranks(1, |_, vs, fsdp| {
        let r = vs.root();
        let _ = nn::linear(&r / "a", 3, 3, Default::default());
        let _frozen = vs.root().sub("a").var("frozen", &[2], nn::Init::Const(0.0)).set_requires_grad(false);
        fsdp.fully_shard(&(&r / "a"), nn::func(|x| x.shallow_clone())).map(|_| ()).unwrap_err().to_string()
    });
    assert!(mixed[0].contains("mixes frozen and trainable parameters"), "{}", mixed[0]);
}

/// Three 64x64 linear units in a row, without biases (prefetch 1, the default), resharding after forward
/// or not.
fn three_units(
    vs: &nn::VarStore,
    pg: tch_dist::group::ProcessGroup,
    reshard: bool,
) -> FullyShardedDataParallel<nn::Func<'static>> {
    let opts = FsdpOptions::default().process_group(Arc::new(pg)).reshard_after_forward(reshard);
    let fsdp = FsdpBuilder::new(vs, opts).unwrap();
    let nb = nn::LinearConfig { bias: false, ..Default::default() };
    let units: Vec<_> = (0..3)
        .map(|i| {
            let p = vs.root() / format!("l{i}");
            fsdp.fully_shard(&p, nn::linear(&p, 64, 64, nb)).unwrap()
        })
        .collect();
    fsdp.finish(nn::func(move |x| units[2].forward(&units[1].forward(&units[0].forward(x))))).unwrap()
}

/// In backward, the unit reduced and freed just before a gather of the same size hands its memory to
/// that gather instead of returning it to the allocator (whose 64-byte aligned blocks do not fit a
/// request of their own size again: each gather would take fresh pages). Unit 2's backward runs first;
/// at unit 1's pre-backward unit 2 is reduced and freed and unit 0 prefetched, into unit 2's memory.
#[test]
fn a_unit_freed_in_backward_hands_its_memory_to_the_next_gather() {
    let out = common::run_threads(2, Duration::from_secs(60), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = three_units(&vs, pg, true);
        let seen = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
        let vars = vs.variables();
        let _hooks: Vec<_> = (0..3)
            .map(|i| {
                let w = vars[&format!("l{i}.weight")].shallow_clone();
                let (seen, probe) = (seen.clone(), std::sync::Mutex::new(w.shallow_clone()));
                // runs in unit i's backward, while it is gathered
                tch_dist::hooks::on_grad_accumulated(&w, move || {
                    seen.lock().unwrap().insert(i, probe.lock().unwrap().data_ptr() as usize);
                })
                .unwrap()
            })
            .collect();
        let x = Tensor::ones([4, 64], (Kind::Float, Device::Cpu));
        let mut steps = Vec::new();
        for _ in 0..3 {
            // the first iteration records the order of units; later ones prefetch along it
            model.forward(&x).sum(Kind::Float).backward();
            model.zero_grad().unwrap();
            steps.push(seen.lock().unwrap().clone());
        }
        steps
    });
    for (rank, steps) in out.iter().enumerate() {
        for (s, ptrs) in steps.iter().enumerate().skip(1) {
            assert_eq!(ptrs.len(), 3, "rank {rank} step {s}: {ptrs:?}");
            assert_eq!(ptrs[&0], ptrs[&2], "rank {rank} step {s}: unit 0 was gathered into new memory: {ptrs:?}");
        }
    }
}

/// The unit whose forward came last last iteration is not freed after its forward when a backward
/// follows (its backward comes next and would gather it at once); without a backward (no_grad) it is.
#[test]
fn the_last_unit_of_the_forward_stays_gathered_for_its_backward() {
    let out = common::run_threads(2, Duration::from_secs(60), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = three_units(&vs, pg, true);
        let x = Tensor::ones([4, 64], (Kind::Float, Device::Cpu));
        let mut gathered = Vec::new();
        for _ in 0..3 {
            let y = model.forward(&x);
            gathered.push(model.memory_breakdown().unwrap().gathered_parameters);
            y.sum(Kind::Float).backward();
            model.zero_grad().unwrap();
        }
        let y = tch::no_grad(|| model.forward(&x));
        gathered.push(model.memory_breakdown().unwrap().gathered_parameters);
        drop(y);
        gathered
    });
    let unit = 64 * 64 * 4;
    for (rank, g) in out.iter().enumerate() {
        // the first iteration does not know the order yet
        assert_eq!(g, &[0, unit, unit, 0], "rank {rank}: gathered bytes after each forward");
    }
}

/// With resharding off, a unit's reduce-scatter is left running through the next unit's backward (FSDP2's
/// overlap): while unit 1's backward runs, unit 2's shard has no gradient yet. With resharding on it is
/// waited for at once (its buffers would add to the peak), so the gradient is there.
#[test]
fn with_resharding_off_a_reduction_runs_through_the_next_units_backward() {
    for reshard in [false, true] {
        let out = common::run_threads(2, Duration::from_secs(60), move |pg| {
            let vs = nn::VarStore::new(Device::Cpu);
            let model = three_units(&vs, pg, reshard);
            let shard2 = model.parameters()[2].shallow_clone();
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let w1 = vs.variables()["l1.weight"].shallow_clone();
            let (probe, shard) = (seen.clone(), std::sync::Mutex::new(shard2.shallow_clone()));
            let _hook = tch_dist::hooks::on_grad_accumulated(&w1, move || {
                probe.lock().unwrap().push(shard.lock().unwrap().grad().defined());
            })
            .unwrap();
            let x = Tensor::ones([4, 64], (Kind::Float, Device::Cpu));
            for _ in 0..2 {
                model.forward(&x).sum(Kind::Float).backward();
                assert!(shard2.grad().defined(), "unit 2's gradient after backward");
                model.zero_grad().unwrap();
            }
            let seen = seen.lock().unwrap().clone();
            seen
        });
        for (rank, seen) in out.iter().enumerate() {
            assert_eq!(
                seen,
                &[reshard, reshard],
                "rank {rank}, resharding {reshard}: unit 2 reduced during unit 1's backward"
            );
        }
    }
}

/// tch's own optimizer built over the VarStore once the model is finished (FSDP2's rule: the optimizer
/// after `fully_shard`) steps the shards, its weight-decay groups kept: `nn::AdamW` with a group that
/// decays and one that does not, on 2 ranks, equals one process on the whole batch.
#[test]
fn tch_s_own_adamw_over_the_var_store_steps_the_shards_with_its_groups() {
    fn net(vs: &nn::VarStore, fsdp: Option<&FsdpBuilder>) -> nn::Func<'static> {
        let (p1, p2) = (vs.root() / "l1", vs.root().set_group(1) / "l2");
        let l1 = nn::linear(&p1, 4, 6, Default::default());
        let l2 = nn::linear(&p2, 6, 1, Default::default());
        init(vs, 0.0);
        match fsdp {
            Some(f) => {
                let (l1, l2) = (f.fully_shard(&p1, l1).unwrap(), f.fully_shard(&p2, l2).unwrap());
                nn::func(move |x| l2.forward(&l1.forward(x).tanh()))
            }
            None => nn::func(move |x| l2.forward(&l1.forward(x).tanh())),
        }
    }
    fn adamw(vs: &nn::VarStore) -> nn::Optimizer {
        use tch::nn::OptimizerConfig;
        let mut o = nn::AdamW::default().build(vs, LR).unwrap();
        o.set_weight_decay_group(0, 0.0);
        o.set_weight_decay_group(1, 0.5);
        o
    }
    let loss = |y: &Tensor, t: &Tensor| (y - t).square().mean(Kind::Float);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = net(&vs, None);
    let mut opt = adamw(&vs);
    for step in 0..STEPS {
        let ((x0, y0), (x1, y1)) = (batch(step, 0, 0), batch(step, 1, 0));
        opt.zero_grad();
        loss(&m.forward(&Tensor::cat(&[x0, x1], 0)), &Tensor::cat(&[y0, y1], 0)).backward();
        opt.step();
    }
    let mut want: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    let start = nn::VarStore::new(Device::Cpu);
    let _ = net(&start, None);
    let moved = want.iter().map(|(n, t)| (t - &start.variables()[n]).abs().max().double_value(&[])).fold(0.0, f64::max);
    assert!(moved > 0.01, "training must move the parameters");
    let got = common::run_threads(2, Duration::from_secs(60), move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let m = net(&vs, Some(&fsdp));
        let model = fsdp.finish(m).unwrap();
        let mut opt = adamw(&vs);
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, 0);
            opt.zero_grad();
            model.backward(&loss(&model.forward(&x), &y)).unwrap();
            opt.step();
        }
        model.state_dict().unwrap()
    });
    equals_one_process(&got, &want);
}

/// HSDP's replicas must hold the same shards: a replicate group whose ranks sit at different places of
/// their shard groups (here the whole world, over shard groups of 2) is refused on every rank, naming
/// each one's place, before any gradient is summed with an unrelated one.
#[test]
fn a_replicate_group_that_does_not_mirror_the_shard_groups_is_refused() {
    let errs = common::run_threads(4, Duration::from_secs(60), |pg| {
        let world = Arc::new(pg);
        let mesh = DeviceMesh::new(&world, &[("replicate", 2), ("shard", 2)]).unwrap();
        let opts = FsdpOptions::default().process_group(mesh.group("shard").unwrap()).replicate_group(world.clone());
        let vs = nn::VarStore::new(Device::Cpu);
        FsdpBuilder::new(&vs, opts).map(|_| ()).unwrap_err().to_string()
    });
    for e in errs {
        assert!(e.contains("HSDP") && e.contains("rank 0: rank 0 of 2; rank 1: rank 1 of 2"), "{e}");
    }
    let err = FsdpOptions::default()
        .mesh(
            &DeviceMesh::new(
                &tch_dist::ProcessGroup::new(&tch_dist::Store::hash().unwrap(), 0, 1, &Default::default()).unwrap(),
                &[("a", 1)],
            )
            .unwrap(),
            &["a", "a"],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("[replicate, shard]"), "{err}");
}

/// Stands for two replicas that computed the same gradient: the sum doubles it, and the mean is over two.
#[derive(Debug, Default)]
struct Mirrored {
    sums: std::sync::atomic::AtomicUsize,
}

impl tch_dist::fsdp::Replicas for Mirrored {
    fn count(&self) -> usize {
        2
    }
    fn all_reduce_sum(&self, t: &Tensor) -> tch_dist::Result<()> {
        self.sums.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _ = t.shallow_clone().f_mul_scalar_(2.0)?;
        Ok(())
    }
}

/// HSDP through [`FsdpOptions::replicas`] (what fault tolerance plugs in): each parameter's reduced chunk
/// is summed once per backward, and the gradient divided by the replicas it counts. Setting it beside a
/// replicate group is refused.
#[test]
fn hsdp_reduces_across_the_replicas_its_options_name() {
    let grads = |replicas: Option<Arc<Mirrored>>| {
        let pg = Arc::new(
            tch_dist::ProcessGroup::new(&tch_dist::Store::hash().unwrap(), 0, 1, &Default::default()).unwrap(),
        );
        // values of their own, not tch's generator, which the binary's other tests draw from meanwhile
        let vs = nn::VarStore::new(Device::Cpu);
        let mut opts = FsdpOptions::default().process_group(pg).gather_once_below(0);
        if let Some(r) = replicas {
            opts = opts.replicas(r);
        }
        let (a, b) = (vs.root() / "a", vs.root() / "b");
        let (la, lb) = (nn::linear(&a, 8, 16, Default::default()), nn::linear(&b, 16, 1, Default::default()));
        init(&vs, 0.0);
        let fsdp = FsdpBuilder::new(&vs, opts).unwrap();
        let net = nn::seq()
            .add(fsdp.fully_shard(&a, la).unwrap())
            .add_fn(|x| x.tanh())
            .add(fsdp.fully_shard(&b, lb).unwrap());
        let model = fsdp.finish(net).unwrap();
        let x = (Tensor::arange(32, (Kind::Float, Device::Cpu)).view([4, 8]) * 0.3).sin();
        model.backward(&model.forward(&x).square().mean(Kind::Float)).unwrap();
        model.parameters().iter().map(|p| p.grad().copy()).collect::<Vec<_>>()
    };
    let mirrored = Arc::new(Mirrored::default());
    let (plain, hsdp) = (grads(None), grads(Some(mirrored.clone())));
    assert_eq!(mirrored.sums.load(std::sync::atomic::Ordering::SeqCst), 4, "one sum per parameter's chunk");
    for (p, h) in plain.iter().zip(&hsdp) {
        assert!(p.allclose(h, 1e-6, 1e-7, false), "the mean over two equal replicas is one replica's gradient");
    }
    let pg =
        Arc::new(tch_dist::ProcessGroup::new(&tch_dist::Store::hash().unwrap(), 0, 1, &Default::default()).unwrap());
    let opts = FsdpOptions::default().replicate_group(pg.clone()).replicas(Arc::new(Mirrored::default()));
    let err =
        FsdpBuilder::new(&nn::VarStore::new(Device::Cpu), opts.process_group(pg)).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("replicate_group and replicas"), "{err}");
}

/// The silent failure of a tch optimizer built before the model is finished (it would step the modules'
/// own parameters, which FSDP leaves without gradients) is refused on every rank, by the builder and by
/// the plan; the plan stays usable, and once the optimizer is dropped it finishes.
#[test]
fn a_tch_optimizer_built_before_finish_is_refused() {
    use tch::nn::OptimizerConfig;
    use tch_dist::DistModule;
    let out = common::run_threads(2, Duration::from_secs(60), |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone())).unwrap();
        let l = nn::linear(vs.root() / "l", 4, 2, Default::default());
        let early = nn::AdamW::default().build(&vs, LR).unwrap();
        let builder = fsdp.finish(l).map(|_| ()).unwrap_err().to_string();
        drop(early);
        // the plan: refused while the optimizer lives, finished once it is gone
        let vs = nn::VarStore::new(Device::Cpu);
        let plan = tch_dist::parallelize::Plan::new().fully_shard(FsdpOptions::default().process_group(pg)).unwrap();
        let l = nn::linear(vs.root() / "l", 4, 2, Default::default());
        let early = nn::AdamW::default().build(&vs, LR).unwrap();
        let planned = plan.finish(&vs, l).map(|_| ()).unwrap_err().to_string();
        drop(early);
        let l = nn::linear(vs.root() / "again", 4, 2, Default::default());
        let model = plan.finish(&vs, l).unwrap();
        let mut opt = nn::AdamW::default().build(&vs, LR).unwrap();
        let before: Vec<Tensor> = model.parameters().iter().map(|p| p.detach().copy()).collect();
        let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
        model.backward(&model.f_forward(&x).unwrap().square().mean(Kind::Float)).unwrap();
        opt.step();
        let moved = model.parameters().iter().zip(&before).any(|(p, b)| !p.equal(b));
        (builder, planned, moved)
    });
    for (rank, (builder, planned, moved)) in out.into_iter().enumerate() {
        for e in [&builder, &planned] {
            assert!(e.contains("nn::Optimizer") && e.contains("after finish"), "rank {rank}: {e}");
        }
        assert!(builder.contains("FsdpBuilder::finish") && planned.contains("Plan::finish"));
        assert!(moved, "rank {rank}: the optimizer built after finish steps the shards");
    }
}

/// tch-dist's own optimizer built over the VarStore before `finish` holds the modules' parameters, which
/// FSDP never gives a gradient: its step refuses, naming the fix. Fault tolerance's healing likewise
/// refuses the VarStore of an FSDP model (its variables are empty between uses) and takes the model.
#[test]
fn an_early_optimizer_and_a_sharded_var_store_are_refused_where_they_would_do_nothing() {
    use tch_dist::ft::ReplicaState;
    let pg =
        Arc::new(tch_dist::ProcessGroup::new(&tch_dist::Store::hash().unwrap(), 0, 1, &Default::default()).unwrap());
    let vs = nn::VarStore::new(Device::Cpu);
    let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg)).unwrap();
    let l = nn::linear(vs.root() / "l", 4, 2, Default::default());
    let mut early = AdamW::new(vs.trainable_variables(), LR);
    let model = fsdp.finish(l).unwrap();
    let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
    model.backward(&model.forward(&x).square().mean(Kind::Float)).unwrap();
    let e = early.step().unwrap_err().to_string();
    assert!(e.contains("AdamW::step") && e.contains("after finish"), "{e}");
    let mut late = AdamW::new(model.parameters(), LR);
    late.step().unwrap();
    let e = vs.replica_tensors().unwrap_err().to_string();
    assert!(e.contains("l.") && e.contains("FullyShardedDataParallel"), "{e}");
    let names: Vec<String> = model.replica_tensors().unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["l.bias", "l.weight"]);
}

/// A block whose forward takes a second input (a rotary table, as Llama's blocks take theirs) is an FSDP
/// unit through `forward_with`: on 2 ranks it trains as one process does on the whole batch.
#[test]
fn a_block_with_a_second_input_is_a_unit_through_forward_with() {
    struct Rotary {
        l: nn::Linear,
    }
    impl Rotary {
        fn forward(&self, x: &Tensor, table: &Tensor) -> Tensor {
            self.l.forward(x) * table
        }
    }
    type Model = Box<dyn Fn(&Tensor) -> Tensor + Send>;
    fn net(vs: &nn::VarStore, fsdp: Option<&FsdpBuilder>) -> Model {
        let (p1, p2) = (vs.root() / "rot", vs.root() / "out");
        let rot = Rotary { l: nn::linear(&p1, 4, 6, Default::default()) };
        let out = nn::linear(&p2, 6, 1, Default::default());
        init(vs, 0.0);
        let table = Tensor::linspace(0.5, 1.5, 6, (Kind::Float, Device::Cpu));
        match fsdp {
            Some(f) => {
                let rot = tch_dist::parallelize::Unit::Sharded(f.fully_shard(&p1, rot).unwrap());
                let out = f.fully_shard(&p2, out).unwrap();
                Box::new(move |x| out.forward(&rot.forward_with(x, |b, x| b.forward(x, &table)).tanh()))
            }
            None => Box::new(move |x| out.forward(&rot.forward(x, &table).tanh())),
        }
    }
    let loss = |y: &Tensor, t: &Tensor| (y - t).square().mean(Kind::Float);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = net(&vs, None);
    let mut opt = Sgd::new(vs.trainable_variables(), LR);
    for step in 0..STEPS {
        let ((x0, y0), (x1, y1)) = (batch(step, 0, 0), batch(step, 1, 0));
        opt.zero_grad().unwrap();
        loss(&m(&Tensor::cat(&[x0, x1], 0)), &Tensor::cat(&[y0, y1], 0)).backward();
        opt.step().unwrap();
    }
    let mut want: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    let got = common::run_threads(2, Duration::from_secs(60), move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let m = net(&vs, Some(&fsdp));
        let model = fsdp.finish(nn::func(move |x| m(x))).unwrap();
        let mut opt = Sgd::new(model.parameters(), LR);
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, 0);
            opt.zero_grad().unwrap();
            model.backward(&loss(&model.forward(&x), &y)).unwrap();
            opt.step().unwrap();
        }
        model.state_dict().unwrap()
    });
    equals_one_process(&got, &want);
}

/// Every rank's full state equals one process's, name by name (within float32 rounding).
fn equals_one_process(got: &[Vec<(String, Tensor)>], want: &[(String, Tensor)]) {
    for (rank, state) in got.iter().enumerate() {
        assert_eq!(state.len(), want.len());
        for ((n, g), (wn, w)) in state.iter().zip(want) {
            assert_eq!(n, wn);
            let d = (g - w).abs().max().double_value(&[]);
            assert!(d < 1e-5, "rank {rank}: {n} differs from one process by {d:e}");
        }
    }
}

/// A unit used before its model is finished (a plan never finished, as a forgotten `plan.finish` leaves
/// it) would train only what no unit holds, unreduced: its forward is refused, naming the unit and the fix.
#[test]
fn a_unit_used_before_its_model_is_finished_is_refused() {
    let errs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let p = vs.root() / "l1";
        let l1 = nn::linear(&p, 4, 3, Default::default());
        let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let unit = fsdp.fully_shard(&p, l1).unwrap();
        let e = unit.f_forward(&Tensor::ones([2, 4], (Kind::Float, Device::Cpu))).unwrap_err().to_string();
        let model = fsdp.finish(nn::seq()).unwrap();
        let after = unit.f_forward(&Tensor::ones([2, 4], (Kind::Float, Device::Cpu))).map(|y| y.size());
        drop(model);
        (e, after.ok())
    });
    for (rank, (e, after)) in errs.into_iter().enumerate() {
        assert!(e.contains("FSDP unit \"l1\"") && e.contains("never finished"), "rank {rank}: {e}");
        assert_eq!(after, Some(vec![2, 3]), "rank {rank}: finished, the unit runs");
    }
}
