//! One rank of the tensor-parallel benchmark (scripts/bench-tp.sh runs it with WORLD_SIZE 1 and 2):
//! Megatron MLP d=1024, h=8192, batch 64, SGD. Rank 0 prints
//! `tp <size> param_bytes <per-rank bytes of parameters> step <median seconds> peak <peak bytes>`
//! (scripts/bench_tp.py prints the same for PyTorch's DTensor TP).
use std::sync::Arc;
use std::time::Instant;

use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::tp::ParallelMlp;
use tch_dist::{memory, ProcessGroup};

const D: i64 = 1024;
const H: i64 = 8192;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::set_num_threads(1); // one core per rank on this 2-core machine
    memory::install_cpu_counter()?;
    let pg = Arc::new(ProcessGroup::from_env()?);
    let vs = nn::VarStore::new(Device::Cpu);
    let before = memory::allocated(Device::Cpu)?;
    let mlp = ParallelMlp::new(&vs.root(), D, H, pg.clone(), 0)?; // full matrices drawn, then sliced
    let param_bytes = memory::allocated(Device::Cpu)? - before;
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    let mut times = Vec::new();
    for step in 0..10 {
        tch::manual_seed(100 + step);
        let x = Tensor::randn([64, D], (Kind::Float, Device::Cpu));
        let y = Tensor::randn([64, D], (Kind::Float, Device::Cpu));
        pg.barrier()?;
        let t = Instant::now();
        let out = mlp.f_forward(&x)?;
        out.mse_loss(&y, tch::Reduction::Mean).f_backward()?;
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
