//! One rank of the checkpoint benchmark (scripts/bench-checkpoint.sh runs it and the PyTorch twin
//! scripts/bench_checkpoint.py, which uses torch.distributed.checkpoint). The bench-memory model (24
//! Linear(1024, 1024), 25.2M parameters) with AdamW state after one step: ~302 MB of state.
//!   --mode ddp|zero3   DDP + AdamW (every rank holds everything: replicated chunks are written once,
//!                      spread over the ranks) or FSDP + AdamW (each rank writes its shards)
//!   --dir DIR          where to write (removed as it goes)
//!   --reps N           repetitions; medians reported
//! Each repetition: a synchronous save; an asynchronous save (the stall: until `async_save` returns; the
//! total: until it is committed); a load of the first. Durations are the slowest rank's. Rank 0 prints
//! `save_s stall_s async_total_s load_s bytes_on_disk`.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::checkpoint::{Checkpointer, StateDict};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions, FullyShardedDataParallel};
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::DistModule;
use tch_dist::{ProcessGroup, ReduceOp};

const WIDTH: i64 = 1024;
const LAYERS: usize = 24;
const BATCH: i64 = 16;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "ddp")]
    mode: String,
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

enum Model {
    Ddp(nn::VarStore, DistributedDataParallel<nn::Sequential>),
    Fsdp(nn::VarStore, FullyShardedDataParallel<nn::Sequential>),
}

impl Model {
    fn state<'a>(&self, opt: &'a mut AdamW) -> StateDict<'a> {
        let mut sd = StateDict::new();
        match self {
            Model::Ddp(vs, _) | Model::Fsdp(vs, _) => sd.var_store("model", vs),
        };
        sd.optimizer("optim", opt);
        sd
    }
}

fn slowest(pg: &ProcessGroup, secs: f64) -> tch_dist::Result<f64> {
    let mut t = Tensor::from_slice(&[secs]);
    pg.allreduce(&mut t, ReduceOp::Max)?;
    Ok(t.double_value(&[0]))
}

fn bytes_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir).into_iter().flatten().flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let pg = Arc::new(ProcessGroup::from_env()?);
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = match args.mode.as_str() {
        "ddp" => {
            let mut net = nn::seq();
            for i in 0..LAYERS {
                net = net.add(nn::linear(vs.root() / format!("l{i}"), WIDTH, WIDTH, Default::default()));
                if i + 1 < LAYERS {
                    net = net.add_fn(|x| x.relu());
                }
            }
            let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
            Model::Ddp(vs, ddp)
        }
        "zero3" => {
            let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg.clone()))?;
            let mut net = nn::seq();
            for i in 0..LAYERS {
                let path = vs.root() / format!("l{i}");
                net = net.add(fsdp.fully_shard(&path, nn::linear(&path, WIDTH, WIDTH, Default::default()))?);
                if i + 1 < LAYERS {
                    net = net.add_fn(|x| x.relu());
                }
            }
            let f = fsdp.finish(net)?;
            Model::Fsdp(vs, f)
        }
        other => return Err(format!("--mode {other}: expected ddp or zero3").into()),
    };
    let mut opt = match &model {
        Model::Ddp(vs, _) => AdamW::new(vs.trainable_variables(), 1e-3),
        Model::Fsdp(_, f) => AdamW::new(f.parameters(), 1e-3),
    };
    // one step, so the optimizer has its state
    tch::manual_seed(1000 + pg.rank() as i64);
    let (x, y) = (
        Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu)),
        Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu)),
    );
    match &model {
        Model::Ddp(_, d) => d.backward(&d.forward(&x).mse_loss(&y, tch::Reduction::Mean))?,
        Model::Fsdp(_, f) => f.backward(&f.forward(&x).mse_loss(&y, tch::Reduction::Mean))?,
    }
    opt.step()?;
    opt.zero_grad()?;

    let root = args.dir.join("ours");
    let mut ck = Checkpointer::new(pg.clone(), &root)?;
    let (mut save, mut stall, mut total, mut load, mut bytes) = (vec![], vec![], vec![], vec![], 0);
    for rep in 0..args.reps as u64 {
        let step = 10 * (rep + 1);
        pg.barrier()?;
        let t = Instant::now();
        ck.save(step, &model.state(&mut opt))?;
        save.push(slowest(&pg, t.elapsed().as_secs_f64())?);

        pg.barrier()?;
        let t = Instant::now();
        ck.async_save(step + 1, &model.state(&mut opt))?;
        let s = t.elapsed().as_secs_f64();
        ck.wait()?;
        let all = t.elapsed().as_secs_f64();
        stall.push(slowest(&pg, s)?);
        total.push(slowest(&pg, all)?);

        pg.barrier()?;
        let t = Instant::now();
        ck.load_step(step, &mut model.state(&mut opt))?;
        load.push(slowest(&pg, t.elapsed().as_secs_f64())?);

        pg.barrier()?;
        if pg.rank() == 0 {
            bytes = bytes_under(&tch_dist::checkpoint::step_dir(&root, step));
            let _ = std::fs::remove_dir_all(&root);
        }
        pg.barrier()?;
    }
    if pg.rank() == 0 {
        println!("{:.4} {:.4} {:.4} {:.4} {bytes}", median(save), median(stall), median(total), median(load));
    }
    pg.barrier()?;
    Ok(())
}
