//! One rank of the tensor-parallel benchmark (scripts/bench-tp.sh runs it with WORLD_SIZE 1 and 2):
//! Megatron MLP d=1024, h=8192, batch 64, SGD; or with `--block attention`, self-attention d=1024, 16
//! heads, batch 8 x sequence 128 (ParallelAttention). Rank 0 prints
//! `tp <size> param_bytes <per-rank bytes of parameters> step <median seconds> peak <peak bytes>`
//! (scripts/bench_tp.py prints the same for PyTorch's DTensor TP).
use std::sync::Arc;
use std::time::Instant;

use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::tp::{ParallelAttention, ParallelMlp};
use tch_dist::{memory, ProcessGroup};

const D: i64 = 1024;
const H: i64 = 8192;
const HEADS: i64 = 16;
const SEQ: i64 = 128;

/// The block's forward.
type Block = Box<dyn Fn(&Tensor) -> tch_dist::Result<Tensor>>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::set_num_threads(1); // one core per rank on this 2-core machine
    memory::install_cpu_counter()?;
    let pg = Arc::new(ProcessGroup::from_env()?);
    let attention = std::env::args().any(|a| a == "attention");
    let vs = nn::VarStore::new(Device::Cpu);
    let before = memory::allocated(Device::Cpu)?;
    // full matrices drawn (the same on every rank), then sliced
    let block: Block = if attention {
        tch::manual_seed(0);
        let u = |shape: &[i64]| Tensor::empty(shape, (Kind::Float, Device::Cpu)).uniform_(-0.03, 0.03);
        let a = ParallelAttention::from_full(
            &vs.root(),
            &u(&[3 * D, D]),
            &u(&[3 * D]),
            &u(&[D, D]),
            &u(&[D]),
            HEADS,
            pg.clone(),
            Default::default(),
        )?;
        Box::new(move |x| a.f_forward(x))
    } else {
        let mlp = ParallelMlp::new(&vs.root(), D, H, pg.clone())?;
        Box::new(move |x| mlp.f_forward(x))
    };
    let param_bytes = memory::allocated(Device::Cpu)? - before;
    if std::env::var_os("BENCH_PHASES").is_some() {
        eprintln!("built: allocated {} peak {}", memory::allocated(Device::Cpu)?, memory::peak(Device::Cpu)?);
    }
    let shape: &[i64] = if attention { &[8, SEQ, D] } else { &[64, D] };
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    let mut times = Vec::new();
    for step in 0..10 {
        tch::manual_seed(100 + step);
        let x = Tensor::randn(shape, (Kind::Float, Device::Cpu));
        let y = Tensor::randn(shape, (Kind::Float, Device::Cpu));
        pg.barrier()?;
        let t = Instant::now();
        let phases = std::env::var_os("BENCH_PHASES").is_some() && step == 3;
        if phases {
            memory::reset_peak(Device::Cpu)?;
        }
        let out = block(&x)?;
        if phases {
            eprintln!("forward: allocated {} peak {}", memory::allocated(Device::Cpu)?, memory::peak(Device::Cpu)?);
        }
        out.mse_loss(&y, tch::Reduction::Mean).f_backward()?;
        if phases {
            eprintln!("backward: allocated {} peak {}", memory::allocated(Device::Cpu)?, memory::peak(Device::Cpu)?);
        }
        opt.step();
        tch_dist::hooks::zero_grads(&vs.trainable_variables())?;
        if step >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    if pg.rank() == 0 {
        let peak = memory::peak(Device::Cpu)?;
        println!("tp {} param_bytes {param_bytes} step {:.6} peak {peak}", pg.size(), times[times.len() / 2]);
    }
    Ok(())
}
