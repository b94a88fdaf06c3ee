//! One rank of the soak test (scripts/soak.sh; tests/launch/soak.rs runs a short one): many small training steps,
//! and this process's resident memory at a given step and at the end, to show nothing grows.
//!   soak --mode ddp|zero2|amp|pipeline --steps 20000 --report-at 1000
//! amp: bfloat16 autocast under DDP; pipeline: 2 ranks, one stage each, 1F1B. Rank 0 prints
//! `rss STEP BYTES` at --report-at and after the last step.
use std::sync::Arc;

use clap::Parser;
use tch::{nn, Device, Kind, Tensor};
use tch_dist::amp::autocast;
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::optim::{AdamW, Optimizer, Sgd};
use tch_dist::pipeline::schedule::ScheduleKind;
use tch_dist::pipeline::{LayerList, Partition, PipelineConfig, PipelineRank};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;
use tch_dist::ProcessGroup;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "ddp")]
    mode: String,
    #[arg(long, default_value_t = 20_000)]
    steps: usize,
    #[arg(long, default_value_t = 1000)]
    report_at: usize,
}

/// Resident set size of this process, from /proc, after handing free heap pages back to the system:
/// glibc keeps freed memory in per-thread arenas and returns it when it pleases, which moved the
/// pipeline's RSS by ±2-4% between readings with nothing leaking; trimmed, RSS follows live memory.
fn rss() -> u64 {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim has no preconditions; it only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

fn batch(step: usize, rank: usize) -> (Tensor, Tensor) {
    let rows = Tensor::arange(16, (Kind::Float, Device::Cpu)).unsqueeze(1) + ((step % 97) * 100 + rank * 16) as f64;
    let x = (&rows * 0.13 + Tensor::arange(64, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.71).sin();
    let y = (&rows * 0.05 - Tensor::arange(8, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.3).cos();
    (x, y)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let pg = Arc::new(ProcessGroup::from_env()?);
    let rank = pg.rank();
    let report = |step: usize| {
        if rank == 0 && (step == args.report_at || step == args.steps) {
            println!("rss {step} {}", rss());
        }
    };
    if args.mode == "pipeline" {
        let layers = LayerList::new()
            .seed(1)
            .add("l1", |p| nn::linear(p, 64, 128, Default::default()))
            .add_fn("tanh", |x| x.tanh())
            .add("l2", |p| nn::linear(p, 128, 8, Default::default()));
        let cfg = PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 4, ..Default::default() };
        let mut st = PipelineRank::build(pg.clone(), &layers, &Partition::sizes(&[2, 1], 3)?, cfg)?;
        let mut opts: Vec<Sgd> = st.var_stores().iter().map(|vs| Sgd::new(vs.trainable_variables(), 0.01)).collect();
        let loss = |o: &Tensor, y: &Tensor| o.mse_loss(y, tch::Reduction::Mean);
        for step in 1..=args.steps {
            let (x, y) = batch(step, 0);
            st.step(&x, &y, &loss)?;
            for o in &mut opts {
                o.step()?;
                o.zero_grad()?;
            }
            report(step);
        }
        return Ok(());
    }
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 64, 128, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 128, 128, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l3", 128, 8, Default::default()));
    let ddp =
        DistributedDataParallel::new(&vs, net, DdpOptions::default().bucket_cap_mb(0.05).process_group(pg.clone()))?;
    let mut opt: Box<dyn Optimizer> = match args.mode.as_str() {
        "ddp" | "amp" => Box::new(AdamW::new(vs.trainable_variables(), 1e-3)),
        "zero2" => Box::new(ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(AdamW::new(p, 1e-3)))?),
        other => return Err(format!("--mode {other:?}: ddp, zero2, amp or pipeline").into()),
    };
    for step in 1..=args.steps {
        let (x, y) = batch(step, rank);
        let out = if args.mode == "amp" {
            autocast(Device::Cpu, Kind::BFloat16, || ddp.f_forward(&x))??.to_kind(Kind::Float)
        } else {
            ddp.f_forward(&x)?
        };
        ddp.backward(&out.mse_loss(&y, tch::Reduction::Mean))?;
        opt.step()?;
        opt.zero_grad()?;
        report(step);
    }
    Ok(())
}
