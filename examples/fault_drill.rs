//! One rank of a training job with a fault injected, for the fault-injection suite (tests/launch/faults.rs), run
//! under tchrun. `TDX_FAULT` says what goes wrong, where and when:
//!   stop@R:S       rank R stops itself (SIGSTOP) at step S: a hung rank
//!   exit@R:S       rank R exits with code 17 at step S
//!   killbucket@R:S rank R is killed (SIGKILL) inside its backward at step S, after a bucket was launched
//!   mismatch@R:S   rank R runs an allreduce of another shape than the others at step S
//!   badloss@R:S    (pipeline) rank R's loss gets targets of the wrong shape at step S: its stage fails
//!   sleep@R:S      rank R sleeps 6 s at step S: slow, but alive (its heartbeat goes on)
//!   sample@R:S     rank R runs one more forward at step S, as for sampling text on rank 0 only
//!   extra@R:S      rank R runs S more steps than the others (uneven inputs without `join`); no final barrier
//!   torcherr@R:S   rank R runs a tensor operation on mismatched shapes at step S (a libtorch error)
//!
//!   fault_drill --mode ddp|zero2|fsdp|pipeline|pipeline-dp|mesh [--steps 8]
//!
//! Rank 0 prints `step S` after each step; every rank prints `done` at the end.
use std::sync::Arc;

use clap::Parser;
use tch::nn::OptimizerConfig;
use tch::{nn, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
use tch_dist::optim::{Optimizer, Sgd};
use tch_dist::parallel_dims::ParallelDims;
use tch_dist::pipeline::schedule::ScheduleKind;
use tch_dist::pipeline::{LayerList, Partition, PipelineConfig, PipelineRank};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;
use tch_dist::{ProcessGroup, ReduceOp};

#[derive(Parser)]
struct Args {
    /// ddp, zero2, fsdp, pipeline (2 ranks, one stage each), pipeline-dp (4 ranks: pp 2 x DDP 2) or mesh
    /// (4 ranks: a 2 x 2 mesh, an all-reduce in each dimension per step)
    #[arg(long, default_value = "ddp")]
    mode: String,
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Save a checkpoint here after every step (DDP and ZeRO-2 modes)
    #[arg(long)]
    ckpt: Option<std::path::PathBuf>,
}

struct Fault {
    what: String,
    rank: usize,
    step: usize,
}

fn fault() -> Option<Fault> {
    let v = std::env::var("TDX_FAULT").ok()?;
    let (what, at) = v.split_once('@')?;
    let (r, s) = at.split_once(':')?;
    Some(Fault { what: what.to_string(), rank: r.parse().ok()?, step: s.parse().ok()? })
}

/// The fault for this rank at this step, if any (`mismatch` and `killbucket` are acted on by the caller).
fn strike(f: &Option<Fault>, rank: usize, step: usize) -> Option<&str> {
    let f = f.as_ref().filter(|f| f.rank == rank && f.step == step)?;
    match f.what.as_str() {
        "stop" => {
            eprintln!("rank {rank}: stopping myself (SIGSTOP) at step {step}");
            // SAFETY: raise(2) on this process.
            unsafe { libc::raise(libc::SIGSTOP) };
            None
        }
        "exit" => {
            eprintln!("rank {rank}: exiting at step {step}");
            std::process::exit(17)
        }
        "sleep" => {
            eprintln!("rank {rank}: sleeping 6 s at step {step}");
            std::thread::sleep(std::time::Duration::from_secs(6));
            None
        }
        other => Some(other),
    }
}

fn batch(step: usize, rank: usize) -> (Tensor, Tensor) {
    let rows = Tensor::arange(8, (Kind::Float, Device::Cpu)).unsqueeze(1) + (step * 100 + rank * 8) as f64;
    let x = (&rows * 0.13 + Tensor::arange(32, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.71).sin();
    let y = (&rows * 0.05 - Tensor::arange(4, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.3).cos();
    (x, y)
}

/// A 2 x 2 mesh (dp, tp): per step an all-reduce over tp, then one over dp, so that a rank stopped in tp
/// holds its tp peer away from that peer's dp all-reduce.
fn mesh(args: &Args, pg: &ProcessGroup, f: &Option<Fault>) -> Result<(), Box<dyn std::error::Error>> {
    let mesh = tch_dist::mesh::DeviceMesh::new(pg, &[("dp", 2), ("tp", 2)])?;
    let (dp, tp) = (mesh.group("dp")?, mesh.group("tp")?);
    for step in 0..args.steps {
        strike(f, pg.rank(), step);
        let mut t = Tensor::ones([8], (Kind::Float, Device::Cpu));
        tp.allreduce(&mut t, ReduceOp::Sum)?;
        dp.allreduce(&mut t, ReduceOp::Sum)?;
        if pg.rank() == 0 {
            println!("step {step}");
        }
    }
    println!("done");
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let pg = Arc::new(ProcessGroup::from_env()?);
    let rank = pg.rank();
    let f = fault();
    if args.mode.starts_with("pipeline") {
        return pipeline(&args, pg, &f);
    }
    if args.mode == "mesh" {
        return mesh(&args, &pg, &f);
    }
    tch::manual_seed(0);
    if args.mode == "fsdp" {
        return fsdp(&args, pg, &f);
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 32, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 64, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l3", 64, 4, Default::default()));
    // small buckets, so that a backward launches several
    let opts = DdpOptions::default().bucket_cap_mb(0.01).process_group(pg.clone());
    let ddp = DistributedDataParallel::new(&vs, net, opts)?;
    let mut opt: Box<dyn Optimizer> = match args.mode.as_str() {
        "ddp" => Box::new(Sgd::new(vs.trainable_variables(), 0.05)),
        "zero2" => Box::new(ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(Sgd::new(p, 0.05)))?),
        other => return Err(format!("--mode {other:?}: ddp, zero2, fsdp or pipeline").into()),
    };
    // the first layer's weight gets its gradient last: later buckets are launched by then
    let kill_in_backward = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let armed = kill_in_backward.clone();
    let w1 = vs.variables().get("l1.weight").ok_or("no l1.weight")?.shallow_clone();
    let _hook = tch_dist::hooks::on_grad_accumulated(&w1, move || {
        if armed.load(std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: kill(2) on this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    })?;
    for step in 0..steps(&args, &f, rank) {
        match strike(&f, rank, step) {
            Some("mismatch") => {
                let mut t = Tensor::ones([3], (Kind::Float, Device::Cpu));
                pg.allreduce(&mut t, ReduceOp::Sum)?;
            }
            Some("killbucket") => kill_in_backward.store(true, std::sync::atomic::Ordering::SeqCst),
            Some("sample") => drop(tch::no_grad(|| ddp.f_forward(&batch(step, rank).0))?),
            Some("torcherr") => drop(
                Tensor::ones([4], (Kind::Float, Device::Cpu)).f_add(&Tensor::ones([3], (Kind::Float, Device::Cpu)))?,
            ),
            _ => {}
        }
        if f.as_ref().is_some_and(|f| f.what == "mismatch" && f.rank != rank && f.step == step) {
            let mut t = Tensor::ones([5], (Kind::Float, Device::Cpu));
            pg.allreduce(&mut t, ReduceOp::Sum)?;
        }
        let (x, y) = batch(step, rank);
        ddp.backward(&ddp.f_forward(&x)?.mse_loss(&y, tch::Reduction::Mean))?;
        opt.step()?;
        opt.zero_grad()?;
        if let Some(path) = &args.ckpt {
            tch_dist::checkpoint::save_var_store(&pg, path, step as u64 + 1, &vs)?;
        }
        if rank == 0 {
            println!("step {step}");
        }
    }
    finish(&pg, &f)
}

/// How many steps this rank runs: `extra@R:N` gives rank R N more.
fn steps(args: &Args, f: &Option<Fault>, rank: usize) -> usize {
    match f {
        Some(f) if f.what == "extra" && f.rank == rank => args.steps + f.step,
        _ => args.steps,
    }
}

/// The end of a run: a barrier, except with uneven inputs (a loop without `join` ends without one).
fn finish(pg: &ProcessGroup, f: &Option<Fault>) -> Result<(), Box<dyn std::error::Error>> {
    if f.as_ref().is_none_or(|f| f.what != "extra") {
        pg.barrier()?;
    }
    println!("done");
    Ok(())
}

/// The same model under FSDP, one unit per linear layer.
fn fsdp(args: &Args, pg: Arc<ProcessGroup>, f: &Option<Fault>) -> Result<(), Box<dyn std::error::Error>> {
    let rank = pg.rank();
    let vs = nn::VarStore::new(Device::Cpu);
    let b = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone()))?;
    let root = vs.root();
    let net = b
        .auto_wrap(1)
        .add(&(&root / "l1"), nn::linear(&root / "l1", 32, 64, Default::default()))?
        .add_fn(|x| x.relu())
        .add(&(&root / "l2"), nn::linear(&root / "l2", 64, 64, Default::default()))?
        .add_fn(|x| x.relu())
        .add(&(&root / "l3"), nn::linear(&root / "l3", 64, 4, Default::default()))?
        .build()?;
    let model = b.finish(net)?;
    let mut opt = nn::Sgd::default().build(&vs, 0.05)?;
    for step in 0..steps(args, f, rank) {
        match strike(f, rank, step) {
            Some("sample") => drop(tch::no_grad(|| model.f_forward(&batch(step, rank).0))?),
            // a collective call of the API made by one rank (the others train on)
            Some("statedict") => drop(model.state_dict()?),
            Some("torcherr") => drop(
                Tensor::ones([4], (Kind::Float, Device::Cpu)).f_add(&Tensor::ones([3], (Kind::Float, Device::Cpu)))?,
            ),
            _ => {}
        }
        let (x, y) = batch(step, rank);
        model.backward(&model.f_forward(&x)?.mse_loss(&y, tch::Reduction::Mean))?;
        opt.step();
        model.zero_grad()?;
        if rank == 0 {
            println!("step {step}");
        }
    }
    finish(&pg, f)
}

/// Two stages, one process each; with `--mode pipeline-dp`, 4 ranks: pp 2 x DDP 2 from `ParallelDims`, so
/// that a stage's rank in its pipeline group differs from its world rank (faults name world ranks).
fn pipeline(args: &Args, pg: Arc<ProcessGroup>, f: &Option<Fault>) -> Result<(), Box<dyn std::error::Error>> {
    let rank = pg.rank();
    let (stages, plan, rows) = if args.mode == "pipeline-dp" {
        let mesh = ParallelDims { pp: 2, dp_replicate: 2, ..Default::default() }.build(&pg)?;
        (mesh.pp_group().clone(), mesh.plan(), mesh.rows(8)?)
    } else {
        (pg.clone(), tch_dist::parallelize::Plan::new(), 0..8)
    };
    let layers = LayerList::new()
        .seed(3)
        .add("l1", |p| nn::linear(p, 32, 64, Default::default()))
        .add_fn("relu", |x| x.relu())
        .add("l2", |p| nn::linear(p, 64, 4, Default::default()));
    let cfg = PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 4, plan, ..Default::default() };
    let mut st = PipelineRank::build(stages, &layers, &Partition::sizes(&[2, 1], 3)?, cfg)?;
    let mut opts: Vec<Sgd> = st.var_stores().iter().map(|vs| Sgd::new(vs.trainable_variables(), 0.05)).collect();
    let loss = |out: &Tensor, y: &Tensor| out.mse_loss(y, tch::Reduction::Mean);
    for step in 0..args.steps {
        let bad = strike(f, rank, step) == Some("badloss");
        let (x, y) = batch(step, 0);
        let n = rows.end - rows.start;
        let (x, y) = (x.narrow(0, rows.start, n), y.narrow(0, rows.start, n));
        let y = if bad { Tensor::zeros([n, 7], (Kind::Float, Device::Cpu)) } else { y };
        st.step(&x, &y, &loss)?;
        for o in &mut opts {
            o.step()?;
            o.zero_grad()?;
        }
        if rank == 0 {
            println!("step {step}");
        }
    }
    finish(&pg, f)
}
