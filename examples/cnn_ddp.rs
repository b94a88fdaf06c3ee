//! A small ResNet with batch normalization, trained with DDP and SyncBatchNorm on scikit-learn's 8x8
//! digits: each rank holds its share of every global batch, and the batch-norm layers take their
//! statistics over the whole batch, so 2 ranks train as one process on the same global batch does (tch's
//! BatchNorm there). The model is written once, with tch's signatures; the plan entered while it is
//! built makes its batch norms synchronised and wraps it in DDP.
//!
//!   tchrun --nproc-per-node 1 -- cnn_ddp                     # one process, tch's BatchNorm
//!   tchrun --nproc-per-node 2 -- cnn_ddp                     # DDP + SyncBatchNorm
//!   tchrun --nproc-per-node 2 -- cnn_ddp --local-bn          # DDP, each rank's statistics its own
//!   cnn_ddp [--epochs N] [--data digits.csv.gz] [--losses FILE]
//!
//! scripts/cnn.sh runs both and plots their losses (docs/cnn.md).
use std::io::Write;
use std::sync::Arc;

use clap::Parser;

#[path = "common/digits.rs"]
mod digits;

use tch::{Device, Kind};
use tch_dist::data::{Batches, DistributedSampler, SamplerOptions};
use tch_dist::ddp::DdpOptions;
use tch_dist::nn::{self, ModuleT, OptimizerConfig};
use tch_dist::parallelize::Plan;
use tch_dist::{DistModule, ProcessGroup, ReduceOp};

const GLOBAL_BATCH: i64 = 64;
const TRAIN: i64 = 1500;

#[derive(Parser)]
#[command(about = "A small ResNet with DDP and SyncBatchNorm on scikit-learn's digits (torchrun's environment)")]
struct Args {
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Channels of the residual blocks.
    #[arg(long, default_value_t = 16)]
    width: i64,
    /// digits.csv.gz; default: the copy inside the venv's scikit-learn
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    /// Where rank 0 writes `step loss` lines (the global batch's loss).
    #[arg(long)]
    losses: Option<String>,
    /// Each rank's batch norm over its own rows only (plain DDP), to see what SyncBatchNorm changes.
    #[arg(long)]
    local_bn: bool,
}

// ---- the model: tch's layers, batch norm through the entered plan ----

fn conv3(p: nn::Path, cin: i64, cout: i64) -> nn::Conv2D {
    nn::conv2d(p, cin, cout, 3, nn::ConvConfig { padding: 1, bias: false, ..Default::default() })
}

fn bn(p: nn::Path, c: i64) -> nn::BatchNorm {
    nn::batch_norm2d(p, c, Default::default())
}

/// conv, bn, relu, conv, bn, plus the input, relu (ResNet's basic block).
fn block(p: &nn::Path, c: i64) -> impl ModuleT {
    let (c1, b1) = (conv3(p / "conv1", c, c), bn(p / "bn1", c));
    let (c2, b2) = (conv3(p / "conv2", c, c), bn(p / "bn2", c));
    nn::func_t(move |xs, train| {
        let ys = xs.apply(&c1).apply_t(&b1, train).relu().apply(&c2).apply_t(&b2, train);
        (xs + ys).relu()
    })
}

fn resnet(p: &nn::Path, width: i64) -> impl ModuleT {
    let stem = conv3(p / "stem", 1, width);
    let stem_bn = bn(p / "stem_bn", width);
    let blocks = nn::seq_t().add(block(&(p / "block1"), width)).add(block(&(p / "block2"), width));
    let head = nn::linear(p / "head", width, 10, Default::default());
    nn::func_t(move |xs, train| {
        xs.view([-1, 1, 8, 8])
            .apply(&stem)
            .apply_t(&stem_bn, train)
            .relu()
            .apply_t(&blocks, train)
            .mean_dim(&[2i64, 3][..], false, Kind::Float)
            .apply(&head)
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let data = match args.data {
        Some(p) => p,
        None => digits::default_data()?,
    };
    tch::set_num_threads(1);
    let pg = Arc::new(ProcessGroup::from_env()?);
    let (rank, world) = (pg.rank(), pg.size() as i64);
    if GLOBAL_BATCH % world != 0 {
        return Err(format!("global batch {GLOBAL_BATCH} is not divisible by WORLD_SIZE={world}").into());
    }
    let (x, y) = digits::load(&data)?;
    let ((xtr, ytr), (xte, yte)) = digits::split(&x, &y, TRAIN);

    // DDP over the world, batch norm's statistics over it too (one process: tch's layers as they are)
    let plan = Plan::new().replicate(DdpOptions::default().process_group(pg.clone()));
    let plan = if args.local_bn { plan } else { plan.sync_batch_norm(pg.clone()) };
    let vs = nn::VarStore::new(Device::Cpu);
    tch::manual_seed(1);
    let model = {
        let _plan = plan.enter();
        resnet(&vs.root(), args.width)
    };
    let model = plan.finish(&vs, model)?;
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05)?;

    let local_batch = (GLOBAL_BATCH / world) as usize;
    // each rank's share of every epoch; a global batch is the union of the ranks' local batches
    let mut sampler = DistributedSampler::for_group(TRAIN as usize, &pg, SamplerOptions::default().seed(100))?;
    let mut out = match (&args.losses, rank) {
        (Some(f), 0) => Some(std::fs::File::create(f).map_err(|e| format!("--losses {f}: {e}"))?),
        _ => None,
    };
    let mut step = 0;
    let mut accuracy = 0.0;
    for epoch in 0..args.epochs {
        sampler.set_epoch(epoch as u64);
        let mut sum = 0.0;
        let mut n = 0;
        for (xb, yb) in Batches::new(&xtr, &ytr, sampler.indices()?, local_batch)?.drop_last() {
            let loss = xb.apply_t(&model, true).cross_entropy_for_logits(&yb);
            model.backward(&loss)?;
            opt.step();
            model.zero_grad()?;
            let mut l = loss.detach().view([1]);
            pg.allreduce(&mut l, ReduceOp::Avg)?;
            let l = l.double_value(&[0]);
            if let Some(f) = out.as_mut() {
                writeln!(f, "{step} {l:.8}")?;
            }
            sum += l;
            n += 1;
            step += 1;
        }
        // evaluation: running statistics, no collective (every rank computes the same)
        accuracy = tch::no_grad(|| xte.apply_t(&model, false).accuracy_for_logits(&yte)).double_value(&[]);
        if rank == 0 {
            println!("epoch {:>2}  loss {:.4}  test accuracy {:.2}%", epoch + 1, sum / n as f64, 100.0 * accuracy);
        }
    }
    if rank == 0 {
        println!("final test accuracy {:.2}% (world size {world}, global batch {GLOBAL_BATCH})", 100.0 * accuracy);
    }
    pg.barrier()?;
    Ok(())
}
