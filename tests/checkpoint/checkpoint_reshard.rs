//! Sharded checkpoints across layouts: a run saves in one layout, another layout loads it and goes on
//! training, and the result is compared with a single process that never stopped. Right after loading,
//! the state saved again in the new layout must be bit-identical to what was saved in the old one
//! (resharding only moves bytes); at the end, within 1e-6 of the uninterrupted run (data-parallel ranks
//! average gradients in another order than one process summing the whole batch: seen ~1e-8).
use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::checkpoint::{self, Checkpointer, StateDict};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions, FullyShardedDataParallel};
use tch_dist::mesh::DeviceMesh;
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::pipeline::schedule::ScheduleKind;
use tch_dist::pipeline::{Partition, PipelineConfig, PipelineRank};
use tch_dist::tp::ParallelMlp;
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;
use tch_dist::{ProcessGroup, ReduceOp};

const D: i64 = 4;
const H: i64 = 8;
const BATCH: i64 = 12;
const LR: f64 = 0.05;
const TOL: f64 = 1e-6;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    /// one process, or every rank whole without averaging (the reference)
    Plain,
    Ddp,
    Zero2,
    Zero3,
    /// tensor parallel over `tp`, data parallel over the rest
    TpDp(usize),
    /// a two-stage pipeline of the deep MLP (pipeline data)
    Pipe,
    /// the deep MLP unsplit (pipeline data)
    PipePlain,
    /// one process with tch's own `nn::AdamW` (libtorch's C++ optimizer)
    TchPlain,
    /// ZeRO-3 with tch's own `nn::AdamW` over the VarStore (its shards)
    TchZero3,
}

fn wave(shape: &[i64], seed: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + seed).sin() * 0.4).view(shape)
}

/// Deterministic values for every variable (threads share tch's generator, so no random init).
fn init(vs: &nn::VarStore) {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    tch::no_grad(|| {
        for (i, (_, t)) in vars.iter().enumerate() {
            t.shallow_clone().copy_(&wave(&t.size(), i as f64));
        }
    });
}

fn data(step: usize) -> (Tensor, Tensor) {
    let rows = Tensor::arange(BATCH, (Kind::Float, Device::Cpu)).unsqueeze(1) + (step as f64) * 100.0;
    let cols = Tensor::arange(D, (Kind::Float, Device::Cpu)).unsqueeze(0);
    ((&rows * 0.21 + &cols * 0.4).sin(), (&rows * 0.07 - &cols).cos())
}

fn rows(t: &Tensor, rank: usize, parts: usize) -> Tensor {
    let n = t.size()[0] / parts as i64;
    t.narrow(0, rank as i64 * n, n)
}

fn mlp(vs: &nn::VarStore) -> nn::Sequential {
    let r = vs.root();
    let net = nn::seq().add(nn::linear(&r / "l1", D, H, Default::default())).add_fn(|x| x.tanh()).add(nn::linear(
        &r / "l2",
        H,
        D,
        Default::default(),
    ));
    init(vs);
    net
}

trait Trainer {
    fn step(&mut self, s: usize);
    fn state(&mut self) -> StateDict<'_>;
}

struct Plain {
    vs: nn::VarStore,
    net: Box<dyn Module>,
    opt: AdamW,
}

impl Trainer for Plain {
    fn step(&mut self, s: usize) {
        let (x, y) = data(s);
        let loss = self.net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        loss.backward();
        self.opt.step().unwrap();
        self.opt.zero_grad().unwrap();
    }
    fn state(&mut self) -> StateDict<'_> {
        let mut sd = StateDict::new();
        sd.var_store("model", &self.vs).optimizer("optim", &mut self.opt);
        sd
    }
}

/// A model trained by tch's own `nn::AdamW`, built on the VarStore after the model (under FSDP, after
/// `finish`: over its shards); `ddp`: `(rank, world, fsdp)` where each rank takes its rows.
struct TchAdamW {
    vs: nn::VarStore,
    net: Box<dyn Fn(&Tensor) -> Tensor>,
    backward: Box<dyn Fn(&Tensor)>,
    opt: nn::Optimizer,
    rank: usize,
    world: usize,
}

impl Trainer for TchAdamW {
    fn step(&mut self, s: usize) {
        let (x, y) = data(s);
        let out = (self.net)(&rows(&x, self.rank, self.world));
        (self.backward)(&out.mse_loss(&rows(&y, self.rank, self.world), tch::Reduction::Mean));
        self.opt.step();
        self.opt.zero_grad();
    }
    fn state(&mut self) -> StateDict<'_> {
        let mut sd = StateDict::new();
        sd.var_store("model", &self.vs).tch_optimizer("optim", &mut self.opt, &self.vs);
        sd
    }
}

fn tch_adamw(vs: &nn::VarStore) -> nn::Optimizer {
    use tch::nn::OptimizerConfig;
    nn::AdamW::default().build(vs, LR).unwrap()
}

struct Unsplit {
    stage: tch_dist::pipeline::layers::Stage,
    opt: AdamW,
}

impl Trainer for Unsplit {
    fn step(&mut self, s: usize) {
        let (x, y) = common::pipe::data(s);
        common::pipe::loss(&self.stage.forward(&x), &y).backward();
        self.opt.step().unwrap();
        self.opt.zero_grad().unwrap();
    }
    fn state(&mut self) -> StateDict<'_> {
        let mut sd = StateDict::new();
        sd.var_store("model", &self.stage.vs).optimizer("optim", &mut self.opt);
        sd
    }
}

struct Ddp {
    vs: nn::VarStore,
    ddp: DistributedDataParallel<nn::Sequential>,
    opt: Box<dyn Optimizer>,
    rank: usize,
    world: usize,
    zero: bool,
}

impl Trainer for Ddp {
    fn step(&mut self, s: usize) {
        let (x, y) = data(s);
        let out = self.ddp.f_forward(&rows(&x, self.rank, self.world)).unwrap();
        self.ddp.backward(&out.mse_loss(&rows(&y, self.rank, self.world), tch::Reduction::Mean)).unwrap();
        self.opt.step().unwrap();
        self.opt.zero_grad().unwrap();
    }
    fn state(&mut self) -> StateDict<'_> {
        let mut sd = StateDict::new();
        sd.var_store("model", &self.vs).optimizer("optim", self.opt.as_mut());
        if self.zero {
            sd.describe("zero_stage", 2);
        }
        sd
    }
}

struct Fsdp {
    vs: nn::VarStore,
    model: FullyShardedDataParallel<nn::Sequential>,
    opt: AdamW,
    rank: usize,
    world: usize,
}

impl Trainer for Fsdp {
    fn step(&mut self, s: usize) {
        let (x, y) = data(s);
        let out = self.model.f_forward(&rows(&x, self.rank, self.world)).unwrap();
        self.model.backward(&out.mse_loss(&rows(&y, self.rank, self.world), tch::Reduction::Mean)).unwrap();
        self.opt.step().unwrap();
        self.opt.zero_grad().unwrap();
    }
    fn state(&mut self) -> StateDict<'_> {
        let mut sd = StateDict::new();
        // the VarStore's placements say each parameter is this rank's flat shard
        sd.var_store("model", &self.vs).optimizer("optim", &mut self.opt);
        sd
    }
}

struct Tp {
    vs: nn::VarStore,
    mlp: ParallelMlp,
    tp: Arc<ProcessGroup>,
    dp: Arc<ProcessGroup>,
    opt: AdamW,
}

impl Trainer for Tp {
    fn step(&mut self, s: usize) {
        let (x, y) = data(s);
        let (r, n) = (self.dp.rank(), self.dp.size());
        let out = self.mlp.f_forward(&rows(&x, r, n)).unwrap();
        out.mse_loss(&rows(&y, r, n), tch::Reduction::Mean).backward();
        for p in self.vs.trainable_variables() {
            let mut g = p.grad();
            self.dp.allreduce(&mut g, ReduceOp::Sum).unwrap();
            let _ = g.divide_scalar_(n as f64);
        }
        self.opt.step().unwrap();
        self.opt.zero_grad().unwrap();
    }
    fn state(&mut self) -> StateDict<'_> {
        let mut sd = StateDict::new();
        sd.var_store("model", &self.vs).optimizer("optim", &mut self.opt);
        sd.describe("tp", self.tp.size() as i64).describe("dp", self.dp.size() as i64);
        sd
    }
}

struct Pipe {
    pipe: PipelineRank,
    opt: AdamW,
}

impl Trainer for Pipe {
    fn step(&mut self, s: usize) {
        let (x, y) = common::pipe::data(s);
        self.pipe.step(&x, &y, &common::pipe::loss).unwrap();
        self.opt.step().unwrap();
        self.opt.zero_grad().unwrap();
    }
    fn state(&mut self) -> StateDict<'_> {
        let mut sd = StateDict::new();
        for vs in self.pipe.var_stores() {
            sd.var_store("model", vs);
        }
        sd.describe("pp", 2).optimizer("optim", &mut self.opt);
        sd
    }
}

fn build(layout: Layout, pg: Arc<ProcessGroup>) -> Box<dyn Trainer> {
    let (rank, world) = (pg.rank(), pg.size());
    match layout {
        Layout::Plain => {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = mlp(&vs);
            let opt = AdamW::new(vs.trainable_variables(), LR);
            Box::new(Plain { vs, net: Box::new(net), opt })
        }
        Layout::TchPlain => {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = mlp(&vs);
            let opt = tch_adamw(&vs);
            let (net, backward) = (Box::new(move |x: &Tensor| net.forward(x)), Box::new(|l: &Tensor| l.backward()));
            Box::new(TchAdamW { vs, net, backward, opt, rank: 0, world: 1 })
        }
        Layout::TchZero3 => {
            let (vs, model) = zero3_mlp(pg);
            let model = std::rc::Rc::new(model);
            let opt = tch_adamw(&vs);
            let m = model.clone();
            let net = Box::new(move |x: &Tensor| model.f_forward(x).unwrap());
            let backward = Box::new(move |l: &Tensor| m.backward(l).unwrap());
            Box::new(TchAdamW { vs, net, backward, opt, rank, world })
        }
        Layout::PipePlain => {
            let l = common::pipe::layers();
            let stage = l.build_stage(0..l.len(), Device::Cpu).unwrap();
            init(&stage.vs);
            let opt = AdamW::new(stage.vs.trainable_variables(), LR);
            Box::new(Unsplit { stage, opt })
        }
        Layout::Ddp | Layout::Zero2 => {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = mlp(&vs);
            let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg)).unwrap();
            let zero = layout == Layout::Zero2;
            let opt: Box<dyn Optimizer> = if zero {
                Box::new(ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(AdamW::new(p, LR))).unwrap())
            } else {
                Box::new(AdamW::new(vs.trainable_variables(), LR))
            };
            Box::new(Ddp { vs, ddp, opt, rank, world, zero })
        }
        Layout::Zero3 => {
            let (vs, model) = zero3_mlp(pg);
            let opt = AdamW::new(model.parameters(), LR);
            Box::new(Fsdp { vs, model, opt, rank, world })
        }
        Layout::TpDp(tp) => {
            let mesh = DeviceMesh::new(&pg, &[("dp", pg.size() / tp), ("tp", tp)]).unwrap();
            let (tp_group, dp) = (mesh.group("tp").unwrap(), mesh.group("dp").unwrap());
            let vs = nn::VarStore::new(Device::Cpu);
            let (w1, b1, w2, b2) = (wave(&[H, D], 1.0), wave(&[H], 2.0), wave(&[D, H], 3.0), wave(&[D], 4.0));
            let tp_pg = Arc::new(tp_group.new_subgroup(&(0..tp).collect::<Vec<_>>(), "mlp").unwrap().unwrap());
            let mlp = ParallelMlp::from_full(&(vs.root() / "mlp"), &w1, &b1, &w2, &b2, tp_pg).unwrap();
            let opt = AdamW::new(vs.trainable_variables(), LR);
            Box::new(Tp { vs, mlp, tp: tp_group, dp, opt })
        }
        Layout::Pipe => {
            let l = common::pipe::layers();
            let part = Partition::sizes(&[4, 4], l.len()).unwrap();
            let pipe = PipelineRank::build(
                pg,
                &l,
                &part,
                PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 4, chunks: 1, ..Default::default() },
            )
            .unwrap();
            for vs in pipe.var_stores() {
                init_named(vs);
            }
            let params: Vec<Tensor> = pipe.var_stores().iter().flat_map(|vs| vs.trainable_variables()).collect();
            let opt = AdamW::new(params, LR);
            Box::new(Pipe { pipe, opt })
        }
    }
}

/// The MLP with each linear layer an FSDP unit over `pg`.
fn zero3_mlp(pg: Arc<ProcessGroup>) -> (nn::VarStore, FullyShardedDataParallel<nn::Sequential>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let r = vs.root();
    let l1 = nn::linear(&r / "l1", D, H, Default::default());
    let l2 = nn::linear(&r / "l2", H, D, Default::default());
    init(&vs);
    let f = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg)).unwrap();
    let net = nn::seq()
        .add(f.fully_shard(&(&r / "l1"), l1).unwrap())
        .add_fn(|x| x.tanh())
        .add(f.fully_shard(&(&r / "l2"), l2).unwrap());
    (vs, f.finish(net).unwrap())
}

/// As [`init`], for a stage holding part of the deep MLP: values by name, as the unsplit model gets them.
fn init_named(vs: &nn::VarStore) {
    let all = common::pipe::layers().build_stage(0..8, Device::Cpu).unwrap();
    init(&all.vs);
    let full = all.vs.variables();
    tch::no_grad(|| {
        for (n, t) in vs.variables() {
            t.shallow_clone().copy_(&full[&n]);
        }
    });
}

/// On `world` ranks in `layout`: loads the newest checkpoint under `load` (when given; it must be of
/// step `steps.start`) and saves it again under `resaved`, trains `steps`, and saves under `out`.
fn phase(
    layout: Layout,
    world: usize,
    load: Option<PathBuf>,
    resaved: Option<PathBuf>,
    steps: std::ops::Range<usize>,
    out: PathBuf,
) {
    common::run_threads(world, Duration::from_secs(60), move |pg| {
        let pg = Arc::new(pg);
        let mut t = build(layout, pg.clone());
        if let Some(root) = &load {
            let mut ck = Checkpointer::new(pg.clone(), root).unwrap();
            assert_eq!(ck.load(&mut t.state()).unwrap(), Some(steps.start as u64), "{layout:?}");
            if let Some(again) = &resaved {
                Checkpointer::new(pg.clone(), again).unwrap().save(steps.start as u64, &t.state()).unwrap();
            }
        }
        for s in steps.clone() {
            t.step(s);
        }
        Checkpointer::new(pg, &out).unwrap().save(steps.end as u64, &t.state()).unwrap();
    });
}

fn full(root: &Path) -> (u64, Vec<(String, Tensor)>) {
    let step = *checkpoint::committed_steps(root).last().expect("a committed checkpoint");
    checkpoint::read_full(&checkpoint::step_dir(root, step)).unwrap()
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    let names = |v: &[(String, Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "the same tensors");
    a.iter()
        .zip(b)
        .map(|((n, x), (_, y))| {
            assert_eq!(x.size(), y.size(), "{n}");
            (x.to_kind(Kind::Double) - y.to_kind(Kind::Double)).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// `from` on `w1` ranks for 3 steps, then `to` on `w2` for 3 more, against `reference` on one rank for 6.
fn reshard(from: Layout, w1: usize, to: Layout, w2: usize, reference: Layout) {
    let tmp = std::env::temp_dir().join(format!("tch-dist-reshard-{}-{from:?}-{to:?}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let (a, b, c, r) = (tmp.join("a"), tmp.join("b"), tmp.join("c"), tmp.join("ref"));
    phase(from, w1, None, None, 0..3, a.clone());
    phase(to, w2, Some(a.clone()), Some(b.clone()), 3..6, c.clone());
    phase(reference, 1, None, None, 0..6, r.clone());
    let (sa, ta) = full(&a);
    let (sb, tb) = full(&b);
    assert_eq!((sa, sb), (3, 3));
    assert!(ta.iter().any(|(n, _)| n.ends_with(".exp_avg_sq")), "optimizer state saved");
    assert_eq!(max_diff(&ta, &tb), 0.0, "{from:?} x{w1} -> {to:?} x{w2}: resharding changed values");
    let (sc, tc) = full(&c);
    let (sr, tr) = full(&r);
    assert_eq!((sc, sr), (6, 6));
    let d = max_diff(&tc, &tr);
    eprintln!("{from:?} x{w1} -> {to:?} x{w2}: after 3 more steps, {d:e} from the run that never stopped");
    assert!(d < TOL, "{from:?} x{w1} -> {to:?} x{w2}: {d:e} from the uninterrupted run");
    for ((n, x), (_, y)) in tc.iter().zip(&tr) {
        if n.ends_with(".step") {
            assert!(x.equal(y), "{n}: step counts differ");
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn ddp_on_2_to_zero2_on_3() {
    reshard(Layout::Ddp, 2, Layout::Zero2, 3, Layout::Plain);
}

#[test]
fn zero3_on_2_to_plain_on_1() {
    reshard(Layout::Zero3, 2, Layout::Plain, 1, Layout::Plain);
}

/// On 3 ranks, l2's bias (4 elements, chunks of 2) leaves rank 2 an empty shard, which still names its
/// optimizer's step count, saved and loaded.
#[test]
fn zero3_on_3_with_an_empty_shard_to_plain_on_1_and_back() {
    reshard(Layout::Zero3, 3, Layout::Plain, 1, Layout::Plain);
    reshard(Layout::Plain, 1, Layout::Zero3, 3, Layout::Plain);
}

/// tch's own `nn::AdamW` under FSDP on 2 ranks, its moments and step counts in the sharded checkpoint,
/// resumed by tch's `nn::AdamW` in one process: as if it never stopped.
#[test]
fn tch_s_adamw_under_zero3_on_2_to_one_process_on_1() {
    reshard(Layout::TchZero3, 2, Layout::TchPlain, 1, Layout::TchPlain);
}

/// Our AdamW's state loads into tch's (the same names and fields) and back.
#[test]
fn our_adamw_on_zero3_to_tch_s_adamw_and_back() {
    reshard(Layout::Zero3, 2, Layout::TchPlain, 1, Layout::Plain);
    reshard(Layout::TchPlain, 1, Layout::Zero3, 2, Layout::TchPlain);
}

#[test]
fn zero2_on_3_to_zero3_on_2() {
    reshard(Layout::Zero2, 3, Layout::Zero3, 2, Layout::Plain);
}

#[test]
fn tp2_dp2_to_tp1_dp3() {
    reshard(Layout::TpDp(2), 4, Layout::TpDp(1), 3, Layout::TpDp(1));
}

#[test]
fn pipeline_of_2_stages_to_unsplit() {
    reshard(Layout::Pipe, 2, Layout::PipePlain, 1, Layout::PipePlain);
}

/// PyTorch reads what ZeRO-3 on 2 ranks saved (through `scripts/ckpt_to_torch.py`), loads it into a
/// torch module and `torch.optim.AdamW`, and its next step equals the one tch-dist took.
#[test]
fn pytorch_loads_a_sharded_checkpoint_and_continues_alike() {
    let tmp = std::env::temp_dir().join(format!("tch-dist-to-torch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let (a, b) = (tmp.join("a"), tmp.join("b"));
    phase(Layout::Zero3, 2, None, None, 0..3, a.clone());
    phase(Layout::Zero3, 2, Some(a.clone()), None, 3..4, b.clone());
    let root = env!("CARGO_MANIFEST_DIR");
    let out = std::process::Command::new(common::python())
        .arg(format!("{root}/tests/py/ckpt_torch_check.py"))
        .arg(checkpoint::step_dir(&a, 3))
        .arg(checkpoint::step_dir(&b, 4))
        .args([D.to_string(), H.to_string(), BATCH.to_string(), LR.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("PyTorch's step from our checkpoint vs ours: {v}");
    assert_eq!(v["parameters"], 4);
    assert!(v["max_diff"].as_f64().unwrap() < TOL, "{v}");
    // the command-line form: one safetensors file of the model, as a module's state_dict names it
    let file = tmp.join("model.safetensors");
    let cli = std::process::Command::new(common::python())
        .arg(format!("{root}/scripts/ckpt_to_torch.py"))
        .arg(checkpoint::step_dir(&b, 4))
        .arg("--out")
        .arg(&file)
        .output()
        .unwrap();
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let mut written = Tensor::read_safetensors(&file).unwrap();
    written.sort_by(|x, y| x.0.cmp(&y.0));
    let model: Vec<(String, Tensor)> =
        full(&b).1.into_iter().filter_map(|(n, t)| n.strip_prefix("model.").map(|n| (n.to_string(), t))).collect();
    assert_eq!(max_diff(&written, &model), 0.0);
    let _ = std::fs::remove_dir_all(&tmp);
}
