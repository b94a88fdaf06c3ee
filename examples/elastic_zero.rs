//! DDP + ZeRO-2 training with a fixed global batch that survives a change of world size: sharded
//! checkpoints every few steps, resumed (resharded) after `tchrun` restarts the job with another number
//! of nodes. For the elastic tests of tchrun (tests/launch/tchrun_elastic.rs).
//!
//!   tchrun --nnodes 2:3 --rdzv-endpoint 127.0.0.1:29400 --max-restarts 2 -- \
//!       elastic_zero --steps 30 --every 2 --ckpt /tmp/ckpt --out /tmp/final.f32
//!
//! Options: --steps N, --ckpt DIR (resume from its newest checkpoint; save every --every K steps),
//! --stop-at S (end after step S, for a reference run that changes world size there), --step-ms MS (sleep
//! per step, to give a test time to interfere), --out PATH (rank 0 writes the final parameters as raw
//! little-endian float32).
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use tch::{nn, Device, Kind, Tensor};
use tch_dist::checkpoint::{self, Checkpointer, StateDict};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;
use tch_dist::ProcessGroup;

/// Rows of the global batch (divisible by 1, 2, 3, 4 and 6 ranks).
const BATCH: i64 = 12;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[arg(long)]
    ckpt: PathBuf,
    #[arg(long, default_value_t = 2)]
    every: usize,
    #[arg(long)]
    stop_at: Option<usize>,
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// This rank's rows of step `step`'s global batch.
fn batch(step: usize, rank: usize, world: usize) -> (Tensor, Tensor) {
    let per = BATCH / world as i64;
    let rows = Tensor::arange(BATCH, (Kind::Float, Device::Cpu)).unsqueeze(1) + (step * 1000) as f64;
    let x = (&rows * 0.13 + Tensor::arange(12, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.71).sin();
    let y = (&rows * 0.05 - Tensor::arange(4, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.3).cos();
    (x.narrow(0, rank as i64 * per, per), y.narrow(0, rank as i64 * per, per))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let pg = Arc::new(ProcessGroup::from_env()?);
    let (rank, world) = (pg.rank(), pg.size());
    if BATCH % world as i64 != 0 {
        return Err(format!("the global batch of {BATCH} does not split over {world} ranks").into());
    }
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 12, 24, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "l2", 24, 4, Default::default()));
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
    let mut opt = ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(AdamW::new(p, 0.01)))?;
    let mut ck = Checkpointer::new(pg.clone(), &args.ckpt)?.keep_last(3);
    let mut sd = StateDict::new();
    sd.var_store("model", &vs).optimizer("optim", &mut opt).describe("zero_stage", 2);
    let start = ck.load(&mut sd)?.unwrap_or(0) as usize;
    drop(sd);
    if rank == 0 {
        let restart = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
        println!("resumed from step {start} at world size {world} (restart {restart})");
    }
    let end = args.stop_at.unwrap_or(args.steps).min(args.steps);
    for step in start..end {
        let (x, y) = batch(step, rank, world);
        let loss = ddp.f_forward(&x)?.mse_loss(&y, tch::Reduction::Mean);
        ddp.backward(&loss)?;
        opt.step()?;
        opt.zero_grad()?;
        if (step + 1) % args.every == 0 || step + 1 == end {
            let mut sd = StateDict::new();
            sd.var_store("model", &vs).optimizer("optim", &mut opt).describe("zero_stage", 2);
            ck.save((step + 1) as u64, &sd)?;
        }
        if rank == 0 {
            println!("step {step} world {world} loss {:.6}", loss.double_value(&[]));
        }
        std::thread::sleep(std::time::Duration::from_millis(args.step_ms));
    }
    if let (Some(out), 0) = (&args.out, rank) {
        let mut bytes = Vec::new();
        for (_, t) in checkpoint::var_store_tensors(&vs) {
            for v in Vec::<f32>::try_from(t.detach().flatten(0, -1))? {
                bytes.extend(v.to_le_bytes());
            }
        }
        std::fs::write(out, bytes)?;
    }
    pg.barrier()?;
    Ok(())
}
