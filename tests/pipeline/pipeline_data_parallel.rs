//! Pipeline stages that are data-parallel (pp 2 × dp 2, four ranks): each stage's DDP or FSDP, chosen by
//! the plan in `PipelineConfig::plan` (by hand, or from the degrees with tensor parallelism too), reduces its gradients during the last microbatch's backward only
//! (counted in the flight recorder), and the losses of every step equal the unsplit model's on the full
//! batch; with GPipe, 1F1B and interleaved 1F1B (two chunks per rank), FSDP with units of small
//! parameters (gathered again for each microbatch's backward), and with tch's own SGD built over each
//! stage's VarStore (which under FSDP steps the shards). A step under `no_sync` reduces nothing, and the
//! next one reduces both steps' sum. FSDP keeps the units a backward gathered for the step's next
//! microbatches: without resharding after forward, a step gathers as much with 4 microbatches as with 2.
use crate::common;

use std::time::Duration;

use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::DdpOptions;
use tch_dist::fsdp::FsdpOptions;
use tch_dist::mesh::DeviceMesh;
use tch_dist::parallel_dims::ParallelDims;
use tch_dist::parallelize::{Plan, Style};
use tch_dist::pipeline::schedule::ScheduleKind;
use tch_dist::pipeline::{LayerList, Partition, PipelineConfig, PipelineRank};
use tch_dist::ReduceOp;

const STEPS: usize = 4;
const BATCH: i64 = 8;
const LR: f64 = 0.1;
/// float32 sums in another order: observed ~1e-8.
const TOL: f64 = 1e-6;

/// A linear layer with values set by its shape (the threads share tch's generator, so nothing here may
/// depend on it).
fn linear(i: i64, o: i64) -> impl Fn(&nn::Path) -> nn::Linear + Send + Sync {
    move |p| {
        let l = nn::linear(p, i, o, Default::default());
        tch::no_grad(|| {
            let mut w = l.ws.shallow_clone();
            let n = w.numel() as i64;
            w.copy_(&((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + o as f64).sin() * 0.3).view([o, i]));
            if let Some(b) = &l.bs {
                b.shallow_clone().copy_(&(Tensor::arange(o, (Kind::Float, Device::Cpu)) * 0.11 - i as f64).cos());
            }
        });
        l
    }
}

/// A linear layer whose output is scaled by a gain per feature: the gain (16 elements, small beside the
/// weight) is read by backward, so it must be gathered for every microbatch's backward under FSDP.
#[derive(Debug)]
struct Scaled {
    lin: nn::Linear,
    gain: Tensor,
}

impl nn::Module for Scaled {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.lin.forward(xs) * &self.gain
    }
}

fn scaled(i: i64, o: i64) -> impl Fn(&nn::Path) -> Scaled + Send + Sync {
    let lin = linear(i, o);
    move |p| {
        let gain = p.var("gain", &[o], nn::Init::Const(0.0));
        tch::no_grad(|| {
            gain.shallow_clone().copy_(&((Tensor::arange(o, (Kind::Float, Device::Cpu)) * 0.2).cos() + 0.5))
        });
        Scaled { lin: lin(p), gain }
    }
}

fn layers() -> LayerList {
    LayerList::new()
        .add("l0", linear(6, 16))
        .add_fn("a0", |x| x.tanh())
        .add("l1", scaled(16, 16))
        .add_fn("a1", |x| x.tanh())
        .add("l2", linear(16, 12))
        .add("l3", linear(12, 3))
}

fn data(step: usize) -> (Tensor, Tensor) {
    let rows = Tensor::arange(BATCH, (Kind::Float, Device::Cpu)).unsqueeze(1) + (step as f64) * 100.0;
    let x = (&rows * 0.21 + Tensor::arange(6, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.4).sin();
    let y = (&rows * 0.07 - Tensor::arange(3, (Kind::Float, Device::Cpu)).unsqueeze(0)).cos();
    (x, y)
}

fn loss(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

/// The unsplit model on the full batch: the loss of each step.
fn reference() -> Vec<f64> {
    reference_of(layers)
}

/// [`reference`] of another layer list.
fn reference_of(layers: fn() -> LayerList) -> Vec<f64> {
    let l = layers();
    let stage = l.build_stage(0..l.len(), Device::Cpu).unwrap();
    let mut opt = nn::Sgd::default().build(&stage.vs, LR).unwrap();
    (0..STEPS)
        .map(|s| {
            let (x, y) = data(s);
            opt.zero_grad();
            let lo = loss(&stage.forward(&x), &y);
            lo.backward();
            opt.step();
            lo.double_value(&[])
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Dp {
    Ddp,
    Fsdp,
    /// FSDP with the biases and the gain (16 and 12 elements) in units of small parameters
    FsdpSmall,
}

/// DDP bucket reductions (each rank's allreduce) recorded after the recorder's entry `after`.
fn ddp_reductions(after: u64) -> usize {
    let bucket = |e: &tch_dist::flight::Entry| e.label.starts_with("DDP bucket") && e.op.starts_with("allreduce");
    tch_dist::flight::entries().iter().filter(|e| e.id > after && bucket(e)).count()
}

fn last_entry() -> u64 {
    tch_dist::flight::entries().last().map_or(0, |e| e.id)
}

/// pp 2 × dp 2 on threads: the losses the last stage reports, averaged over dp (rank 0's view).
fn train(dp_kind: Dp, schedule: ScheduleKind, chunks: usize, sizes: &'static [usize]) -> Vec<f64> {
    let outs = common::run_threads(4, Duration::from_secs(60), move |world| {
        let mesh = DeviceMesh::new(&world, &[("pp", 2), ("dp", 2)]).unwrap();
        let (pp, dp) = (mesh.group("pp").unwrap(), mesh.group("dp").unwrap());
        let plan = match dp_kind {
            Dp::Ddp => Plan::new().replicate(DdpOptions::default().process_group(dp.clone())),
            Dp::Fsdp => Plan::new().fully_shard(FsdpOptions::default().mesh(&mesh, &["dp"]).unwrap()).unwrap(),
            Dp::FsdpSmall => {
                let opts = FsdpOptions::default().mesh(&mesh, &["dp"]).unwrap().gather_once_below(100);
                Plan::new().fully_shard(opts).unwrap()
            }
        };
        let l = layers();
        let part = Partition::sizes(sizes, l.len()).unwrap();
        let cfg = PipelineConfig { schedule, microbatches: 2, chunks, plan, ..Default::default() };
        let mut stage = PipelineRank::build(pp, &l, &part, cfg).unwrap();
        let mut opts: Vec<_> = stage.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, LR).unwrap()).collect();
        let half = BATCH / 2;
        let first = mesh.coordinate("dp").unwrap() as i64 * half;
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (x, y) = data(s);
            let r = stage.step(&x.narrow(0, first, half), &y.narrow(0, first, half), &loss).unwrap();
            opts.iter_mut().for_each(|o| o.step());
            stage.zero_grad().unwrap();
            if let Some(l) = r.loss {
                let mut t = l.reshape([1]);
                dp.allreduce(&mut t, ReduceOp::Sum).unwrap();
                losses.push(t.double_value(&[0]) / 2.0);
            }
        }
        losses
    });
    let reported: Vec<&Vec<f64>> = outs.iter().filter(|l| !l.is_empty()).collect();
    assert_eq!(reported.len(), 2, "the two ranks of the last stage report");
    assert_eq!(reported[0], reported[1]);
    reported[0].clone()
}

/// The only test of this file with DDP: the reductions it counts are its own.
#[test]
fn ddp_and_fsdp_stages_train_as_the_unsplit_model() {
    let want = reference();
    for dp in [Dp::Ddp, Dp::Fsdp, Dp::FsdpSmall] {
        for (schedule, chunks, sizes) in [
            (ScheduleKind::GPipe, 1, &[3, 3][..]),
            (ScheduleKind::OneFOneB, 1, &[3, 3][..]),
            (ScheduleKind::Interleaved1F1B, 2, &[2, 2, 1, 1][..]),
        ] {
            let before = last_entry();
            let got = train(dp, schedule, chunks, sizes);
            assert_eq!(got.len(), STEPS);
            for (s, (a, b)) in want.iter().zip(&got).enumerate() {
                assert!((a - b).abs() < TOL, "{dp:?} {schedule:?}: step {s}: unsplit {a}, pipeline {b}");
            }
            if let Dp::Ddp = dp {
                // one bucket per chunk, on each of the 4 ranks, once per step (not once per microbatch)
                assert_eq!(ddp_reductions(before), STEPS * 4 * chunks, "{schedule:?}");
            }
        }
    }
    accumulating_over_steps_under_no_sync();
}

/// Two steps, the first under `no_sync` (no reduction), then one optimizer step: the unsplit model with
/// both batches' gradients summed.
fn accumulating_over_steps_under_no_sync() {
    let l = layers();
    let stage = l.build_stage(0..l.len(), Device::Cpu).unwrap();
    let mut opt = nn::Sgd::default().build(&stage.vs, LR).unwrap();
    for s in 0..2 {
        let (x, y) = data(s);
        loss(&stage.forward(&x), &y).backward();
    }
    opt.step();
    let after = {
        let (x, y) = data(2);
        loss(&stage.forward(&x), &y).double_value(&[])
    };
    let before = last_entry();
    let got = common::run_threads(4, Duration::from_secs(60), move |world| {
        let mesh = DeviceMesh::new(&world, &[("pp", 2), ("dp", 2)]).unwrap();
        let dp = mesh.group("dp").unwrap();
        let plan = Plan::new().replicate(DdpOptions::default().process_group(dp.clone()));
        let l = layers();
        let cfg = PipelineConfig { microbatches: 2, plan, ..Default::default() };
        let mut stage =
            PipelineRank::build(mesh.group("pp").unwrap(), &l, &Partition::sizes(&[3, 3], 6).unwrap(), cfg).unwrap();
        let mut opts: Vec<_> = stage.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, LR).unwrap()).collect();
        let first = mesh.coordinate("dp").unwrap() as i64 * (BATCH / 2);
        let rows = |s| {
            let (x, y) = data(s);
            (x.narrow(0, first, BATCH / 2), y.narrow(0, first, BATCH / 2))
        };
        let (x, y) = rows(0);
        stage.set_requires_gradient_sync(false);
        stage.step(&x, &y, &loss).unwrap();
        stage.set_requires_gradient_sync(true);
        // every rank is done with the quiet step, and none has begun the next
        world.barrier().unwrap();
        let quiet = ddp_reductions(before);
        world.barrier().unwrap();
        let (x, y) = rows(1);
        stage.step(&x, &y, &loss).unwrap();
        opts.iter_mut().for_each(|o| o.step());
        stage.zero_grad().unwrap();
        let (x, y) = rows(2);
        let l = stage.step(&x, &y, &loss).unwrap().loss.map(|l| {
            let mut t = l.reshape([1]);
            dp.allreduce(&mut t, ReduceOp::Sum).unwrap();
            t.double_value(&[0]) / 2.0
        });
        (quiet, l)
    });
    // a rank counts every rank's reductions so far: none while the first step ran under no_sync
    let quiet: Vec<usize> = got.iter().map(|g| g.0).collect();
    assert!(quiet.iter().all(|&q| q == 0), "reductions during the no_sync step: {quiet:?}");
    let losses: Vec<f64> = got.iter().filter_map(|g| g.1).collect();
    assert_eq!(losses.len(), 2);
    for l in losses {
        // the summed (not averaged over steps) gradient: the unsplit model's sum over both batches
        assert!((l - after).abs() < TOL, "after two accumulated steps: unsplit {after}, pipeline {l}");
    }
}

/// Without the stages' data parallelism the replicas drift apart from the unsplit model (the test
/// above could not pass by chance).
#[test]
fn without_data_parallelism_the_replicas_differ() {
    let outs = common::run_threads(4, Duration::from_secs(60), |world| {
        let mesh = DeviceMesh::new(&world, &[("pp", 2), ("dp", 2)]).unwrap();
        let l = layers();
        let part = Partition::sizes(&[3, 3], l.len()).unwrap();
        let cfg = PipelineConfig { microbatches: 2, ..Default::default() };
        let mut stage = PipelineRank::build(mesh.group("pp").unwrap(), &l, &part, cfg).unwrap();
        let mut opts: Vec<_> = stage.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, LR).unwrap()).collect();
        let first = mesh.coordinate("dp").unwrap() as i64 * (BATCH / 2);
        let mut last = None;
        for s in 0..STEPS {
            let (x, y) = data(s);
            last = stage
                .step(&x.narrow(0, first, BATCH / 2), &y.narrow(0, first, BATCH / 2), &loss)
                .unwrap()
                .loss
                .map(|l| l.double_value(&[]));
            opts.iter_mut().for_each(|o| o.step());
            stage.zero_grad().unwrap();
        }
        last
    });
    let finals: Vec<f64> = outs.into_iter().flatten().collect();
    assert_eq!(finals.len(), 2);
    assert!((finals[0] - finals[1]).abs() > 1e-4, "replicas trained on different rows: {finals:?}");
}

/// FSDP stages with `reshard_after_forward(false)` (torchtitan's setting under pipelining): the units
/// one microbatch gathered serve the next, in forward and backward, so the gathers of a step (counted in
/// the flight recorder on the stages' data-parallel groups) do not grow with the microbatches; the
/// losses still equal the unsplit model's.
#[test]
fn fsdp_stages_keep_their_units_gathered_through_a_step() {
    let want = reference();
    for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let gathers: Vec<usize> = [2usize, 4].into_iter().map(|m| step_gathers(schedule, m, &want)).collect();
        assert!(gathers[0] > 0, "{schedule:?}: no gather was recorded");
        assert_eq!(gathers[0], gathers[1], "{schedule:?}: gathers with 2 and 4 microbatches");
    }
}

/// The parameters' gathers on the stages' data-parallel groups over `STEPS` steps of `microbatches`,
/// checking the losses on the way. The recorder keeps its last entries only: a run whose first entry
/// was dropped before it was counted (other tests record too) runs again.
fn step_gathers(schedule: ScheduleKind, microbatches: usize, want: &[f64]) -> usize {
    for _ in 0..5 {
        let outs = common::run_threads(4, Duration::from_secs(60), move |world| {
            // a dimension name of its own: its groups' entries are this test's
            let mesh = DeviceMesh::new(&world, &[("pp", 2), ("keep", 2)]).unwrap();
            let opts = FsdpOptions::default().mesh(&mesh, &["keep"]).unwrap().reshard_after_forward(false);
            let l = layers();
            let part = Partition::sizes(&[3, 3], l.len()).unwrap();
            let plan = Plan::new().fully_shard(opts).unwrap();
            let cfg = PipelineConfig { schedule, microbatches, plan, ..Default::default() };
            let mut stage = PipelineRank::build(mesh.group("pp").unwrap(), &l, &part, cfg).unwrap();
            let mut opts: Vec<_> =
                stage.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, LR).unwrap()).collect();
            let first = mesh.coordinate("keep").unwrap() as i64 * (BATCH / 2);
            let dp = mesh.group("keep").unwrap();
            let mut losses = Vec::new();
            // no rank gathers before every rank has read this
            let start = last_entry();
            world.barrier().unwrap();
            for s in 0..STEPS {
                let (x, y) = data(s);
                let r = stage.step(&x.narrow(0, first, BATCH / 2), &y.narrow(0, first, BATCH / 2), &loss);
                opts.iter_mut().for_each(|o| o.step());
                stage.zero_grad().unwrap();
                if let Some(l) = r.unwrap().loss {
                    let mut t = l.reshape([1]);
                    dp.allreduce(&mut t, ReduceOp::Sum).unwrap();
                    losses.push(t.double_value(&[0]) / 2.0);
                }
            }
            (start, losses)
        });
        for (a, b) in outs.iter().flat_map(|o| want.iter().zip(&o.1)) {
            assert!((a - b).abs() < TOL, "{schedule:?}, {microbatches} microbatches: unsplit {a}, pipeline {b}");
        }
        assert_eq!(outs.iter().filter(|o| !o.1.is_empty()).count(), 2, "the last stage reports");
        let start = outs.iter().map(|o| o.0).min().unwrap_or(0);
        let entries = tch_dist::flight::entries();
        if entries.first().is_some_and(|e| e.id > start + 1) {
            continue;
        }
        // the parameters' gathers (the strict mode's loop checks gather too, once per microbatch)
        return entries
            .iter()
            .filter(|e| e.id > start && e.group.contains("keep") && e.label.starts_with("FSDP all-gather"))
            .count();
    }
    panic!("the flight recorder dropped this test's entries in each of 5 runs");
}

/// Layers split by the plan when it has a tensor-parallel group (`tch_dist::nn::linear`: the column-wise
/// `l0` and the row-wise `l1` after it, each rank's slice of what the list's seed draws), tch's otherwise.
fn tp_layers() -> LayerList {
    let split = |i, o| move |p: &nn::Path| tch_dist::nn::linear(p, i, o, Default::default());
    LayerList::new()
        .seed(11)
        .add("l0", split(6, 16))
        .add_fn("a0", |x| x.tanh())
        .add("l1", split(16, 12))
        .add("l2", |p| nn::linear(p, 12, 12, Default::default()))
        .add_fn("a2", |x| x.tanh())
        .add("l3", |p| nn::linear(p, 12, 3, Default::default()))
}

/// A block as model code written for `Plan::build` makes it: its layer through `tch_dist::nn::unit`,
/// which a pipeline chunk leaves local (the chunk shards each layer itself).
#[derive(Debug)]
struct Block(tch_dist::parallelize::Unit<nn::Linear>);

impl nn::Module for Block {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.0.forward(xs)
    }
}

/// [`layers`], `l0` built as a [`Block`].
fn unit_layers() -> LayerList {
    let lin = linear(6, 16);
    LayerList::new()
        .add("l0", move |p| Block(tch_dist::nn::unit(p, lin(p))))
        .add_fn("a0", |x| x.tanh())
        .add("l1", scaled(16, 16))
        .add_fn("a1", |x| x.tanh())
        .add("l2", linear(16, 12))
        .add("l3", linear(12, 3))
}

/// pp 2 with the other degrees `dims` on 4 threads, each stage built through the plan the degrees give
/// (`ParallelMesh::plan`, its styles for `tp_layers`): the losses the last stage's ranks report, each
/// reading its rows of the batch (`rows`) and averaging over the loss group (`average_loss`); and the
/// shapes of `l0.weight` on the ranks that hold it.
fn train_dims(dims: ParallelDims, layers: fn() -> LayerList) -> (Vec<f64>, Vec<Vec<i64>>) {
    let outs = common::run_threads(4, Duration::from_secs(60), move |world| {
        let mesh = dims.build(&world).unwrap();
        let plan = mesh.plan().style("l0", Style::colwise()).style("l1", Style::rowwise()).allow_unmatched_styles();
        let l = layers();
        let part = Partition::sizes(&[3, 3], l.len()).unwrap();
        let cfg = PipelineConfig { microbatches: 2, plan, ..Default::default() };
        let mut stage = PipelineRank::build(mesh.pp_group().clone(), &l, &part, cfg).unwrap();
        let l0 = stage.var_stores()[0].variables().get("l0.weight").map(|t| t.size());
        let mut opts: Vec<_> = stage.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, LR).unwrap()).collect();
        let rows = mesh.rows(BATCH).unwrap();
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (x, y) = data(s);
            let (x, y) =
                (x.narrow(0, rows.start, rows.end - rows.start), y.narrow(0, rows.start, rows.end - rows.start));
            let r = stage.step(&x, &y, &loss).unwrap();
            opts.iter_mut().for_each(|o| o.step());
            stage.zero_grad().unwrap();
            if let Some(l) = r.loss {
                losses.push(mesh.average_loss(&l).unwrap().double_value(&[]));
            }
        }
        (losses, l0)
    });
    let reported: Vec<&Vec<f64>> = outs.iter().map(|o| &o.0).filter(|l| !l.is_empty()).collect();
    assert_eq!(reported.len(), 2, "the two ranks of the last stage report");
    assert_eq!(reported[0], reported[1]);
    (reported[0].clone(), outs.into_iter().filter_map(|o| o.1).collect())
}

/// One plan for a pipeline: the degrees choose each stage's DDP, FSDP or tensor parallelism, and every
/// layout trains as the unsplit model. A plan with ZeRO-1/2, or a parallel plan given to the in-process
/// `Pipeline`, is refused by name.
#[test]
fn the_degrees_plan_every_stage() {
    let (want, want_tp) = (reference(), reference_of(tp_layers));
    // l0.weight is [16, 6]: whole under DDP, freed between steps under FSDP (its shards apart), 8 rows
    // under TP
    for (name, dims, layers, want, l0) in [
        (
            "DDP",
            ParallelDims { pp: 2, dp_replicate: 2, ..Default::default() },
            layers as fn() -> LayerList,
            &want,
            &[16, 6][..],
        ),
        ("FSDP", ParallelDims { pp: 2, dp_shard: 2, ..Default::default() }, layers, &want, &[0][..]),
        ("TP", ParallelDims { pp: 2, tp: 2, ..Default::default() }, tp_layers, &want_tp, &[8, 6][..]),
        (
            "FSDP, a unit in the builder",
            ParallelDims { pp: 2, dp_shard: 2, ..Default::default() },
            unit_layers,
            &want,
            &[0][..],
        ),
    ] {
        let (got, shapes) = train_dims(dims, layers);
        assert_eq!(shapes.len(), 2, "{name}: the first stage's two ranks hold l0");
        assert!(shapes.iter().all(|s| s == l0), "{name}: l0.weight {shapes:?}, not {l0:?}");
        assert_eq!(got.len(), STEPS);
        for (s, (a, b)) in want.iter().zip(&got).enumerate() {
            assert!((a - b).abs() < TOL, "{name}: step {s}: unsplit {a}, pipeline {b}");
        }
    }
    let refused = common::run_threads(2, Duration::from_secs(30), |world| {
        let world = std::sync::Arc::new(world);
        let zero = Plan::new()
            .replicate(DdpOptions::default().process_group(world.clone()))
            .zero(tch_dist::zero::ZeroStage::One)
            .unwrap();
        let cfg = PipelineConfig { microbatches: 2, plan: zero, ..Default::default() };
        let l = layers();
        let rank = PipelineRank::build(world.clone(), &l, &Partition::sizes(&[3, 3], 6).unwrap(), cfg);
        let threads = PipelineConfig { microbatches: 2, plan: Plan::over_group(world), ..Default::default() };
        let cpu = [Device::Cpu, Device::Cpu];
        let local = tch_dist::pipeline::Pipeline::new(&l, &Partition::sizes(&[3, 3], 6).unwrap(), &cpu, threads);
        (rank.map(|_| ()).unwrap_err().to_string(), local.map(|_| ()).unwrap_err().to_string())
    });
    for (rank, local) in refused {
        assert!(rank.contains("ZeRO-1") && rank.contains("FSDP"), "{rank}");
        assert!(local.contains("PipelineRank"), "{local}");
    }
}
