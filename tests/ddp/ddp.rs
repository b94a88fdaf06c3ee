//! DDP parity: N steps of DDP on 2 and 3 ranks (different data per rank) end with the parameters of a
//! single-process run on the concatenated batch, for bucket views on and off and several bucket caps.
//! Also: overlap of communication with backward, no_sync, unused parameters, comm hooks, mismatches.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::model::{self, batch, init, mlp};
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::{comm_hook, DdpOptions, DistributedDataParallel, ReducerEvent};
use tch_dist::DistModule;
use tch_dist::{CheckPolicy, Error, GroupOptions};

const T: Duration = Duration::from_secs(60);
const STEPS: usize = 4;
const PER: i64 = 5;
const LR: f64 = 0.1;
/// float32 sums in a different order (per-rank partial gradients, then the allreduce): measured
/// differences are ~1e-7; 1e-5 leaves room without hiding a wrong reduction (which shows as 1e-2 and up).
const TOL: f64 = 1e-5;

/// Trains with DDP on `world` thread-ranks; returns rank 0's final parameters and every rank's.
fn train(world: usize, opts: DdpOptions) -> Vec<Vec<Tensor>> {
    common::run_threads(world, T, move |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs);
        init(&vs, rank as f64); // ranks start different: DDP must broadcast rank 0's values
        let ddp = DistributedDataParallel::new(&vs, net, opts.clone().process_group(Arc::new(pg))).unwrap();
        let mut opt = nn::Sgd::default().build(&vs, LR).unwrap();
        for s in 0..STEPS {
            let (x, y) = batch(s, rank, PER);
            let out = ddp.f_forward(&x).unwrap();
            ddp.backward(&model::loss(&out, &y)).unwrap();
            opt.step();
            ddp.zero_grad().unwrap();
        }
        model::params(&vs)
    })
}

fn check_parity(world: usize, opts: DdpOptions) {
    let reference = model::reference(STEPS, world, PER, LR);
    let ranks = train(world, opts.clone());
    for (r, params) in ranks.iter().enumerate() {
        let d = model::max_diff(params, &reference);
        assert!(d < TOL, "rank {r} of {world} with {opts:?}: max |ddp - reference| = {d:e}");
    }
}

/// tch's own optimizers drive DDP with bucket views on (the default): their `zero_grad()` (which calls
/// `detach_()` and sets gradients to none) and `Tensor::zero_grad()` (which zeroes in place) both work,
/// the gradients keep living in the buckets, and training equals the single-process run.
#[test]
fn tch_optimizers_and_their_zero_grad_drive_ddp() {
    fn make(adam: bool, vs: &nn::VarStore) -> nn::Optimizer {
        if adam {
            nn::Adam::default().build(vs, 1e-2).unwrap()
        } else {
            nn::Sgd { momentum: 0.9, ..Default::default() }.build(vs, LR).unwrap()
        }
    }
    for adam in [false, true] {
        let reference = model::reference_with(STEPS, 2, PER, |vs| make(adam, vs));
        let ranks = common::run_threads(2, T, move |pg| {
            let rank = pg.rank();
            let vs = nn::VarStore::new(Device::Cpu);
            let net = mlp(&vs);
            init(&vs, rank as f64);
            let ddp =
                DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(Arc::new(pg))).unwrap();
            let mut opt = make(adam, &vs);
            for s in 0..STEPS {
                let (x, y) = batch(s, rank, PER);
                ddp.backward(&model::loss(&ddp.f_forward(&x).unwrap(), &y)).unwrap();
                let m = ddp.memory_breakdown().unwrap();
                assert_eq!(m.gradients, 0, "step {s}: gradients outside the buckets");
                opt.step();
                if s % 2 == 0 {
                    opt.zero_grad(); // gradients become none
                } else {
                    for mut p in vs.trainable_variables() {
                        p.zero_grad(); // zeroed where they are, in the buckets
                    }
                }
            }
            model::params(&vs)
        });
        for (r, params) in ranks.iter().enumerate() {
            let d = model::max_diff(params, &reference);
            assert!(d < TOL, "rank {r}, {}: max |ddp - reference| = {d:e}", if adam { "Adam" } else { "SGD" });
        }
    }
}

fn caps() -> Vec<(&'static str, DdpOptions)> {
    vec![
        ("one bucket", DdpOptions::default()),
        // every parameter closes its own bucket
        ("many buckets", DdpOptions::default().bucket_cap_mb(1e-6).first_bucket_bytes(1)),
        // 2 KB cap: l2.weight (3,840 B) is larger than a bucket; others share
        ("param larger than cap", DdpOptions::default().bucket_cap_mb(2048.0 / 1048576.0).first_bucket_bytes(2048)),
    ]
}

#[test]
fn parity_2_ranks_views_on() {
    for (_, o) in caps() {
        check_parity(2, o);
    }
}

#[test]
fn parity_2_ranks_views_off() {
    for (_, o) in caps() {
        check_parity(2, o.gradient_as_bucket_view(false));
    }
}

#[test]
fn parity_3_ranks_views_on_and_off() {
    for (_, o) in caps() {
        check_parity(3, o.clone());
        check_parity(3, o.gradient_as_bucket_view(false));
    }
}

#[test]
fn parity_with_find_unused_parameters() {
    check_parity(2, DdpOptions::default().find_unused_parameters(true));
    check_parity(
        3,
        DdpOptions::default().find_unused_parameters(true).bucket_cap_mb(1e-6).gradient_as_bucket_view(false),
    );
}

#[test]
fn buckets_are_rebuilt_from_gradient_order_and_overlap_backward() {
    let res = common::run_threads(2, T, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs);
        let opts = DdpOptions::default().bucket_cap_mb(1e-6).first_bucket_bytes(1).process_group(Arc::new(pg));
        let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
        let first_layout = ddp.bucket_layout();
        for s in 0..2 {
            let (x, y) = batch(s, 0, PER);
            ddp.backward(&model::loss(&ddp.f_forward(&x).unwrap(), &y)).unwrap();
            ddp.zero_grad().unwrap();
        }
        (first_layout, ddp.bucket_layout(), ddp.buckets_rebuilt(), ddp.last_events())
    });
    let (first, rebuilt, did, events) = &res[0];
    // First iteration: one bucket, all parameters in creation order (PyTorch: bucket cap "maxsize").
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(*did);
    // After the rebuild: one bucket per parameter (tiny cap), in the order gradients arrived: last layer first.
    assert_eq!(rebuilt.len(), 6, "{rebuilt:?}");
    assert!(rebuilt[0][0].starts_with("l3"), "{rebuilt:?}");
    assert!(rebuilt[5][0].starts_with("l1"), "{rebuilt:?}");
    // Overlap: the first bucket's allreduce starts before the last gradient is ready.
    let first_launch = events.iter().position(|e| *e == ReducerEvent::BucketLaunched { bucket: 0 }).unwrap();
    let last_ready = events.iter().rposition(|e| matches!(e, ReducerEvent::GradReady { .. })).unwrap();
    assert!(first_launch < last_ready, "no overlap: {events:?}");
    // Buckets launch strictly in order.
    let launches: Vec<usize> = events
        .iter()
        .filter_map(|e| if let ReducerEvent::BucketLaunched { bucket } = e { Some(*bucket) } else { None })
        .collect();
    assert_eq!(launches, (0..6).collect::<Vec<_>>());
    assert_eq!(res[0].1, res[1].1, "ranks must agree on the rebuilt buckets");
}

#[test]
fn no_sync_accumulates_then_one_synced_step_matches_reference() {
    // Two micro-batches under no_sync, one synced: the reduced gradient is the sum of the three mean losses.
    let world = 2;
    let reference = {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs);
        init(&vs, 0.0);
        let mut opt = nn::Sgd::default().build(&vs, LR).unwrap();
        opt.zero_grad();
        for s in 0..3 {
            let (x, y) = model::global_batch(s, world, PER);
            model::loss(&net.forward(&x), &y).backward();
        }
        opt.step();
        model::params(&vs)
    };
    for view in [true, false] {
        let ranks = common::run_threads(world, T, move |pg| {
            let rank = pg.rank();
            let vs = nn::VarStore::new(Device::Cpu);
            let net = mlp(&vs);
            init(&vs, 0.0);
            let opts = DdpOptions::default().gradient_as_bucket_view(view).process_group(Arc::new(pg));
            let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
            let mut opt = nn::Sgd::default().build(&vs, LR).unwrap();
            ddp.no_sync(|d| {
                for s in 0..2 {
                    let (x, y) = batch(s, rank, PER);
                    d.backward(&model::loss(&d.f_forward(&x).unwrap(), &y)).unwrap();
                }
            });
            let (x, y) = batch(2, rank, PER);
            ddp.backward(&model::loss(&ddp.f_forward(&x).unwrap(), &y)).unwrap();
            opt.step();
            model::params(&vs)
        });
        for p in &ranks {
            let d = model::max_diff(p, &reference);
            assert!(d < TOL, "no_sync (views {view}): {d:e}");
        }
    }
}

/// l1 feeds the output; `extra` only where `use_extra`.
#[derive(Debug)]
struct Branchy {
    l1: nn::Linear,
    extra: nn::Linear,
    use_extra: bool,
}
impl Module for Branchy {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.l1.forward(x);
        if self.use_extra {
            h.shallow_clone() + self.extra.forward(x)
        } else {
            h
        }
    }
}

#[test]
fn unused_parameters_are_reduced_as_zeros_without_hanging() {
    // rank 0 uses `extra`, rank 1 does not: extra's gradient is rank 0's / 2; a parameter nobody uses
    // keeps no gradient.
    let res = common::run_threads(2, T, |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let l1 = nn::linear(vs.root() / "l1", 3, 2, Default::default());
        let extra = nn::linear(vs.root() / "extra", 3, 2, Default::default());
        let _never = vs.root().zeros("never_used", &[4]).set_requires_grad(true);
        init(&vs, 0.0);
        let net = Branchy { l1, extra, use_extra: rank == 0 };
        let opts = DdpOptions::default().find_unused_parameters(true).process_group(Arc::new(pg));
        let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
        let x = Tensor::ones([1, 3], (Kind::Float, Device::Cpu));
        ddp.backward(&ddp.f_forward(&x).unwrap().sum(Kind::Float)).unwrap();
        let extra_w = ddp.module().extra.ws.grad();
        let never = vs.variables()["never_used"].grad();
        (Vec::<f32>::try_from(extra_w.flatten(0, -1)).unwrap(), never.defined())
    });
    for (g, never_defined) in &res {
        // d(sum)/d(extra.weight) = 1 for each element on rank 0, nothing on rank 1: averaged 0.5
        assert!(g.iter().all(|&v| (v - 0.5).abs() < 1e-6), "{g:?}");
        assert!(!never_defined);
    }
}

#[test]
fn unused_parameters_without_find_unused_is_a_clear_error() {
    let res = common::run_threads(2, Duration::from_secs(5), |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let l1 = nn::linear(vs.root() / "l1", 3, 2, Default::default());
        let extra = nn::linear(vs.root() / "extra", 3, 2, Default::default());
        let net = Branchy { l1, extra, use_extra: false };
        let opts = DdpOptions::default().process_group(Arc::new(pg));
        let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
        let x = Tensor::ones([1, 3], (Kind::Float, Device::Cpu));
        ddp.backward(&ddp.f_forward(&x).unwrap().sum(Kind::Float)).unwrap_err().to_string()
    });
    for e in res {
        assert!(e.contains("extra.weight") && e.contains("find_unused_parameters"), "{e}");
    }
}

#[test]
fn compression_hooks_stay_close_to_fp32() {
    let reference = model::reference(STEPS, 2, PER, LR);
    // the allreduce hook is DDP's own reduction, expressed as a hook: same result
    let ranks = train(2, DdpOptions::default().comm_hook(comm_hook::allreduce()));
    assert!(model::max_diff(&ranks[0], &reference) < TOL);
    for (name, hook) in [("fp16", comm_hook::fp16_compress()), ("bf16", comm_hook::bf16_compress())] {
        let ranks = train(2, DdpOptions::default().comm_hook(hook));
        let d = model::max_diff(&ranks[0], &reference);
        // bf16 keeps 8 bits of mantissa: gradients are off by ~0.4% relative, parameters by ~1e-3 here.
        assert!(d < 1e-2, "{name}: {d:e}");
        assert!(d > 0.0, "{name} should differ from fp32 at all");
        assert!(model::max_diff(&ranks[0], &ranks[1]) == 0.0, "ranks must agree exactly");
    }
}

#[test]
fn mismatched_models_fail_at_construction_naming_the_parameter() {
    let res = common::run_threads(2, T, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let hidden = if pg.rank() == 0 { 8 } else { 9 };
        let net = nn::linear(vs.root() / "fc", 4, hidden, Default::default());
        let opts = DdpOptions::default().process_group(Arc::new(pg));
        DistributedDataParallel::new(&vs, net, opts).expect_err("must fail")
    });
    for e in res {
        assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
        let s = e.to_string();
        assert!(s.contains("fc.bias") || s.contains("fc.weight"), "{s}");
        assert!(s.contains("rank 0") && s.contains("rank 1"), "{s}");
    }
}

#[test]
fn different_parameter_counts_fail_at_construction() {
    let res = common::run_threads(2, T, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root() / "fc", 4, 4, nn::LinearConfig { bias: pg.rank() == 0, ..Default::default() });
        let opts = DdpOptions::default().process_group(Arc::new(pg));
        DistributedDataParallel::new(&vs, net, opts).expect_err("must fail").to_string()
    });
    for e in res {
        assert!(e.contains("rank 0 has 2 parameters but rank 1 has 1"), "{e}");
    }
}

#[test]
fn memory_breakdown_shows_where_ddp_memory_goes() {
    let res = common::run_threads(2, T, |pg| {
        let pg = Arc::new(pg);
        let mut out = Vec::new();
        for view in [false, true] {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = nn::linear(vs.root(), 100, 100, Default::default());
            let opts = DdpOptions::default().gradient_as_bucket_view(view).process_group(pg.clone());
            let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
            let x = Tensor::ones([2, 100], (Kind::Float, Device::Cpu));
            ddp.backward(&ddp.f_forward(&x).unwrap().sum(Kind::Float)).unwrap();
            out.push(ddp.memory_breakdown().unwrap());
        }
        out
    });
    let bytes = (100 * 100 + 100) * 4;
    let (off, on) = (res[0][0], res[0][1]);
    assert_eq!((off.parameters, off.gradients, off.buckets), (bytes, bytes, bytes));
    assert_eq!((on.parameters, on.gradients, on.buckets), (bytes, 0, bytes));
}

#[test]
fn buffers_follow_rank_0_at_construction_and_every_forward() {
    let res = common::run_threads(3, T, |pg| {
        let rank = pg.rank() as f64;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root() / "fc", 2, 2, Default::default());
        let mut stat = vs.root().zeros_no_train("running_mean", &[3]);
        let _ = stat.fill_(rank + 1.0);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let after_construction = Vec::<f32>::try_from(&stat).unwrap();
        // each rank's forward updates its statistics differently, as BatchNorm would
        let _ = stat.fill_(10.0 * (rank + 1.0));
        let _ = ddp.f_forward(&Tensor::ones([1, 2], (Kind::Float, Device::Cpu))).unwrap();
        (after_construction, Vec::<f32>::try_from(&stat).unwrap())
    });
    for (built, fwd) in res {
        assert_eq!(built, vec![1.0; 3]);
        assert_eq!(fwd, vec![10.0; 3]);
    }
}

#[test]
fn an_extra_backward_on_one_rank_is_reported_not_silently_mixed() {
    // Rank 0 also runs the bare module and backpropagates through it (a second backward for one DDP
    // forward). Unchecked, its bucket allreduces would pair with rank 1's next collectives. (Gloo checks
    // every loop, whatever TCH_DIST_VERIFY asks; NCCL's policy checks the first only.)
    let opts = GroupOptions { checks: CheckPolicy::OnceOnNccl, ..common::gloo_opts(Duration::from_secs(20)) };
    let res = common::run_threads_with(2, opts, |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(Arc::new(pg))).unwrap();
        let mut first_error = None;
        for s in 0..3 {
            let (x, y) = batch(s, rank, PER);
            let mut r = ddp.f_forward(&x).and_then(|out| ddp.backward(&model::loss(&out, &y)));
            if rank == 0 && s == 0 && r.is_ok() {
                r = ddp.backward(&model::loss(&ddp.module().forward(&x), &y));
            }
            if let Err(e) = r {
                first_error = Some(e.to_string());
                break;
            }
            ddp.zero_grad().unwrap();
        }
        first_error
    });
    for e in res {
        let e = e.expect("both ranks must see the disagreement");
        assert!(e.contains("ranks disagree on the training loop"), "{e}");
        assert!(e.contains("rank 0 is starting DDP backward with 1 forwards and 1 backwards done"), "{e}");
        // the error crossed autograd once, and says where it happened once
        for prefix in ["DDP backward on rank", "DDP forward on rank"] {
            assert!(e.matches(prefix).count() <= 1, "{e}");
        }
    }
}

/// DDP over a Module is a Module (and a ModuleT): it goes where tch expects one, and prints.
#[test]
fn ddp_is_a_tch_module() {
    let res = common::run_threads(2, T, |pg| {
        let rank = pg.rank();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs);
        let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(Arc::new(pg))).unwrap();
        fn through_tch(m: &dyn nn::ModuleT, x: &Tensor) -> Tensor {
            m.forward_t(x, true)
        }
        let (x, y) = batch(0, rank, PER);
        let out = through_tch(&ddp, &x);
        ddp.backward(&model::loss(&out, &y)).unwrap();
        let m: &dyn nn::Module = &ddp;
        let again = m.forward(&x);
        ddp.backward(&model::loss(&again, &y)).unwrap();
        let third = ddp.f_forward_t(&x, false).unwrap();
        ddp.backward(&model::loss(&third, &y)).unwrap();
        format!("{ddp:?}")
    });
    for dbg in res {
        assert!(dbg.starts_with("DistributedDataParallel {") && dbg.contains("parameters: 6"), "{dbg}");
    }
}

/// A comm hook that panics does not abort the process: the panic is that backward's error, on every rank.
#[test]
fn a_panicking_comm_hook_is_the_backwards_error() {
    #[derive(Debug)]
    struct Panics;
    impl comm_hook::CommHook for Panics {
        fn run(
            &self,
            _: &Arc<tch_dist::ProcessGroup>,
            _: &comm_hook::GradBucket,
        ) -> tch_dist::Result<comm_hook::HookFuture> {
            panic!("boom in a comm hook")
        }
    }
    let res = common::run_threads(2, T, |pg| {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs);
        let opts = DdpOptions::default().comm_hook(Arc::new(Panics)).process_group(Arc::new(pg));
        let ddp = DistributedDataParallel::new(&vs, net, opts).unwrap();
        let (x, y) = batch(0, 0, PER);
        ddp.backward(&model::loss(&ddp.f_forward(&x).unwrap(), &y)).unwrap_err().to_string()
    });
    for e in res {
        assert!(e.contains("comm hook on bucket 0") && e.contains("panicked: boom in a comm hook"), "{e}");
    }
}
