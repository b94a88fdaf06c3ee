//! A DDP training run that checkpoints and resumes, for `tchrun` (and its fault-injection tests).
//!
//!   tchrun --standalone --nproc-per-node 2 --max-restarts 1 -- ddp_elastic --steps 12 --ckpt /tmp/c.safetensors --every 3
//!
//! Options: --steps N, --ckpt PATH (resume from it if present; save every --every K steps),
//! --out PATH (rank 0 writes the final parameters there as raw little-endian float32).
//! Fault injection (environment): TDX_FAIL_RANK and TDX_FAIL_STEP make that rank exit with code 17 at
//! that step; with TDX_FAIL_ONCE=PATH only if PATH does not exist yet (it is created first), so a
//! restarted run goes through.
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::DistModule;
use tch_dist::{checkpoint, ProcessGroup};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Resume from this checkpoint if present, and save to it
    #[arg(long)]
    ckpt: Option<PathBuf>,
    /// Save every this many steps (0: never)
    #[arg(long, default_value_t = 0)]
    every: usize,
    /// Rank 0 writes the final parameters here (raw little-endian float32)
    #[arg(long)]
    out: Option<PathBuf>,
}

fn batch(step: usize, rank: usize) -> (Tensor, Tensor) {
    let base = (step * 1000 + rank * 8) as f64;
    let rows = Tensor::arange(8, (Kind::Float, Device::Cpu)).unsqueeze(1) + base;
    let x = (&rows * 0.13 + Tensor::arange(12, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.71).sin();
    let y = (&rows * 0.05 - Tensor::arange(4, (Kind::Float, Device::Cpu)).unsqueeze(0) * 0.3).cos();
    (x, y)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (steps, every, ckpt) = (args.steps, args.every, args.ckpt.clone());
    let pg = Arc::new(ProcessGroup::from_env()?);
    let rank = pg.rank();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 12, 24, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "l2", 24, 4, Default::default()));
    let mut start = 0;
    if let Some(path) = &ckpt {
        if let Some(step) = checkpoint::load_var_store(&pg, path, &vs)? {
            println!("rank {rank}: resumed from {} at step {step}", path.display());
            start = step as usize;
        }
    }
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let fail_rank: Option<usize> = std::env::var("TDX_FAIL_RANK").ok().and_then(|v| v.parse().ok());
    let fail_step: Option<usize> = std::env::var("TDX_FAIL_STEP").ok().and_then(|v| v.parse().ok());
    for step in start..steps {
        if fail_rank == Some(rank) && fail_step == Some(step) {
            let once = std::env::var("TDX_FAIL_ONCE").ok();
            if once.as_ref().is_none_or(|p| !std::path::Path::new(p).exists()) {
                if let Some(p) = once {
                    std::fs::write(p, b"failed once")?;
                }
                eprintln!("rank {rank}: injected failure at step {step}");
                std::process::exit(17);
            }
        }
        let (x, y) = batch(step, rank);
        let loss = ddp.f_forward(&x)?.mse_loss(&y, tch::Reduction::Mean);
        ddp.backward(&loss)?;
        opt.step();
        ddp.zero_grad()?;
        if rank == 0 {
            println!("step {step} loss {:.6}", loss.double_value(&[]));
        }
        if let (Some(path), true) = (&ckpt, every > 0 && (step + 1) % every == 0) {
            checkpoint::save_var_store(&pg, path, (step + 1) as u64, &vs)?;
        }
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
    println!("rank {rank} done");
    Ok(())
}
