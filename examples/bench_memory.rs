//! One rank of the memory benchmark (scripts/bench-memory.sh runs it and the PyTorch twin
//! scripts/bench_memory.py on 2 ranks). 24 Linear(1024, 1024) layers with ReLU between them (25.2M
//! parameters), batch 16 per rank, MSE loss, AdamW.
//!   --mode ddp|zero1|zero2|zero3   plain DDP + AdamW, ShardedOptimizer stage 1 / 2, or FSDP (each
//!                            Linear a unit, the root holding nothing; PyTorch's twin: fully_shard)
//!   --bf16                   bfloat16 parameters with float32 master weights (ZeRO-1/2), or bfloat16
//!                            compute with float32 shards (ZeRO-3)
//!   --bucket-mb X            DDP bucket cap (25 by default)
//!   --keep                   ZeRO-3: keep units gathered from forward to backward
//!   --checkpoint             ZeRO-3: each Linear + ReLU recomputed in backward
//!   --fused                  AdamW's fused kernel (PyTorch's twin: AdamW(fused=True))
//!   --gather-once-below N    ZeRO-3: FsdpOptions::gather_once_below (0: each bias gathered with its layer)
//!   --hsdp R                 ZeRO-3 as HSDP: shard within groups of world/R ranks, replicate across R
//!                            (FsdpOptions::mesh over [replicate R, shard world/R])
//! Rank 0 prints `median_step_s peak_rank0 peak_rank1 params grads state master grad_shards` (bytes).
//! With `BENCH_LINK=1`, on nodes of scripts/shaped-links.sh, it also prints `link BYTES`: what crossed
//! between nodes per timed step (the nodes' `to*` links' sent bytes, both directions).
//! `BENCH_STEPS=N` times N steps instead of 5 (the page-fault counts per step in docs/bench-memory.md
//! come from the difference of two runs); `BENCH_TRACE=1` prints each step's phases.
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tch::{nn, Device, Kind, Tensor};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::FsdpOptions;
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;
use tch_dist::{memory, ProcessGroup};

const WIDTH: i64 = 1024;
const LAYERS: usize = 24;
const BATCH: i64 = 16;
const WARMUP: usize = 2;
const STEPS: usize = 5;

#[derive(Parser)]
struct Args {
    /// ddp, zero1 or zero2
    #[arg(long, default_value = "ddp")]
    mode: String,
    /// bfloat16 parameters with float32 master weights (ZeRO modes)
    #[arg(long)]
    bf16: bool,
    /// DDP bucket cap
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// ZeRO-3: reshard_after_forward off
    #[arg(long)]
    keep: bool,
    /// ZeRO-3: activation checkpointing of each layer
    #[arg(long)]
    checkpoint: bool,
    /// AdamW's fused kernel
    #[arg(long)]
    fused: bool,
    /// ZeRO-3: FsdpOptions::gather_once_below (elements; 0 turns it off; the engine's default if absent)
    #[arg(long)]
    gather_once_below: Option<usize>,
    /// ZeRO-3 as HSDP: replicas of this many (shards within groups of world / R ranks)
    #[arg(long)]
    hsdp: Option<usize>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tch::set_num_threads(1); // two ranks share two cores
    memory::install_cpu_counter()?;
    let pg = Arc::new(ProcessGroup::from_env()?);
    if args.mode == "zero3" {
        return zero3(&args, pg);
    }
    let (mode, bf16, bucket_mb) = (args.mode, args.bf16, args.bucket_mb);
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let mut net = nn::seq();
    for i in 0..LAYERS {
        net = net.add(nn::linear(vs.root() / format!("l{i}"), WIDTH, WIDTH, Default::default()));
        if i + 1 < LAYERS {
            net = net.add_fn(|x| x.relu());
        }
    }
    let kind = if bf16 { Kind::BFloat16 } else { Kind::Float };
    if bf16 {
        vs.bfloat16();
    }
    // a 1 MiB first bucket, as measured for the README (PyTorch 2.13 makes it the cap when a cap is given)
    let opts = DdpOptions::default().process_group(pg.clone()).bucket_cap_mb(bucket_mb).first_bucket_bytes(1 << 20);
    let ddp = DistributedDataParallel::new(&vs, net, opts)?;
    if std::env::var_os("BENCH_TRACE").is_some() && pg.rank() == 0 {
        eprintln!("built: allocated {} peak {}", memory::allocated(Device::Cpu)?, memory::peak(Device::Cpu)?);
    }
    let fused = args.fused;
    let adamw = move |p: Vec<Tensor>| -> Box<dyn Optimizer + Send> { Box::new(AdamW::new(p, 1e-3).fused(fused)) };
    let mut opt: Box<dyn Optimizer> = match mode.as_str() {
        "ddp" if !bf16 => adamw(vs.trainable_variables()),
        "zero1" => Box::new(ShardedOptimizer::new(&ddp, ZeroStage::One, adamw)?),
        "zero2" => Box::new(ShardedOptimizer::new(&ddp, ZeroStage::Two, adamw)?),
        other => {
            return Err(format!(
                "--mode {other}{}: expected ddp, zero1 or zero2 (--bf16 needs a ZeRO mode)",
                if bf16 { " --bf16" } else { "" }
            )
            .into())
        }
    };
    let median = timed_steps(&pg, kind, |x, y, start| {
        let loss = ddp.f_forward(x)?.to_kind(Kind::Float).mse_loss(y, tch::Reduction::Mean);
        let forward_done = start.elapsed().as_secs_f64();
        ddp.backward(&loss)?;
        let backward_done = start.elapsed().as_secs_f64();
        opt.step()?;
        opt.zero_grad()?;
        Ok((forward_done, backward_done))
    })?;
    let m = ddp.memory_breakdown_with(opt.as_ref())?;
    report(&pg, median, [m.parameters, m.buckets + m.gradients, m.optimizer_state, m.master_params, m.gradient_shards])
}

/// The same training under FSDP: every Linear a unit (built and sharded one at a time), AdamW over the
/// shards, gradients set to none after each step (PyTorch's `zero_grad()`).
fn zero3(args: &Args, pg: Arc<ProcessGroup>) -> Result<(), Box<dyn std::error::Error>> {
    use tch::nn::Module;
    use tch_dist::fsdp::FsdpBuilder;
    use tch_dist::recompute::Checkpointed;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut opts = FsdpOptions::default().process_group(pg.clone()).reshard_after_forward(!args.keep);
    if let Some(n) = args.gather_once_below {
        opts = opts.gather_once_below(n);
    }
    if let Some(r) = args.hsdp {
        let mesh = tch_dist::mesh::DeviceMesh::new(&pg, &[("replicate", r), ("shard", pg.size() / r.max(1))])?;
        opts = opts.mesh(&mesh, &["replicate", "shard"])?;
    }
    if args.bf16 {
        opts = opts.param_dtype(Kind::BFloat16);
    }
    let fsdp = FsdpBuilder::new(&vs, opts)?;
    let mut net = nn::seq();
    for i in 0..LAYERS {
        let path = vs.root() / format!("l{i}");
        let unit = fsdp.fully_shard(&path, nn::linear(&path, WIDTH, WIDTH, Default::default()))?;
        let relu = i + 1 < LAYERS;
        net = match (args.checkpoint, relu) {
            (true, true) => net.add(Checkpointed::new(nn::seq().add(unit).add_fn(|x| x.relu()))),
            (true, false) => net.add(Checkpointed::new(unit)),
            (false, true) => net.add(unit).add_fn(|x| x.relu()),
            (false, false) => net.add(unit),
        };
    }
    let model = fsdp.finish(net)?;
    let mut opt = AdamW::new(model.parameters(), 1e-3).fused(args.fused);
    let phases = std::env::var_os("BENCH_PHASES").is_some() && pg.rank() == 0;
    let mark = |what: &str| -> Res<()> {
        if phases {
            eprintln!("  {what}: peak {} now {}", memory::peak(Device::Cpu)?, memory::allocated(Device::Cpu)?);
            memory::reset_peak(Device::Cpu)?;
        }
        Ok(())
    };
    let median = timed_steps(&pg, Kind::Float, |x, y, start| {
        mark("before")?;
        let loss = model.forward(x).to_kind(Kind::Float).mse_loss(y, tch::Reduction::Mean);
        mark("forward")?;
        let forward_done = start.elapsed().as_secs_f64();
        model.backward(&loss)?;
        mark("backward")?;
        let backward_done = start.elapsed().as_secs_f64();
        opt.step()?;
        mark("step")?;
        model.zero_grad()?;
        Ok((forward_done, backward_done))
    })?;
    let m = model.memory_breakdown_with(&opt)?;
    let params = m.sharded_parameters + m.gathered_parameters;
    report(&pg, median, [params, m.unsharded_gradients, m.optimizer_state, 0, m.gradient_shards])
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// WARMUP + STEPS steps on seeded batches (inputs in `kind`), each after a barrier; `one` runs forward,
/// backward and the optimizer and returns when forward and backward ended (seconds since `start`).
/// `BENCH_TRACE=1` prints each step's times and memory (rank 0). Returns the median step time.
fn timed_steps(
    pg: &ProcessGroup,
    kind: Kind,
    mut one: impl FnMut(&Tensor, &Tensor, &Instant) -> Res<(f64, f64)>,
) -> Res<f64> {
    let rank = pg.rank() as i64;
    let mut times = Vec::new();
    let steps: usize = std::env::var("BENCH_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(STEPS);
    let mut link = 0;
    for step in 0..WARMUP + steps {
        if step == WARMUP {
            pg.barrier()?;
            link = link_bytes();
        }
        tch::manual_seed(1000 + step as i64 * 10 + rank);
        let x = Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu)).to_kind(kind);
        let y = Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu));
        pg.barrier()?;
        let start = Instant::now();
        let (forward_done, backward_done) = one(&x, &y, &start)?;
        let t = start.elapsed().as_secs_f64();
        if std::env::var_os("BENCH_TRACE").is_some() && rank == 0 {
            eprintln!(
                "step {step}: allocated {} peak {} forward {forward_done:.3}s backward {:.3}s step {:.3}s",
                memory::allocated(Device::Cpu)?,
                memory::peak(Device::Cpu)?,
                backward_done - forward_done,
                t - backward_done
            );
        }
        if step >= WARMUP {
            times.push(t);
        }
    }
    pg.barrier()?;
    report_link(pg, (link_bytes() - link) / steps as i64)?;
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// Bytes this node has sent to the others: the `to<K>` links of a scripts/shaped-links.sh node (0
/// elsewhere).
fn link_bytes() -> i64 {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else { return 0 };
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("to"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("statistics/tx_bytes")).ok()?.trim().parse::<i64>().ok())
        .sum()
}

/// With `BENCH_LINK` set, rank 0 prints `link BYTES`: the bytes each node's local rank 0 saw its node
/// send per step, summed over the nodes.
fn report_link(pg: &ProcessGroup, mine: i64) -> Res<()> {
    if std::env::var_os("BENCH_LINK").is_none() {
        return Ok(());
    }
    let local0 = std::env::var("LOCAL_RANK").map_or(true, |l| l == "0");
    let mut all: Vec<Tensor> = (0..pg.size()).map(|_| Tensor::zeros([1], (Kind::Int64, Device::Cpu))).collect();
    pg.all_gather(&mut all, &Tensor::from_slice(&[if local0 { mine } else { 0 }]))?;
    if pg.rank() == 0 {
        println!("link {}", all.iter().map(|t| t.int64_value(&[0])).sum::<i64>());
    }
    Ok(())
}

/// Rank 0 prints `median_step_s peak_rank0 peak_rank1 ... parameters gradients state master shards`.
fn report(pg: &ProcessGroup, median: f64, bytes: [i64; 5]) -> Res<()> {
    let peak = memory::peak(Device::Cpu)?;
    let mut peaks: Vec<Tensor> = (0..pg.size()).map(|_| Tensor::zeros([1], (Kind::Int64, Device::Cpu))).collect();
    pg.all_gather(&mut peaks, &Tensor::from_slice(&[peak]))?;
    if pg.rank() == 0 {
        let peaks: Vec<String> = peaks.iter().map(|t| t.int64_value(&[0]).to_string()).collect();
        let bytes: Vec<String> = bytes.iter().map(|b| b.to_string()).collect();
        println!("{median:.6} {} {}", peaks.join(" "), bytes.join(" "));
    }
    Ok(())
}
