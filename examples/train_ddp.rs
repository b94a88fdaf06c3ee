//! A real training run with DDP: the 8x8 handwritten digits that scikit-learn ships (1,797 images),
//! an MLP, tch's SGD with momentum; each rank trains on its share of every epoch
//! (`data::DistributedSampler`, PyTorch's indices), DDP averages gradients. Rank 0 prints loss and test
//! accuracy per epoch.
//!
//! Started with torchrun's environment (scripts/train-ddp.sh runs it on 1 and on 2 ranks and compares);
//! with WORLD_SIZE=1 it is the single-process baseline with the same global batch.
//!   train_ddp [--epochs N] [--data path/to/digits.csv.gz]
use std::io::IsTerminal;
use std::sync::Arc;

use clap::Parser;

#[path = "common/digits.rs"]
mod digits;
use indicatif::{ProgressBar, ProgressStyle};
use tch::{nn, nn::Module, nn::OptimizerConfig, Device};
use tch_dist::data::{Batches, DistributedSampler, SamplerOptions};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::DistModule;
use tch_dist::ProcessGroup;

const GLOBAL_BATCH: i64 = 64;

#[derive(Parser)]
#[command(about = "DDP training on scikit-learn's digits, one rank per process (torchrun's environment)")]
struct Args {
    #[arg(long, default_value_t = 30)]
    epochs: usize,
    /// digits.csv.gz; default: the copy inside the venv's scikit-learn
    #[arg(long)]
    data: Option<std::path::PathBuf>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let epochs = args.epochs;
    let data = match args.data {
        Some(p) => p,
        None => digits::default_data()?,
    };
    let pg = Arc::new(ProcessGroup::from_env()?);
    let (rank, world) = (pg.rank(), pg.size() as i64);
    if GLOBAL_BATCH % world != 0 {
        return Err(format!("global batch {GLOBAL_BATCH} is not divisible by WORLD_SIZE={world}").into());
    }
    let (x, y) = digits::load(&data)?;
    let ((xtr, ytr), (xte, yte)) = digits::split(&x, &y, 1500);

    tch::manual_seed(1); // same initial weights everywhere (DDP broadcasts rank 0's anyway)
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 64, 128, Default::default()))
        .add_fn(|t| t.relu())
        .add(nn::linear(vs.root() / "fc2", 128, 10, Default::default()));
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05)?;

    let local_batch = (GLOBAL_BATCH / world) as usize;
    // each rank's share of the 1,500 training images, reshuffled every epoch (the same shuffle on every
    // rank); the global batch is the union of the ranks' local batches, whatever the world size
    let mut sampler = DistributedSampler::for_group(1500, &pg, SamplerOptions::default().seed(100))?;
    let steps = sampler.len() / local_batch; // drop the last partial batch, as drop_last=True
    let bar = if rank == 0 {
        let b = ProgressBar::new((epochs * steps) as u64);
        b.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg}")?);
        b
    } else {
        ProgressBar::hidden()
    };
    let mut last_acc = 0.0;
    for epoch in 0..epochs {
        sampler.set_epoch(epoch as u64);
        let mut loss_sum = 0.0;
        for (xb, yb) in Batches::new(&xtr, &ytr, sampler.indices()?, local_batch)?.drop_last() {
            let loss = ddp.forward(&xb).cross_entropy_for_logits(&yb);
            ddp.backward(&loss)?;
            opt.step();
            opt.zero_grad();
            // the global batch's loss, for the log
            let mut l = loss.detach().view([1]);
            pg.allreduce(&mut l, tch_dist::ReduceOp::Avg)?;
            loss_sum += l.double_value(&[0]);
            bar.inc(1);
        }
        let acc = tch::no_grad(|| ddp.module().forward(&xte).accuracy_for_logits(&yte)).double_value(&[]);
        last_acc = acc;
        let msg =
            format!("epoch {:>2}  loss {:.4}  test accuracy {:.2}%", epoch + 1, loss_sum / steps as f64, 100.0 * acc);
        bar.set_message(msg.clone());
        if rank == 0 {
            if !std::io::stderr().is_terminal() {
                println!("{msg}"); // not a terminal: plain lines
            } else {
                bar.println(&msg);
            }
        }
    }
    bar.finish_and_clear();
    if rank == 0 {
        println!("final test accuracy {:.2}% (world size {world}, global batch {GLOBAL_BATCH})", 100.0 * last_acc);
    }
    Ok(())
}
