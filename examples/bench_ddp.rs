//! One rank of the DDP benchmark (scripts/bench-ddp.sh runs it and the PyTorch twin
//! scripts/bench_ddp.py on 2 ranks and compares). MLP of ~25M parameters, SGD, MSE loss.
//! Prints `median_step_seconds peak_bytes` from rank 0. `--view on|off`, `--no-ddp` for the
//! single-process baseline (run with WORLD_SIZE=1).
use std::sync::Arc;
use std::time::Instant;

use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::{memory, ProcessGroup};

const DIMS: [i64; 4] = [1024, 4096, 4096, 1024];
const BATCH: i64 = 32;
const WARMUP: usize = 2;
const STEPS: usize = 8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let view = !args.windows(2).any(|w| w[0] == "--view" && w[1] == "off");
    let no_ddp = args.iter().any(|a| a == "--no-ddp");
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
    let model = if no_ddp {
        Model::Plain(net)
    } else {
        let opts = DdpOptions::default().gradient_as_bucket_view(view).process_group(pg.clone());
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
        println!("{:.6} {}", times[times.len() / 2], memory::peak(Device::Cpu)?);
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
