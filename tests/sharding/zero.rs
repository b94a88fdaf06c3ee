//! ZeRO stages 1 and 2: DDP + ShardedOptimizer ends with the parameters of DDP + the same optimizer
//! unsharded, on 2 and 3 ranks, with a parameter count (23) that no world size here divides, in one bucket
//! and in one bucket per parameter; each rank holds state for its shard only, and under stage 2 only its
//! gradient shard.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::FsdpOptions;
use tch_dist::optim::{AdamW, Optimizer, Sgd};
use tch_dist::parallelize::Plan;
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;

/// Elementwise updates of the same values, and the same sums (reduce-scatter and allreduce add two or
/// three numbers in rank order): observed bit-identical; 1e-6 leaves room for nothing more.
const TOL: f64 = 1e-6;

/// The model in bfloat16, initialised for `rank` (DDP broadcasts rank 0's).
fn bf16_model(rank: usize) -> (nn::VarStore, nn::Sequential) {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    common::model::init(&vs, rank as f64);
    vs.bfloat16();
    (vs, net)
}

fn model(vs: &nn::VarStore) -> nn::Sequential {
    let r = vs.root();
    nn::seq()
        .add(nn::linear(&r / "a", 5, 3, Default::default())) // 18
        .add_fn(|x| x.tanh())
        .add(nn::linear(&r / "b", 3, 1, Default::default())) // 4
        .add(nn::linear(&r / "c", 1, 1, nn::LinearConfig { bias: false, ..Default::default() }))
    // 1
}

#[derive(Clone, Copy, Debug)]
struct Setup {
    world: usize,
    zero: Option<ZeroStage>,
    adam: bool,
    /// one bucket per parameter instead of one for the whole model
    tiny_buckets: bool,
    views: bool,
    /// backwards per step (all but the last under no_sync)
    accumulate: usize,
    /// forward under bf16 autocast (float32 parameters)
    autocast: bool,
}

struct Out {
    params: Vec<Tensor>,
    owned: i64,
    grads_after_backward: usize,
    state_bytes: i64,
    shard_bytes: i64,
}

fn batch(step: usize, rank: usize, micro: usize) -> Tensor {
    ((Tensor::arange(20, (Kind::Float, Device::Cpu)) * 0.3 + (step * 10 + rank * 3 + micro) as f64).sin()).view([4, 5])
}

fn train(s: Setup) -> Vec<Out> {
    common::run_threads(s.world, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        common::model::init(&vs, rank as f64); // deterministic; DDP broadcasts rank 0's
        let mut opts = DdpOptions::default().process_group(pg.clone()).gradient_as_bucket_view(s.views);
        if s.tiny_buckets {
            opts = opts.bucket_cap_mb(1e-6).first_bucket_bytes(1);
        }
        let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
        let make = move |p: Vec<Tensor>| -> Box<dyn Optimizer + Send> {
            if s.adam {
                Box::new(AdamW::new(p, 0.05))
            } else {
                Box::new(Sgd::new(p, 0.1).momentum(0.9))
            }
        };
        let mut opt: Box<dyn Optimizer> = match s.zero {
            Some(stage) => Box::new(ShardedOptimizer::new(&ddp, stage, make).unwrap()),
            None => make(vs.trainable_variables()),
        };
        let mut grads_after_backward = 0;
        for step in 0..5 {
            for micro in 0..s.accumulate {
                let x = batch(step, rank, micro);
                let run = |d: &DistributedDataParallel<nn::Sequential>| {
                    let out = if s.autocast {
                        d.forward_with(|m| {
                            tch_dist::amp::autocast(Device::Cpu, Kind::BFloat16, || m.forward(&x)).unwrap()
                        })
                        .unwrap()
                    } else {
                        d.forward_with(|m| m.forward(&x)).unwrap()
                    };
                    let loss = out.to_kind(Kind::Float).pow_tensor_scalar(2).mean(Kind::Float);
                    d.backward(&loss).unwrap();
                };
                if micro + 1 < s.accumulate {
                    ddp.no_sync(run)
                } else {
                    run(&ddp)
                }
            }
            grads_after_backward = vs.trainable_variables().iter().filter(|p| p.grad().defined()).count();
            opt.step().unwrap();
            opt.zero_grad().unwrap();
            ddp.zero_grad().unwrap();
        }
        let m = ddp.memory_breakdown_with(opt.as_ref()).unwrap();
        Out {
            params: common::model::params(&vs),
            owned: m.owned_elements,
            grads_after_backward,
            state_bytes: m.optimizer_state,
            shard_bytes: m.gradient_shards,
        }
    })
}

fn compare(s: Setup) {
    let plain = train(Setup { zero: None, ..s });
    let zero = train(s);
    let world = s.world as i64;
    let mut owned = 0;
    for (r, (p, z)) in plain.iter().zip(&zero).enumerate() {
        let d = common::model::max_diff(&p.params, &z.params);
        assert!(d < TOL, "{s:?}, rank {r}: parameters differ from unsharded DDP by {d:e}");
        owned += z.owned;
        // one bucket of 23 is cut in shards of ceil(23/N); tiny buckets (one per tensor: tch makes
        // a's bias (3), a's weight (15), b's bias (1) and weight (3), c's weight (1)) each
        let shard = |n: i64| (n - r as i64 * ((n + world - 1) / world)).clamp(0, (n + world - 1) / world);
        let expect = if s.tiny_buckets { [3, 15, 1, 3, 1].iter().map(|&n| shard(n)).sum() } else { shard(23) };
        assert_eq!(z.owned, expect, "{s:?}: rank {r} owns its shard of each bucket");
        // AdamW keeps two moments and a step counter per stepped tensor; SGD one momentum buffer
        let per_elem = if s.adam { 8 } else { 4 };
        assert!(
            z.state_bytes >= per_elem * z.owned && z.state_bytes <= per_elem * z.owned + 8 * 5,
            "{s:?}: rank {r} state {} B for {} elements",
            z.state_bytes,
            z.owned
        );
        assert!(p.state_bytes >= per_elem * 23, "unsharded state covers every parameter");
        match s.zero {
            Some(ZeroStage::Two) => {
                assert_eq!(z.grads_after_backward, 0, "{s:?}: under stage 2 no full gradient survives backward");
                assert!(
                    z.shard_bytes > 0 && z.shard_bytes <= 4 * (z.owned + 5),
                    "{s:?}: gradient shard {} B",
                    z.shard_bytes
                );
            }
            _ => assert_eq!(z.grads_after_backward, 5),
        }
    }
    assert_eq!(owned, 23, "{s:?}: the shards cover the parameters exactly once");
}

#[test]
fn zero1_matches_plain_ddp_with_the_same_optimizer() {
    for world in [2, 3] {
        for adam in [true, false] {
            for tiny_buckets in [false, true] {
                compare(Setup {
                    world,
                    zero: Some(ZeroStage::One),
                    adam,
                    tiny_buckets,
                    views: true,
                    accumulate: 1,
                    autocast: false,
                });
            }
        }
    }
    compare(Setup {
        world: 2,
        zero: Some(ZeroStage::One),
        adam: true,
        tiny_buckets: true,
        views: false,
        accumulate: 1,
        autocast: false,
    });
}

#[test]
fn zero2_matches_plain_ddp_with_the_same_optimizer() {
    for world in [2, 3] {
        for adam in [true, false] {
            for tiny_buckets in [false, true] {
                compare(Setup {
                    world,
                    zero: Some(ZeroStage::Two),
                    adam,
                    tiny_buckets,
                    views: true,
                    accumulate: 1,
                    autocast: false,
                });
            }
        }
    }
}

#[test]
fn zero_under_bf16_autocast_matches_plain_ddp_under_autocast() {
    for stage in [ZeroStage::One, ZeroStage::Two] {
        compare(Setup {
            world: 2,
            zero: Some(stage),
            adam: true,
            tiny_buckets: true,
            views: true,
            accumulate: 1,
            autocast: true,
        });
    }
}

#[test]
fn zero2_accumulates_under_no_sync() {
    for world in [2, 3] {
        compare(Setup {
            world,
            zero: Some(ZeroStage::Two),
            adam: true,
            tiny_buckets: true,
            views: true,
            accumulate: 3,
            autocast: false,
        });
    }
}

#[test]
fn zero2_with_bf16_parameters_keeps_float32_master_weights() {
    // bf16 model; stage 1 and stage 2 reduce the same bf16 sums (two ranks: one addition) and step the
    // same float32 masters, so they agree exactly; the master copy is 4 bytes per owned element.
    let run = |stage: ZeroStage| {
        common::run_threads(2, Duration::from_secs(60), move |pg| {
            let pg = Arc::new(pg);
            let rank = pg.rank();
            let (vs, net) = bf16_model(rank);
            let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone())).unwrap();
            let mut opt = ShardedOptimizer::new(&ddp, stage, |p| Box::new(AdamW::new(p, 0.01))).unwrap();
            for step in 0..4 {
                let x = batch(step, rank, 0).to_kind(Kind::BFloat16);
                let loss = ddp.f_forward(&x).unwrap().to_kind(Kind::Float).pow_tensor_scalar(2).mean(Kind::Float);
                ddp.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad().unwrap();
            }
            let m = ddp.memory_breakdown_with(&opt).unwrap();
            assert_eq!(m.master_params, 4 * m.owned_elements, "float32 master for the owned elements");
            // consolidated: one float32 master per parameter, which the bf16 parameter is the rounding of
            let c = opt.consolidated_state_dict().unwrap();
            for (i, p) in ddp.parameters().iter().enumerate() {
                let master = &c.iter().find(|(n, _)| *n == format!("zero.master.{i}")).unwrap().1;
                assert_eq!((master.kind(), master.size()), (Kind::Float, p.size()));
                assert_eq!(common::model::max_diff(&[master.to_kind(Kind::BFloat16)], &[p.detach()]), 0.0);
            }
            assert_eq!(m.parameters, 2 * 23, "bf16 parameters");
            (common::model::params(&vs), m.owned_elements)
        })
    };
    let one = run(ZeroStage::One);
    let two = run(ZeroStage::Two);
    for ((a, _), (b, _)) in one.iter().zip(&two) {
        assert!(a.iter().all(|t| t.kind() == Kind::BFloat16));
        assert_eq!(common::model::max_diff(a, b), 0.0, "stage 1 and stage 2 agree");
    }
    assert_eq!(common::model::max_diff(&two[0].0, &two[1].0), 0.0, "ranks agree");
    // and the float32 masters moved the bf16 parameters away from their start
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = model(&vs);
    common::model::init(&vs, 0.0);
    let start: Vec<Tensor> = common::model::params(&vs).iter().map(|t| t.to_kind(Kind::BFloat16)).collect();
    assert!(common::model::max_diff(&start, &two[0].0) > 1e-3);
}

#[test]
fn parameters_become_views_of_the_flat_buffer_and_training_reads_them() {
    // after sharding, an in-place change to a parameter is what the next forward sees (no stale copy)
    let out = common::run_threads(2, Duration::from_secs(60), |pg| {
        let pg = Arc::new(pg);
        let vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg)).unwrap();
        let _opt = ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(Sgd::new(p, 0.1))).unwrap();
        let x = Tensor::ones([1, 5], (Kind::Float, Device::Cpu));
        let before = ddp.f_forward(&x).unwrap().double_value(&[0, 0]);
        tch::no_grad(|| {
            for mut p in vs.trainable_variables() {
                let _ = p.fill_(0.0);
            }
        });
        let after = ddp.f_forward(&x).unwrap().double_value(&[0, 0]);
        (before, after)
    });
    for (before, after) in out {
        assert!(before != 0.0);
        assert_eq!(after, 0.0);
    }
}

#[test]
fn zero2_reduces_unused_parameters_as_zeros() {
    // A layer outside the loss: with find_unused_parameters its slots are reduced as zeros. Flat shards
    // cannot skip elements, so a ZeRO step sees a zero gradient where unsharded DDP leaves `.grad` unset;
    // plain SGD makes the two the same (momentum or weight decay would move such a parameter under ZeRO,
    // as under FSDP).
    let run = |zero: Option<ZeroStage>| {
        common::run_threads(2, Duration::from_secs(60), move |pg| {
            let pg = Arc::new(pg);
            let rank = pg.rank();
            let vs = nn::VarStore::new(Device::Cpu);
            let net = model(&vs);
            let _unused = nn::linear(vs.root() / "unused", 2, 2, Default::default());
            common::model::init(&vs, rank as f64);
            let opts = DdpOptions::default().process_group(pg.clone()).find_unused_parameters(true).bucket_cap_mb(1e-4);
            let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
            let make = |p: Vec<Tensor>| -> Box<dyn Optimizer + Send> { Box::new(Sgd::new(p, 0.1)) };
            let mut opt: Box<dyn Optimizer> = match zero {
                Some(stage) => Box::new(ShardedOptimizer::new(&ddp, stage, make).unwrap()),
                None => make(vs.trainable_variables()),
            };
            for step in 0..3 {
                let x = batch(step, rank, 0);
                ddp.backward(&ddp.f_forward(&x).unwrap().pow_tensor_scalar(2).mean(Kind::Float)).unwrap();
                opt.step().unwrap();
                opt.zero_grad().unwrap();
            }
            common::model::params(&vs)
        })
    };
    let plain = run(None);
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let z = run(Some(stage));
        for (p, q) in plain.iter().zip(&z) {
            let d = common::model::max_diff(p, q);
            assert!(d < TOL, "{stage:?} with an unused layer: {d:e}");
        }
    }
}

#[test]
fn zero2_resumes_from_per_rank_checkpoints_exactly() {
    // bf16 parameters, float32 master weights and AdamW moments sharded over 2 ranks: each rank writes its
    // shard's state to its own safetensors file; a fresh model, DDP and optimizer that load them continue
    // exactly as an uninterrupted run.
    let dir = std::env::temp_dir().join(format!("tch-dist-zero-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let train = move |steps: std::ops::Range<usize>, resume: bool, save: bool, dir: std::path::PathBuf| {
        common::run_threads(2, Duration::from_secs(60), move |pg| {
            let pg = Arc::new(pg);
            let rank = pg.rank();
            let (vs, net) = bf16_model(rank);
            let file = dir.join(format!("rank{rank}.safetensors"));
            let saved = if resume { Some(tch_dist::checkpoint::read(&file).unwrap().1) } else { None };
            if let Some(state) = &saved {
                tch::no_grad(|| {
                    for (name, mut t) in tch_dist::checkpoint::var_store_tensors(&vs) {
                        let (_, v) = state.iter().find(|(n, _)| *n == format!("model.{name}")).unwrap();
                        t.copy_(v);
                    }
                });
            }
            let ddp = DistributedDataParallel::new(
                &vs,
                net,
                DdpOptions::default().process_group(pg.clone()).bucket_cap_mb(1e-4),
            )
            .unwrap();
            let mut opt = ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(AdamW::new(p, 0.01))).unwrap();
            if let Some(state) = &saved {
                let mine: Vec<(String, Tensor)> = state
                    .iter()
                    .filter_map(|(n, t)| n.strip_prefix("opt.").map(|k| (k.to_string(), t.shallow_clone())))
                    .collect();
                opt.load_state_dict(&mine).unwrap();
            }
            for step in steps.clone() {
                let x = batch(step, rank, 0).to_kind(Kind::BFloat16);
                ddp.backward(&ddp.f_forward(&x).unwrap().to_kind(Kind::Float).pow_tensor_scalar(2).mean(Kind::Float))
                    .unwrap();
                opt.step().unwrap();
                opt.zero_grad().unwrap();
            }
            if save {
                let mut all: Vec<(String, Tensor)> = tch_dist::checkpoint::var_store_tensors(&vs)
                    .into_iter()
                    .map(|(n, t)| (format!("model.{n}"), t))
                    .collect();
                all.extend(opt.state_dict().into_iter().map(|(n, t)| (format!("opt.{n}"), t)));
                assert!(all.iter().any(|(n, _)| n.ends_with(".master")), "master weights are in the state");
                tch_dist::checkpoint::write_atomic(&file, steps.end as u64, &all).unwrap();
            }
            common::model::params(&vs)
        })
    };
    let straight = train(0..5, false, false, dir.clone());
    train(0..2, false, true, dir.clone());
    let resumed = train(2..5, true, false, dir.clone());
    let _ = std::fs::remove_dir_all(&dir);
    for (a, b) in straight.iter().zip(&resumed) {
        assert_eq!(common::model::max_diff(a, b), 0.0, "resumed run ends where the uninterrupted one does");
    }
}

type Named = Vec<(String, Tensor)>;

/// Trains `steps` on `world` ranks from `start` (parameters and optimizer state, consolidated form, or
/// none); returns rank 0's parameters and consolidated optimizer state.
fn resume(
    world: usize,
    zero: Option<ZeroStage>,
    steps: std::ops::Range<usize>,
    start: Option<(Vec<Tensor>, Named)>,
) -> (Vec<Tensor>, Named) {
    let start = start.map(|(p, s)| (p, s.into_iter().map(|(n, t)| (n, t.copy())).collect::<Named>()));
    let start = Arc::new(std::sync::Mutex::new(start));
    let out = common::run_threads(world, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        common::model::init(&vs, rank as f64);
        let start: Option<(Vec<Tensor>, Named)> = start.lock().unwrap().as_ref().map(|(p, s)| {
            (p.iter().map(|t| t.copy()).collect(), s.iter().map(|(n, t)| (n.clone(), t.copy())).collect())
        });
        if let Some((params, _)) = &start {
            tch::no_grad(|| {
                for ((_, mut v), p) in common::model::pytorch_order(&vs).into_iter().zip(params) {
                    v.copy_(p);
                }
            });
        }
        let ddp =
            DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()).bucket_cap_mb(4e-5))
                .unwrap();
        let make = |p: Vec<Tensor>| -> Box<dyn Optimizer + Send> { Box::new(AdamW::new(p, 0.05)) };
        let mut zopt = zero.map(|stage| ShardedOptimizer::new(&ddp, stage, make).unwrap());
        let mut plain = make(vs.trainable_variables());
        if let Some((_, state)) = &start {
            match zopt.as_mut() {
                Some(z) => z.load_consolidated_state_dict(state).unwrap(),
                None => plain.load_state_dict(state).unwrap(),
            }
        }
        for step in steps.clone() {
            let x = batch(step, rank % 2, 0); // the same data on 2 and on 3 ranks' first two
            ddp.backward(&ddp.f_forward(&x).unwrap().pow_tensor_scalar(2).mean(Kind::Float)).unwrap();
            match zopt.as_mut() {
                Some(z) => {
                    z.step().unwrap();
                    z.zero_grad().unwrap();
                }
                None => {
                    plain.step().unwrap();
                    plain.zero_grad().unwrap();
                }
            }
        }
        let state = match &zopt {
            Some(z) => z.consolidated_state_dict().unwrap(),
            None => plain.state_dict(),
        };
        (common::model::params(&vs), state.into_iter().map(|(n, t)| (n, t.copy())).collect::<Named>())
    });
    out.into_iter().next().unwrap()
}

fn same_state(a: &Named, b: &Named, what: &str) {
    let mut ka: Vec<&String> = a.iter().map(|(n, _)| n).collect();
    let mut kb: Vec<&String> = b.iter().map(|(n, _)| n).collect();
    ka.sort();
    kb.sort();
    assert_eq!(ka, kb, "{what}: the same entries");
    for (n, t) in a {
        let u = &b.iter().find(|(m, _)| m == n).unwrap().1;
        assert_eq!(t.size(), u.size(), "{what}: {n}");
        let d = (t.to_kind(Kind::Double) - u.to_kind(Kind::Double)).abs().max().double_value(&[]);
        assert!(d < TOL, "{what}: {n} differs by {d:e}");
    }
}

#[test]
fn consolidated_state_is_the_unsharded_optimizers_and_reshards() {
    // ZeRO-2 on 2 ranks, consolidated, equals plain AdamW's state after the same steps
    let (plain_p, plain_s) = resume(2, None, 0..3, None);
    let (z_p, z_s) = resume(2, Some(ZeroStage::Two), 0..3, None);
    assert!(common::model::max_diff(&plain_p, &z_p) < TOL);
    same_state(&plain_s, &z_s, "ZeRO-2 consolidated vs AdamW");
    // resumed on 3 ranks: as ZeRO-1 from the consolidated state, and as plain AdamW from it, alike
    let copy = |p: &[Tensor], s: &Named| -> (Vec<Tensor>, Named) {
        (p.iter().map(|t| t.copy()).collect(), s.iter().map(|(n, t)| (n.clone(), t.copy())).collect())
    };
    let (a_p, a_s) = resume(3, Some(ZeroStage::One), 3..5, Some(copy(&z_p, &z_s)));
    let (b_p, b_s) = resume(3, None, 3..5, Some((z_p, z_s)));
    let d = common::model::max_diff(&a_p, &b_p);
    assert!(d < TOL, "resharded 2 -> 3 ranks: {d:e}");
    same_state(&a_s, &b_s, "after resharding");
    assert!(
        a_s.iter().any(|(n, t)| n.ends_with(".step") && t.int64_value(&[0]) == 5),
        "steps continue from the saved count"
    );
}

/// ZeRO-2 reduce-scatters DDP's buckets itself: a DDP model with a comm hook is refused by name, and so is
/// a second sharded optimizer (stage 1 or 2) over the same model (one owns its buckets); the model still
/// trains under the first.
#[test]
fn zero2_refuses_a_comm_hook_and_a_second_sharding_by_name() {
    let outs = common::run_threads(2, Duration::from_secs(60), |pg| {
        let pg = Arc::new(pg);
        let make = |p: Vec<Tensor>| Box::new(Sgd::new(p, 0.1)) as Box<dyn Optimizer + Send>;
        let hooked = {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = model(&vs);
            let opts = DdpOptions::default().process_group(pg.clone()).comm_hook(tch_dist::ddp::comm_hook::allreduce());
            let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
            let e = ShardedOptimizer::new(&ddp, ZeroStage::Two, make).unwrap_err().to_string();
            // the refusal changed nothing: stage 1 (which keeps DDP's reduction, hook included) takes it
            ShardedOptimizer::new(&ddp, ZeroStage::One, make).unwrap();
            e
        };
        let vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone())).unwrap();
        let mut first = ShardedOptimizer::new(&ddp, ZeroStage::Two, make).unwrap();
        let second = ShardedOptimizer::new(&ddp, ZeroStage::Two, make).unwrap_err().to_string();
        let third = ShardedOptimizer::new(&ddp, ZeroStage::One, make).unwrap_err().to_string();
        assert!(third.contains("ZeRO-1") && third.contains("another ShardedOptimizer"), "{third}");
        let loss = ddp.forward(&batch(0, pg.rank(), 0)).square().mean(Kind::Float);
        ddp.backward(&loss).unwrap();
        first.step().unwrap();
        (hooked, second)
    });
    for (hooked, second) in outs {
        assert!(hooked.contains("ZeRO-2") && hooked.contains("comm hook"), "{hooked}");
        assert!(second.contains("ZeRO-2") && second.contains("another ShardedOptimizer"), "{second}");
    }
}

/// The plan's ZeRO: a stage its data parallelism cannot give is refused, naming the call that gives it;
/// the model refuses to run before its sharded optimizer exists (it would train as unsharded DDP and say
/// nothing) and refuses a second one; ZeRO-3 is FSDP, not a `ShardedOptimizer`.
#[test]
fn the_plans_zero_refuses_what_it_cannot_give_by_name() {
    let e = Plan::new().zero(ZeroStage::One).unwrap_err().to_string();
    assert!(e.contains("Plan::replicate") && e.contains("ZeRO-1"), "{e}");
    let out = common::run_threads(1, Duration::from_secs(60), |pg| {
        let pg = Arc::new(pg);
        let ddp_opts = || DdpOptions::default().process_group(pg.clone());
        let e = Plan::new().replicate(ddp_opts()).zero(ZeroStage::Three).unwrap_err().to_string();
        assert!(e.contains("Plan::fully_shard"), "{e}");
        let vs = nn::VarStore::new(Device::Cpu);
        let fsdp = || Plan::new().fully_shard(FsdpOptions::default().process_group(pg.clone())).unwrap();
        let e = fsdp().zero(ZeroStage::Two).unwrap_err().to_string();
        assert!(e.contains("Plan::replicate"), "{e}");
        assert!(fsdp().zero(ZeroStage::Three).is_ok(), "stage 3 is what fully_shard does");
        let zero1 = Plan::new().replicate(ddp_opts()).zero(ZeroStage::One).unwrap();
        let e = zero1.clone().fully_shard(FsdpOptions::default()).unwrap_err().to_string();
        assert!(e.contains("ZeRO-1") && e.contains("ZeRO-3"), "{e}");
        assert!(format!("{:?}", zero1.replicate(ddp_opts())).contains("ZeRO-1"), "a new replicate keeps the stage");

        // under ZeRO the optimizer is part of the layout: the model alone is refused, naming the call
        // that builds both
        let plan = Plan::new().replicate(ddp_opts()).zero(ZeroStage::Two).unwrap();
        let alone = nn::VarStore::new(Device::Cpu);
        let e = plan.finish(&alone, model(&alone)).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("build_with_optimizer") && e.contains("ZeRO-2"), "{e}");
        let e = plan.build(&alone, || ()).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("build_with_optimizer"), "{e}");
        let make = |p: Vec<Tensor>| -> Box<dyn Optimizer + Send> { Box::new(Sgd::new(p, 0.1)) };
        let (net, mut opt) = plan.finish_with_optimizer(&vs, model(&vs), make).unwrap();
        assert!(opt.memory().gradient_shards > 0, "ZeRO-2's optimizer holds gradient shards");
        let x = batch(0, 0, 0);
        net.backward(&net.f_forward(&x).unwrap().square().mean(Kind::Float)).unwrap();
        opt.step().unwrap();

        let vs3 = nn::VarStore::new(Device::Cpu);
        let ddp = DistributedDataParallel::new(&vs3, model(&vs3), ddp_opts()).unwrap();
        let e = ShardedOptimizer::new(&ddp, ZeroStage::Three, make).unwrap_err().to_string();
        assert!(e.contains("FSDP"), "{e}");
        // once sharded, the parameters' gradients are not what the optimizer steps: clipping them is refused
        assert!(tch_dist::optim::clip_grad_norm(&ddp.parameters(), 1.0, 2.0).is_ok(), "plain DDP clips its parameters");
        let _opt = ShardedOptimizer::new(&ddp, ZeroStage::One, make).unwrap();
        let e = tch_dist::optim::clip_grad_norm(&ddp.parameters(), 1.0, 2.0).unwrap_err().to_string();
        assert!(e.contains("opt.clip_grad_norm") && e.contains("ZeRO-1"), "{e}");
        let e = ShardedOptimizer::new(&ddp, ZeroStage::One, make).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("another ShardedOptimizer"), "{e}");
        vs.trainable_variables().len()
    });
    assert_eq!(out, vec![5]);
}

/// An inner optimizer whose `fail_at`-th step (from 1) fails.
struct FailsOnce {
    inner: Sgd,
    steps: usize,
    fail_at: Option<usize>,
}

impl Optimizer for FailsOnce {
    fn step(&mut self) -> tch_dist::Result<()> {
        self.steps += 1;
        if self.fail_at == Some(self.steps) {
            return Err(tch_dist::Error::Invalid {
                op: "the test's optimizer".into(),
                msg: "its step failed on purpose".into(),
            });
        }
        self.inner.step()
    }
    fn zero_grad(&mut self) -> tch_dist::Result<()> {
        self.inner.zero_grad()
    }
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.inner.state_dict()
    }
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> tch_dist::Result<()> {
        self.inner.load_state_dict(state)
    }
    fn gradients(&mut self) -> tch_dist::Result<Vec<Tensor>> {
        self.inner.gradients()
    }
    fn memory(&self) -> tch_dist::optim::OptimizerMemory {
        self.inner.memory()
    }
}

/// A shard whose step fails on one rank fails the step on every rank, naming that rank and its message
/// (each rank's shard still goes out with the gathers, so no rank is left waiting), on 3 ranks.
#[test]
fn a_shard_s_failed_step_fails_the_step_on_every_rank() {
    let out = common::run_threads(3, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = model(&vs);
        common::model::init(&vs, rank as f64);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone())).unwrap();
        let make = move |p: Vec<Tensor>| -> Box<dyn Optimizer + Send> {
            Box::new(FailsOnce { inner: Sgd::new(p, 0.1), steps: 0, fail_at: (rank == 1).then_some(2) })
        };
        let mut opt = ShardedOptimizer::new(&ddp, ZeroStage::Two, make).unwrap();
        let mut outcomes = Vec::new();
        for step in 0..2 {
            let out = ddp.f_forward(&batch(step, rank, 0)).unwrap();
            ddp.backward(&out.square().mean(Kind::Float)).unwrap();
            outcomes.push(opt.step());
            opt.zero_grad().unwrap();
        }
        outcomes
    });
    for (rank, mut outcomes) in out.into_iter().enumerate() {
        let failed = outcomes.pop().unwrap().unwrap_err();
        assert!(outcomes.pop().unwrap().is_ok(), "rank {rank}: the first step succeeds everywhere");
        assert!(failed.to_string().contains("its step failed on purpose"), "rank {rank}: {failed}");
        if rank != 1 {
            assert!(matches!(&failed, tch_dist::Error::RankFailed { rank: 1, .. }), "rank {rank}: {failed}");
        }
    }
}
