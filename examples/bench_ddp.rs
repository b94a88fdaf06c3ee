//! One rank of the DDP benchmark (scripts/bench-ddp.sh runs it and the PyTorch twin
//! scripts/bench_ddp.py on 2 ranks under tchrun and compares). MLP of ~25M parameters, SGD, MSE loss.
//! Prints `median_step_seconds peak_bytes [compression_ratio]` from rank 0.
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel, PowerSgd, PowerSgdOptions};
use tch_dist::DistModule;
use tch_dist::{memory, ProcessGroup};

#[derive(Parser)]
struct Args {
    /// gradient_as_bucket_view
    #[arg(long, default_value = "on")]
    view: String,
    /// The single-process baseline (run with one rank).
    #[arg(long)]
    no_ddp: bool,
    /// PowerSGD of this rank (start after the warm-up steps, warm start, error feedback).
    #[arg(long)]
    powersgd: Option<i64>,
    /// bucket_cap_mb (PyTorch's default when absent).
    #[arg(long)]
    bucket_mb: Option<f64>,
    /// A compression hook: fp16 or bf16 (PyTorch's fp16_compress_hook, bf16_compress_hook).
    #[arg(long)]
    hook: Option<String>,
}

const DIMS: [i64; 4] = [1024, 4096, 4096, 1024];
const BATCH: i64 = 32;
const WARMUP: usize = 2;
const STEPS: usize = 8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (view, no_ddp) = (args.view != "off", args.no_ddp);
    tch::set_num_threads(1); // two ranks share two cores
    memory::install_cpu_counter()?;
    let pg = Arc::new(ProcessGroup::from_env()?);
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut net = nn::seq();
    for (i, w) in DIMS.windows(2).enumerate() {
        net = net.add(nn::linear(vs.root() / format!("l{i}"), w[0], w[1], Default::default()));
        if i + 2 < DIMS.len() {
            net = net.add_fn(|x| x.relu());
        }
    }
    let mut hook = None;
    let model = if no_ddp {
        Model::Plain(net)
    } else {
        let mut opts = DdpOptions::default().gradient_as_bucket_view(view).process_group(pg.clone());
        if let Some(mb) = args.bucket_mb {
            opts = opts.bucket_cap_mb(mb);
        }
        match args.hook.as_deref() {
            Some("fp16") => opts = opts.comm_hook(tch_dist::ddp::comm_hook::fp16_compress()),
            Some("bf16") => opts = opts.comm_hook(tch_dist::ddp::comm_hook::bf16_compress()),
            Some(h) => return Err(format!("--hook {h}: fp16 or bf16").into()),
            None => {}
        }
        if let Some(r) = args.powersgd {
            let h = Arc::new(PowerSgd::new(PowerSgdOptions::default().rank(r).start_iter(WARMUP as u64))?);
            opts = opts.comm_hook(h.clone());
            hook = Some(h);
        }
        Model::Ddp(DistributedDataParallel::new(&vs, net, opts)?)
    };
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    let rank = pg.rank() as i64;
    let mut times = Vec::new();
    for step in 0..WARMUP + STEPS {
        tch::manual_seed(1000 + step as i64 * 10 + rank);
        let x = Tensor::randn([BATCH, DIMS[0]], (Kind::Float, Device::Cpu));
        let y = Tensor::randn([BATCH, DIMS[DIMS.len() - 1]], (Kind::Float, Device::Cpu));
        pg.barrier()?;
        let start = Instant::now();
        model.step(&x, &y, &mut opt, &vs)?;
        if step >= WARMUP {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    if pg.rank() == 0 {
        // what the flight recorder costs a step: operations recorded per step, times the cost of one
        // (the timeline's count first: the recorder's probe below lands in it too)
        let events = tch_dist::timeline::recorded() as f64 / (WARMUP + STEPS) as f64;
        let per_step = tch_dist::flight::entries().last().map_or(0, |e| e.id) as f64 / (WARMUP + STEPS) as f64;
        println!("flight {per_step:.1} {:.3}", 1e6 * tch_dist::flight::probe(10_000));
        if tch_dist::timeline::enabled() {
            // likewise the timeline: events per step (spans and collectives), times the cost of one
            println!("timeline {events:.1} {:.3}", 1e6 * tch_dist::timeline::probe(10_000));
        }
        let ratio = hook.map_or(String::new(), |h| format!(" {:.2}", h.compression().ratio()));
        println!("{:.6} {}{ratio}", times[times.len() / 2], memory::peak(Device::Cpu)?);
    }
    Ok(())
}

enum Model {
    Plain(nn::Sequential),
    Ddp(DistributedDataParallel<nn::Sequential>),
}

impl Model {
    fn step(&self, x: &Tensor, y: &Tensor, opt: &mut nn::Optimizer, vs: &nn::VarStore) -> tch_dist::Result<()> {
        match self {
            Model::Plain(net) => {
                net.forward(x).mse_loss(y, tch::Reduction::Mean).f_backward()?;
                opt.step();
                tch_dist::hooks::zero_grads(&vs.trainable_variables())?;
            }
            Model::Ddp(ddp) => {
                ddp.backward(&ddp.f_forward(x)?.mse_loss(y, tch::Reduction::Mean))?;
                opt.step();
                ddp.zero_grad()?;
            }
        }
        Ok(())
    }
}
