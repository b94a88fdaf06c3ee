//! The forum question, in Rust: "my model takes twice the memory under DDP; why, and can I avoid it?"
//!
//! One rank per process, started with torchrun's environment (scripts/demo.sh starts both ranks, and the
//! PyTorch twin scripts/forum_repro.py, and prints them side by side). Prints `rank <r> <stage> <bytes>`
//! at the same points as the forum's program: start, model created, model on device, wrapped in DDP,
//! after one backward, and after an optimizer step and zero_grad (tch's `nn::Sgd`; PyTorch's SGD).
//!   forum_repro [--view on|off] [--device cpu|cuda]
use std::sync::Arc;

use clap::Parser;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::DistModule;
use tch_dist::{memory, Backend, InitOptions, ProcessGroup};

#[derive(Parser)]
struct Args {
    /// gradient_as_bucket_view: on or off
    #[arg(long, default_value = "on")]
    view: String,
    /// cpu or cuda
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let view = args.view == "on";
    let device = match args.device.as_str() {
        "cuda" => Device::Cuda(0), // both ranks share one GPU, as Gloo allows
        "cpu" => Device::Cpu,
        other => return Err(format!("--device must be cpu or cuda, not {other:?}").into()),
    };
    if device == Device::Cpu {
        memory::install_cpu_counter()?;
    }
    // Gloo's worker threads drop their references to a finished collective's buffers a moment after
    // wait() returns; read once the number stops moving (the PyTorch twin does the same).
    // (unchanged for 50 ms: on a loaded machine the release can come milliseconds late; give up after 2 s)
    let mem = || -> tch_dist::Result<i64> {
        let (mut last, mut still) = (memory::allocated(device)?, 0);
        for _ in 0..1000 {
            std::thread::sleep(std::time::Duration::from_millis(2));
            let now = memory::allocated(device)?;
            still = if now == last { still + 1 } else { 0 };
            last = now;
            if still == 25 {
                break;
            }
        }
        Ok(last)
    };
    let init = InitOptions::from_env()?;
    let rank = init.rank;
    let report = |stage: &str| -> tch_dist::Result<()> {
        println!("rank {rank} {stage} {}", mem()?);
        Ok(())
    };
    report("start")?;
    // Created on the CPU, then moved, as the forum's model.to(device).
    let mut vs = nn::VarStore::new(Device::Cpu);
    let _created_on_cpu = nn::linear(vs.root(), 1000, 1000, Default::default());
    report("model created")?;
    vs.set_device(device);
    // set_device replaces the variables, so the layer is taken again from the store.
    let model = nn::Linear { ws: vs.root().get("weight").ok_or("no weight")?, bs: vs.root().get("bias") };
    report("model on device")?;
    let pg = Arc::new(ProcessGroup::init(&InitOptions { backend: Some(Backend::Gloo.into()), ..init })?);
    let ddp = DistributedDataParallel::new(
        &vs,
        model,
        DdpOptions::default().gradient_as_bucket_view(view).process_group(pg),
    )?;
    report("wrapped in DDP")?;
    {
        let x = Tensor::randn([20, 1000], (Kind::Float, Device::Cpu)).to_device(device);
        let loss = ddp.f_forward(&x)?.sum(Kind::Float);
        ddp.backward(&loss)?;
    }
    report("after one backward")?;
    // tch's own optimizer, as a tch user writes it: its zero_grad sets the gradients to none (PyTorch's
    // set_to_none), and works although they live in DDP's buckets
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    opt.step();
    opt.zero_grad();
    report("after step and zero_grad")?;
    let m = ddp.memory_breakdown()?;
    println!(
        "breakdown rank {rank}: parameters {} B, gradients outside buckets {} B, buckets {} B",
        m.parameters, m.gradients, m.buckets
    );
    Ok(())
}
