//! The GPU kit's checks. `scripts/gpu-kit.sh` builds this (with the `cuda` feature, for the lent
//! machine's libtorch) and `gpu-kit/run.sh` runs it there, one check per process, so a crash costs one
//! check, not the run.
//!
//!   gpu_kit list                          the single-process checks, one per line
//!   gpu_kit check NAME [--device cuda]    one check: prints `PASS NAME: ...`, `FAIL NAME: ...`, or
//!                                         `SKIP NAME: no CUDA device`
//!   gpu_kit selfcheck                     libtorch loads and a Gloo collective runs (the kit's own health)
//!   gpu_kit rank-list                     the two-process checks, one per line
//!   gpu_kit rank NAME [--device cuda]     one rank of a two-process Gloo check (started by tchrun)
//!   gpu_kit bench-ddp | bench-allreduce   the Rust side of the benchmarks (the PyTorch side is torch_gpu.py)
//!
//! Every check compares the GPU against the same computation on the CPU. `--device cpu` runs the "GPU"
//! side on the CPU too: CI runs every check that way (tests/models/gpu_kit.rs), so the comparisons themselves are
//! tested where there is no GPU.
use std::collections::BTreeMap;
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use tch::{nn, nn::Module, nn::ModuleT, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::amp::{autocast, GradScaler};
use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions, FullyShardedDataParallel};
use tch_dist::moe::{Moe, MoeConfig};
use tch_dist::optim::{clip_grad_norm, AdamW, Optimizer, Sgd};
use tch_dist::pipeline::schedule::ScheduleKind;
use tch_dist::pipeline::split::SplitModel;
use tch_dist::pipeline::{LayerList, Partition, Pipeline, PipelineConfig, PipelineRank};
use tch_dist::recompute::Checkpointed;
use tch_dist::tp::{ParallelAttention, ParallelAttentionConfig, ParallelMlp};
use tch_dist::zero::{ShardedOptimizer, ZeroStage};
use tch_dist::DistModule;
use tch_dist::P2pOp;
use tch_dist::{checkpoint, memory, Backend, BackendConfig, GroupOptions, InitOptions, ProcessGroup, ReduceOp, Store};

type Res<T> = Result<T, Box<dyn Error>>;

#[derive(Parser)]
#[command(name = "gpu_kit", about = "The GPU kit's checks and benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The single-process checks, one per line.
    List,
    /// Runs one check.
    Check {
        name: String,
        #[arg(long, default_value = "cuda")]
        device: String,
    },
    /// Loads libtorch and runs a one-rank Gloo allreduce on the CPU.
    Selfcheck,
    /// The two-process checks, one per line.
    RankList,
    /// One rank of a two-process check (started by tchrun): both ranks on one GPU over Gloo.
    Rank {
        name: String,
        #[arg(long, default_value = "cuda")]
        device: String,
    },
    /// DDP step time and peak memory on one GPU (NCCL, one rank).
    BenchDdp {
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
    /// NCCL allreduce bandwidth, 1 MiB to 1 GiB (one rank).
    BenchAllreduce {
        #[arg(long, default_value_t = 20)]
        iters: usize,
    },
    /// The process `nccl-lifecycle` starts and reads (its stderr is the check).
    #[command(hide = true)]
    NcclLifecycleChild,
}

/// A check passed (with what it measured) or did not apply.
enum Outcome {
    Pass(String),
    Skip(String),
}
use Outcome::{Pass, Skip};

type Check = fn(Device) -> Res<Outcome>;

const CHECKS: &[(&str, Check)] = &[
    ("nccl-refuses-cpu-tensors", nccl_refuses_cpu_tensors),
    ("group-cpu-gloo-cuda-nccl", group_cpu_gloo_cuda_nccl),
    ("ddp-views-on", |d| ddp_step(d, true, false)),
    ("ddp-views-off", |d| ddp_step(d, false, false)),
    ("ddp-default-group-unused", |d| ddp_step(d, true, true)),
    ("zero1", |d| zero_step(d, ZeroStage::One)),
    ("zero2", |d| zero_step(d, ZeroStage::Two)),
    ("tp-mlp", tp_mlp),
    ("moe", moe),
    ("ring-attention", ring_attention),
    ("amp-bf16", amp_bf16),
    ("amp-fp16-scaler", amp_fp16_scaler),
    ("checkpoint", checkpoint_round_trip),
    ("split-one-gpu", split),
    ("pipeline-1f1b", pipeline_1f1b),
    ("fsdp", |d| fsdp_step(d, false, false)),
    ("fsdp-offload", |d| fsdp_step(d, true, false)),
    ("fsdp-fused-adamw", |d| fsdp_step(d, false, true)),
    ("recompute-dropout", recompute_dropout),
    ("async-wait", async_wait),
    ("streams", streams),
    ("sync-free-steps", sync_free_steps),
    ("nccl-lifecycle", nccl_lifecycle),
    ("device-from-env", device_from_env),
];

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::List => {
            CHECKS.iter().for_each(|(n, _)| println!("{n}"));
            0
        }
        Cmd::Check { name, device } => run_check(&name, &device),
        Cmd::Selfcheck => report("selfcheck", selfcheck()),
        Cmd::RankList => {
            RANK_CHECKS.iter().for_each(|n| println!("{n}"));
            0
        }
        Cmd::Rank { name, device } => {
            let shown = format!("gloo-2proc-{name}");
            match device_of(&device) {
                Ok(None) => report(&shown, Ok(Skip("no CUDA device".into()))),
                Ok(Some(d)) => report(&shown, rank_check(&name, d)),
                Err(e) => report(&shown, Err(e)),
            }
        }
        Cmd::BenchDdp { steps } => report("bench-ddp", bench_ddp(steps)),
        Cmd::BenchAllreduce { iters } => report("bench-allreduce", bench_allreduce(iters)),
        Cmd::NcclLifecycleChild => match nccl_lifecycle_child() {
            Ok(line) => {
                println!("{line}");
                // returns from main with an allreduce queued on the default group (a static)
                0
            }
            Err(e) => {
                println!("CHILD-FAIL {e}");
                1
            }
        },
    };
    std::process::exit(code);
}

/// `None` when CUDA was asked for and there is none.
fn device_of(name: &str) -> Res<Option<Device>> {
    match name {
        "cpu" => Ok(Some(Device::Cpu)),
        "cuda" if tch::Cuda::is_available() && memory::cuda_device_count() > 0 => Ok(Some(Device::Cuda(0))),
        "cuda" => Ok(None),
        other => Err(format!("--device must be cuda or cpu, not {other:?}").into()),
    }
}

fn run_check(name: &str, device: &str) -> i32 {
    let Some((_, f)) = CHECKS.iter().find(|(n, _)| *n == name) else {
        return report(name, Err(format!("no check {name:?} (see `gpu_kit list`)").into()));
    };
    let outcome = match device_of(device) {
        Ok(None) => Ok(Skip("no CUDA device".into())),
        Ok(Some(d)) => f(d),
        Err(e) => Err(e),
    };
    report(name, outcome)
}

/// Prints the check's line; the exit code is 1 on failure.
fn report(name: &str, r: Res<Outcome>) -> i32 {
    match r {
        Ok(Pass(detail)) => println!("PASS {name}: {detail}"),
        Ok(Skip(why)) => println!("SKIP {name}: {why}"),
        Err(e) => {
            // one line, whatever the error's own formatting
            let msg = e.to_string().lines().map(str::trim).collect::<Vec<_>>().join(" ");
            println!("FAIL {name}: {msg}");
            return 1;
        }
    }
    0
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Res<()> {
    if cond {
        Ok(())
    } else {
        Err(msg().into())
    }
}

// ---- shared pieces

/// A one-rank group on an in-process store: `cuda` is the engine for CUDA tensors (NCCL alone, or with
/// Gloo for the CPU); on the CPU every check uses Gloo.
fn group(device: Device, config: BackendConfig) -> Res<Arc<ProcessGroup>> {
    let backend = if device == Device::Cpu { BackendConfig::GLOO } else { config };
    let opts = GroupOptions {
        backend,
        timeout: Duration::from_secs(120),
        hostname: Some("127.0.0.1".into()),
        cuda_device: Some(0),
        ..GroupOptions::default()
    };
    Ok(Arc::new(ProcessGroup::new(&Store::hash()?, 0, 1, &opts)?))
}

const D_IN: i64 = 32;
const HIDDEN: i64 = 64;
const D_OUT: i64 = 8;
const STEPS: usize = 3;

/// The checks' MLP. `unused` adds a layer that never takes part in the loss.
fn mlp(p: &nn::Path, unused: bool) -> nn::Sequential {
    if unused {
        let _ = nn::linear(p / "unused", 4, 4, Default::default());
    }
    nn::seq()
        .add(nn::linear(p / "l1", D_IN, HIDDEN, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(p / "l2", HIDDEN, HIDDEN, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(p / "l3", HIDDEN, D_OUT, Default::default()))
}

/// The two-process checks' model: five Linear layers, 2048 wide (~51 MB of float32 parameters), so that
/// DDP's 4 MB buckets are many.
fn wide_mlp(p: &nn::Path) -> nn::Sequential {
    const WIDE: i64 = 2048;
    let mut net = nn::seq().add(nn::linear(p / "l1", D_IN, WIDE, Default::default())).add_fn(|x| x.relu());
    for i in 2..5 {
        net = net.add(nn::linear(p / format!("l{i}"), WIDE, WIDE, Default::default())).add_fn(|x| x.tanh());
    }
    net.add(nn::linear(p / "l5", WIDE, D_OUT, Default::default()))
}

type Twins = ((nn::VarStore, nn::Sequential), (nn::VarStore, nn::Sequential));

/// The model on `device` and its CPU twin with the same initial values (drawn on the CPU).
fn twins(device: Device, unused: bool) -> Res<Twins> {
    twins_of(device, &|p| mlp(p, unused))
}

fn twins_of(device: Device, build: &dyn Fn(&nn::Path) -> nn::Sequential) -> Res<Twins> {
    tch::manual_seed(1);
    let cpu_vs = nn::VarStore::new(Device::Cpu);
    let cpu = build(&cpu_vs.root());
    let dev_vs = nn::VarStore::new(device);
    let dev = build(&dev_vs.root());
    copy_vars(&dev_vs, &cpu_vs)?;
    Ok(((dev_vs, dev), (cpu_vs, cpu)))
}

/// Copies `src`'s values into the variables of `dst` with the same names.
fn copy_vars(dst: &nn::VarStore, src: &nn::VarStore) -> Res<()> {
    let src = src.variables();
    let _g = tch::no_grad_guard();
    for (name, mut t) in dst.variables() {
        let s = src.get(&name).ok_or_else(|| format!("no variable {name} to copy from"))?;
        t.f_copy_(s)?;
    }
    Ok(())
}

fn batch(step: usize, rows: i64) -> (Tensor, Tensor) {
    let g = Tensor::arange(rows * D_IN, (Kind::Float, Device::Cpu)).reshape([rows, D_IN]);
    let x = ((&g + step as f64 * 7.0) * 0.37).sin();
    let y =
        ((Tensor::arange(rows * D_OUT, (Kind::Float, Device::Cpu)).reshape([rows, D_OUT]) + step as f64) * 0.11).cos();
    (x, y)
}

fn loss(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

fn by_name(vs: &nn::VarStore) -> BTreeMap<String, Tensor> {
    vs.variables().into_iter().map(|(n, t)| (n, t.detach().to_device(Device::Cpu).to_kind(Kind::Float))).collect()
}

/// The largest absolute difference between same-named variables; an error if the names differ.
fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> Res<f64> {
    ensure(a.keys().eq(b.keys()), || format!("variables differ: {:?} vs {:?}", a.keys(), b.keys()))?;
    Ok(a.iter().map(|(k, t)| (t - &b[k]).abs().max().double_value(&[])).fold(0.0, f64::max))
}

/// Plain training on the CPU: the reference every data-parallel check is held to.
fn reference(unused: bool, make: impl Fn(Vec<Tensor>) -> Box<dyn Optimizer>) -> Res<BTreeMap<String, Tensor>> {
    reference_of(&|p| mlp(p, unused), make)
}

fn reference_of(
    build: &dyn Fn(&nn::Path) -> nn::Sequential,
    make: impl Fn(Vec<Tensor>) -> Box<dyn Optimizer>,
) -> Res<BTreeMap<String, Tensor>> {
    let (_, (vs, net)) = twins_of(Device::Cpu, build)?;
    let mut opt = make(vs.trainable_variables());
    for s in 0..STEPS {
        let (x, y) = batch(s, 16);
        loss(&net.forward(&x), &y).f_backward()?;
        opt.step()?;
        opt.zero_grad()?;
    }
    Ok(by_name(&vs))
}

fn sgd(p: Vec<Tensor>) -> Box<dyn Optimizer> {
    Box::new(Sgd::new(p, 0.05).momentum(0.9))
}

// ---- the checks

fn nccl_refuses_cpu_tensors(device: Device) -> Res<Outcome> {
    if device == Device::Cpu {
        return Ok(Skip("needs a real NCCL group".into()));
    }
    let pg = group(device, BackendConfig::NCCL)?;
    let mut cpu = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let e = match pg.allreduce(&mut cpu, ReduceOp::Sum) {
        Ok(()) => return Err("an NCCL-only group took a CPU tensor".into()),
        Err(e) => e.to_string(),
    };
    ensure(e.contains("on Cpu") && e.contains("NCCL takes CUDA tensors only"), || format!("unclear error: {e}"))?;
    let mut gpu = Tensor::ones([4], (Kind::Float, device));
    pg.allreduce(&mut gpu, ReduceOp::Avg)?;
    pg.barrier()?;
    Ok(Pass(format!("error: {e}")))
}

fn group_cpu_gloo_cuda_nccl(device: Device) -> Res<Outcome> {
    if device == Device::Cpu {
        return Ok(Skip("needs NCCL".into()));
    }
    let pg = group(device, BackendConfig::CPU_GLOO_CUDA_NCCL)?;
    ensure(pg.backend_for(Device::Cpu) == Some(Backend::Gloo), || "CPU tensors do not go to gloo".into())?;
    ensure(pg.backend_for(device) == Some(Backend::Nccl), || "CUDA tensors do not go to nccl".into())?;
    let mut a = Tensor::arange(6, (Kind::Float, Device::Cpu));
    let mut b = Tensor::arange(6, (Kind::Float, device));
    pg.allreduce(&mut a, ReduceOp::Sum)?;
    pg.allreduce(&mut b, ReduceOp::Avg)?;
    let mut outs = vec![b.zeros_like()];
    pg.all_gather(&mut outs, &b)?;
    pg.barrier()?;
    ensure(a.equal(&b.to_device(Device::Cpu)) && outs[0].equal(&b), || "results differ".into())?;
    Ok(Pass(format!("{}: CPU tensors on gloo, CUDA tensors on nccl, barrier on gloo", pg.backend_config())))
}

fn ddp_step(device: Device, views: bool, unused: bool) -> Res<Outcome> {
    // NCCL alone: every metadata collective must find its way to the GPU; the default group (Gloo for
    // the CPU, NCCL for CUDA) with unused parameters: the unused map and loop checks on Gloo.
    let config = if unused { BackendConfig::CPU_GLOO_CUDA_NCCL } else { BackendConfig::NCCL };
    let pg = group(device, config)?;
    let ((vs, net), _) = twins(device, unused)?;
    let opts =
        DdpOptions::default().gradient_as_bucket_view(views).find_unused_parameters(unused).process_group(pg.clone());
    let ddp = DistributedDataParallel::new(&vs, net, opts)?;
    let mut opt = sgd(vs.trainable_variables());
    for s in 0..STEPS {
        let (x, y) = batch(s, 16);
        ddp.backward(&loss(&ddp.f_forward(&x.to_device(device))?, &y.to_device(device)))?;
        opt.step()?;
        ddp.zero_grad()?;
    }
    let diff = max_diff(&by_name(&vs), &reference(unused, sgd)?)?;
    ensure(diff < 1e-5, || format!("parameters differ from plain CPU training by {diff:e}"))?;
    Ok(Pass(format!("{} steps over {}, max |diff| vs CPU {diff:.1e}", STEPS, pg.backend_config())))
}

fn zero_step(device: Device, stage: ZeroStage) -> Res<Outcome> {
    let pg = group(device, BackendConfig::NCCL)?;
    let ((vs, net), _) = twins(device, false)?;
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
    let mut opt = ShardedOptimizer::new(&ddp, stage, |p| Box::new(AdamW::new(p, 1e-2)))?;
    for s in 0..STEPS {
        let (x, y) = batch(s, 16);
        ddp.backward(&loss(&ddp.f_forward(&x.to_device(device))?, &y.to_device(device)))?;
        opt.step()?;
        opt.zero_grad()?;
    }
    let diff = max_diff(&by_name(&vs), &reference(false, |p| Box::new(AdamW::new(p, 1e-2)))?)?;
    ensure(diff < 1e-5, || format!("parameters differ from plain AdamW on the CPU by {diff:e}"))?;
    Ok(Pass(format!("{stage:?}, {STEPS} AdamW steps over {}, max |diff| vs CPU {diff:.1e}", pg.backend_config())))
}

/// FSDP with each Linear a unit, clipping (max norm 0.5) and AdamW, against the same on the CPU
/// unsharded; `offload`: shards, their gradients and AdamW's state on the CPU, units computing on `device`
/// (DeepSpeed's offload_optimizer; on the CPU, distinct buffers all the same).
/// FSDP against the unsharded model on the CPU; `fused`: the GPU side steps with AdamW's fused kernel.
fn fsdp_step(device: Device, offload: bool, fused: bool) -> Res<Outcome> {
    const MAX_NORM: f64 = 0.5;
    let config = if offload { BackendConfig::CPU_GLOO_CUDA_NCCL } else { BackendConfig::NCCL };
    let pg = group(device, config)?;
    let (_, (cpu_vs, cpu_net)) = twins(Device::Cpu, false)?;
    let dims = [(D_IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, D_OUT)];
    let mut opts = FsdpOptions::default().process_group(pg.clone());
    if offload {
        opts = opts.offload(Device::Cpu);
    }
    let model = fsdp_model(device, &dims, &cpu_vs, opts)?;
    let mut opt = AdamW::new(model.parameters(), 1e-2).fused(fused);
    let mut ref_opt = AdamW::new(cpu_vs.trainable_variables(), 1e-2);
    let mut norms = (0.0, 0.0);
    for s in 0..STEPS {
        let (x, y) = batch(s, 16);
        model.backward(&loss(&model.f_forward(&x.to_device(device))?, &y.to_device(device)))?;
        norms.0 = f64::try_from(clip_grad_norm(&model.parameters(), MAX_NORM, 2.0)?)?;
        opt.step()?;
        model.zero_grad()?;
        loss(&cpu_net.forward(&x), &y).f_backward()?;
        norms.1 = f64::try_from(clip_grad_norm(&cpu_vs.trainable_variables(), MAX_NORM, 2.0)?)?;
        ref_opt.step()?;
        ref_opt.zero_grad()?;
    }
    let m = model.memory_breakdown_with(&opt)?;
    let got: BTreeMap<String, Tensor> =
        model.state_dict()?.into_iter().map(|(n, t)| (n, t.to_device(Device::Cpu).to_kind(Kind::Float))).collect();
    let diff = max_diff(&got, &by_name(&cpu_vs))?;
    ensure(diff < 1e-5, || format!("parameters differ from unsharded AdamW on the CPU by {diff:e}"))?;
    ensure((norms.0 - norms.1).abs() <= 1e-5 * norms.1, || {
        format!("gradient norm {} vs the CPU's {}", norms.0, norms.1)
    })?;
    ensure(norms.1 > MAX_NORM, || format!("the check must clip: norm {}", norms.1))?;
    let held = m.sharded_parameters + m.gradient_shards + m.optimizer_state;
    if offload {
        ensure(m.offloaded == held && held > 0, || format!("offloaded {} of {held} bytes", m.offloaded))?;
    } else {
        ensure(m.offloaded == 0, || format!("nothing offloaded, yet {} bytes", m.offloaded))?;
    }
    Ok(Pass(format!(
        "{STEPS} clipped AdamW{} steps over {}, max |diff| vs CPU {diff:.1e}, norm {:.4} (CPU {:.4}); offloaded {} of {held} bytes",
        if fused { " (fused)" } else { "" },
        pg.backend_config(),
        norms.0,
        norms.1,
        m.offloaded
    )))
}

/// Activation checkpointing on `device`: a block with dropout, recomputed in backward with the same
/// random numbers, gives the gradients of the block run plainly from the same seed, bit for bit.
fn recompute_dropout(device: Device) -> Res<Outcome> {
    let vs = nn::VarStore::new(device);
    #[derive(Debug)]
    struct Block(Vec<Tensor>);
    impl Module for Block {
        fn forward(&self, x: &Tensor) -> Tensor {
            let h = x.linear(&self.0[0], Some(&self.0[1])).dropout(0.5, true);
            h.linear(&self.0[2], Some(&self.0[3]))
        }
    }
    let (a, b) = (
        nn::linear(vs.root() / "a", D_IN, HIDDEN, Default::default()),
        nn::linear(vs.root() / "b", HIDDEN, D_OUT, Default::default()),
    );
    let weights = || -> Vec<Tensor> {
        [&a.ws, a.bs.as_ref().unwrap_or(&a.ws), &b.ws, b.bs.as_ref().unwrap_or(&b.ws)]
            .iter()
            .map(|t| t.shallow_clone())
            .collect()
    };
    let (block, wrapped) = (Block(weights()), Checkpointed::new(Block(weights())));
    let (x, _) = batch(0, 16);
    let x = x.to_device(device);
    let grads = |checkpointed: bool| -> Res<Vec<Tensor>> {
        vs.trainable_variables().iter().for_each(|p| tch_dist::hooks::set_grad(p, None).unwrap_or(()));
        tch::manual_seed(7);
        let y = if checkpointed { wrapped.forward(&x) } else { block.forward(&x) };
        y.square().sum(Kind::Float).f_backward()?;
        Ok(vs.trainable_variables().iter().map(|p| p.grad().to_device(Device::Cpu)).collect())
    };
    let (plain, ckpt) = (grads(false)?, grads(true)?);
    let diff = plain.iter().zip(&ckpt).map(|(a, b)| (a - b).abs().max().double_value(&[])).fold(0.0, f64::max);
    ensure(diff == 0.0, || format!("checkpointed gradients differ from plain ones by {diff:e}"))?;
    Ok(Pass(format!("dropout recomputed alike on {device:?}: gradients bit-identical")))
}

fn tp_mlp(device: Device) -> Res<Outcome> {
    let pg = group(device, BackendConfig::NCCL)?;
    tch::manual_seed(3);
    let (w1, b1) = (
        Tensor::randn([HIDDEN, D_IN], (Kind::Float, Device::Cpu)) * 0.2,
        Tensor::randn([HIDDEN], (Kind::Float, Device::Cpu)),
    );
    let (w2, b2) = (
        Tensor::randn([D_IN, HIDDEN], (Kind::Float, Device::Cpu)) * 0.2,
        Tensor::randn([D_IN], (Kind::Float, Device::Cpu)),
    );
    let x = Tensor::randn([8, D_IN], (Kind::Float, Device::Cpu));
    // the full MLP on the CPU
    let xc = x.detach().set_requires_grad(true);
    let full = xc.linear(&w1, Some(&b1)).gelu("none").linear(&w2, Some(&b2));
    full.sum(Kind::Float).backward();
    // the tensor-parallel one on the device
    let vs = nn::VarStore::new(device);
    let d = |t: &Tensor| t.to_device(device);
    let mlp = ParallelMlp::from_full(&vs.root(), &d(&w1), &d(&b1), &d(&w2), &d(&b2), pg.clone())?;
    let xd = d(&x).set_requires_grad(true);
    let out = mlp.f_forward(&xd)?;
    out.sum(Kind::Float).f_backward()?;
    let diffs = [
        (&out.to_device(Device::Cpu) - &full).abs().max().double_value(&[]),
        (&xd.grad().to_device(Device::Cpu) - xc.grad()).abs().max().double_value(&[]),
    ];
    let worst = diffs.iter().cloned().fold(0.0, f64::max);
    ensure(worst < 1e-4, || format!("output / input gradient differ from the CPU MLP: {diffs:?}"))?;
    Ok(Pass(format!(
        "ParallelMlp over {}, output and input gradient vs CPU max |diff| {worst:.1e}",
        pg.backend_config()
    )))
}

/// The engine's all_to_all_single (one rank: its own chunk back), and the MoE layer on the device
/// against the CPU: output, input gradient and the experts' gradient.
fn moe(device: Device) -> Res<Outcome> {
    let pg = group(device, BackendConfig::NCCL)?;
    let x = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([6, 2]);
    let mut got = Tensor::zeros([6, 2], (Kind::Float, device));
    pg.all_to_all_single(&mut got, &x.to_device(device), &[], &[])?;
    let a2a = (&got.to_device(Device::Cpu) - &x).abs().max().double_value(&[]);
    ensure(a2a == 0.0, || format!("all_to_all_single over {} returned another chunk", pg.backend_config()))?;
    tch::manual_seed(5);
    let r = |shape: &[i64], scale: f64| Tensor::randn(shape, (Kind::Float, Device::Cpu)) * scale;
    let router = r(&[8, D_IN], 1.0);
    let w = [r(&[8, D_IN, HIDDEN], 0.2), r(&[8, HIDDEN], 1.0), r(&[8, HIDDEN, D_IN], 0.2), r(&[8, D_IN], 1.0)];
    let xs = r(&[16, D_IN], 1.0);
    let run = |dev: Device, pg: Arc<ProcessGroup>| -> Res<[Tensor; 3]> {
        let vs = nn::VarStore::new(dev);
        let d = |t: &Tensor| t.to_device(dev);
        let ws = [d(&w[0]), d(&w[1]), d(&w[2]), d(&w[3])];
        let m = Moe::from_full(&vs.root(), &d(&router), [&ws[0], &ws[1], &ws[2], &ws[3]], pg, MoeConfig::default())?;
        let x = d(&xs).set_requires_grad(true);
        let o = m.f_forward(&x)?;
        (o.output.sum(Kind::Float) + o.aux_loss).f_backward()?;
        let cpu = |t: &Tensor| t.to_device(Device::Cpu);
        Ok([cpu(&o.output), cpu(&x.grad()), cpu(&m.w1.grad())])
    };
    let on_device = run(device, pg.clone())?;
    let on_cpu = run(Device::Cpu, group(Device::Cpu, BackendConfig::GLOO)?)?;
    let diffs: Vec<f64> = on_device.iter().zip(&on_cpu).map(|(a, b)| (a - b).abs().max().double_value(&[])).collect();
    let worst = diffs.iter().cloned().fold(0.0, f64::max);
    ensure(worst < 1e-4, || format!("MoE output / input gradient / w1 gradient differ from the CPU's: {diffs:?}"))?;
    Ok(Pass(format!("all_to_all_single over {}; MoE layer vs CPU max |diff| {worst:.1e}", pg.backend_config())))
}

/// Ring attention on one rank (no exchange: the blocks, the custom backward node and the load-balanced
/// layout on the device) against ATen's fused attention, float32 and bfloat16.
fn ring_attention(device: Device) -> Res<Outcome> {
    use tch_dist::context_parallel::{ContextParallel, RingAttentionConfig};
    let cp = ContextParallel::new(group(device, BackendConfig::NCCL)?, Default::default());
    let cfg = RingAttentionConfig { causal: true, ..Default::default() };
    let mut worst = Vec::new();
    for (kind, tol) in [(Kind::Float, 1e-4), (Kind::BFloat16, 5e-2)] {
        tch::manual_seed(11);
        let qkv: Vec<Tensor> = (0..3)
            .map(|_| Tensor::randn([2, 4, 128, 32], (Kind::Float, Device::Cpu)).to_kind(kind).to_device(device))
            .collect();
        let leaf = |t: &Tensor| t.detach().set_requires_grad(true);
        let (a, b) = ([leaf(&qkv[0]), leaf(&qkv[1]), leaf(&qkv[2])], [leaf(&qkv[0]), leaf(&qkv[1]), leaf(&qkv[2])]);
        let ours = cp.attention(&a[0], &a[1], &a[2], cfg)?;
        let theirs =
            Tensor::f_scaled_dot_product_attention(&b[0], &b[1], &b[2], None::<Tensor>, 0.0, true, None, false)?;
        ours.to_kind(Kind::Float).sum(Kind::Float).f_backward()?;
        theirs.to_kind(Kind::Float).sum(Kind::Float).f_backward()?;
        let d =
            |x: &Tensor, y: &Tensor| (x.to_kind(Kind::Float) - y.to_kind(Kind::Float)).abs().max().double_value(&[]);
        let diffs = [d(&ours, &theirs), d(&a[0].grad(), &b[0].grad()), d(&a[1].grad(), &b[1].grad())];
        let w = diffs.iter().cloned().fold(0.0, f64::max);
        ensure(w < tol, || format!("{kind:?}: output / dq / dk differ from SDPA's by {diffs:?}"))?;
        worst.push(format!("{kind:?} {w:.1e}"));
    }
    Ok(Pass(format!("ring attention (1 rank) vs SDPA max |diff|: {}", worst.join(", "))))
}

fn amp_bf16(device: Device) -> Res<Outcome> {
    let pg = group(device, BackendConfig::NCCL)?;
    let ((vs, net), _) = twins(device, false)?;
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg))?;
    let mut opt = sgd(vs.trainable_variables());
    let mut kinds = Vec::new();
    for s in 0..STEPS {
        let (x, y) = batch(s, 16);
        let out = ddp.forward_with(|m| autocast(device, Kind::BFloat16, || m.forward(&x.to_device(device))))??;
        kinds.push(out.kind());
        ddp.backward(&loss(&out.to_kind(Kind::Float), &y.to_device(device)))?;
        opt.step()?;
        ddp.zero_grad()?;
    }
    ensure(kinds.iter().all(|&k| k == Kind::BFloat16), || format!("autocast did not compute in bf16: {kinds:?}"))?;
    let diff = max_diff(&by_name(&vs), &reference(false, sgd)?)?;
    // bf16 keeps 8 bits of mantissa: the steps follow float32 training to about 1e-2
    ensure(diff < 2e-2, || format!("bf16 training drifted from float32 CPU training by {diff:e}"))?;
    Ok(Pass(format!("{STEPS} bf16 autocast steps, max |diff| vs float32 on the CPU {diff:.1e}")))
}

fn amp_fp16_scaler(device: Device) -> Res<Outcome> {
    let pg = group(device, BackendConfig::NCCL)?;
    // float16 autocast on the GPU; the CPU run of this check uses bf16 (what CPU autocast is for)
    let half = if device == Device::Cpu { Kind::BFloat16 } else { Kind::Half };
    let ((vs, net), _) = twins(device, false)?;
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
    let mut opt = Sgd::new(vs.trainable_variables(), 0.05).momentum(0.9);
    let mut scaler = GradScaler::new().process_group(pg);
    let mut stepped = Vec::new();
    let mut scales = Vec::new();
    // step 1 overflows on purpose (the loss times infinity): skipped, and the scale backs off
    for (k, s) in [0, 0, 1, 2].into_iter().enumerate() {
        let (x, y) = batch(s, 16);
        let out = ddp.forward_with(|m| autocast(device, half, || m.forward(&x.to_device(device))))??;
        let mut l = loss(&out.to_kind(Kind::Float), &y.to_device(device));
        if k == 1 {
            l *= f64::INFINITY;
        }
        ddp.backward(&scaler.scale(&l)?)?;
        stepped.push(scaler.step(&mut opt)?);
        scaler.update()?;
        scales.push(scaler.get_scale());
        ddp.zero_grad()?;
    }
    ensure(stepped == [true, false, true, true], || format!("steps taken {stepped:?}, expected the second skipped"))?;
    ensure(scales == [65536.0, 32768.0, 32768.0, 32768.0], || format!("scales {scales:?}"))?;
    // the reference: float32 on the CPU, steps 0, 0, 1, 2 with the second one skipped
    let (_, (rvs, rnet)) = twins(Device::Cpu, false)?;
    let mut ropt = Sgd::new(rvs.trainable_variables(), 0.05).momentum(0.9);
    for s in [0, 1, 2] {
        let (x, y) = batch(s, 16);
        loss(&rnet.forward(&x), &y).f_backward()?;
        ropt.step()?;
        ropt.zero_grad()?;
    }
    let diff = max_diff(&by_name(&vs), &by_name(&rvs))?;
    ensure(diff < 2e-2, || format!("{half:?} training drifted from float32 CPU training by {diff:e}"))?;
    Ok(Pass(format!("{half:?} autocast + GradScaler: overflow step skipped, scale 65536 -> 32768, max |diff| vs float32 CPU {diff:.1e}")))
}

fn checkpoint_round_trip(device: Device) -> Res<Outcome> {
    let dir = std::env::temp_dir().join(format!("gpu-kit-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.safetensors");
    let mut lines = Vec::new();
    for config in [BackendConfig::NCCL, BackendConfig::CPU_GLOO_CUDA_NCCL] {
        let pg = group(device, config)?;
        let ((vs, _), _) = twins(device, false)?;
        checkpoint::save_var_store(&pg, &path, 7, &vs)?;
        tch::manual_seed(99);
        let other = nn::VarStore::new(device);
        let _ = mlp(&other.root(), false);
        let step = checkpoint::load_var_store(&pg, &path, &other)?;
        ensure(step == Some(7), || format!("loaded step {step:?}, saved 7"))?;
        let diff = max_diff(&by_name(&vs), &by_name(&other))?;
        ensure(diff == 0.0, || format!("loaded values differ by {diff:e}"))?;
        ensure(other.variables().values().all(|t| t.device() == device), || "loaded onto the wrong device".into())?;
        // sharded: saved in the background from this device (pinned staging for CUDA), loaded onto
        // this device and onto the CPU
        let root = dir.join(format!("sharded-{}", lines.len()));
        let mut ck = checkpoint::Checkpointer::new(pg.clone(), &root)?;
        ck.async_save(7, checkpoint::StateDict::new().var_store("model", &vs))?;
        ensure(ck.wait()? == Some(7), || "the async save did not commit".into())?;
        for target in [device, Device::Cpu] {
            tch::manual_seed(98);
            let back = nn::VarStore::new(target);
            let _ = mlp(&back.root(), false);
            let step = ck.load(checkpoint::StateDict::new().var_store("model", &back))?;
            ensure(step == Some(7), || format!("sharded: loaded step {step:?} onto {target:?}, saved 7"))?;
            let diff = max_diff(&by_name(&vs), &by_name(&back))?; // both read back to the CPU
            ensure(diff == 0.0, || format!("sharded: values loaded onto {target:?} differ by {diff:e}"))?;
        }
        lines.push(pg.backend_config().to_string());
        if device == Device::Cpu {
            break;
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(Pass(format!(
        "save/load bit-exact, step kept, single-file and sharded (async, loaded onto {device:?} and the CPU), over {}",
        lines.join(" and ")
    )))
}

fn split_layers() -> LayerList {
    LayerList::new()
        .seed(5)
        .add("submodule1", |p| nn::linear(p, 64, 128, Default::default()))
        .add_fn("relu", |x| x.relu())
        .add("submodule2", |p| nn::linear(p, 128, 64, Default::default()))
}

/// The unsplit model trained on the CPU: (final variables, losses).
fn unsplit(
    layers: &LayerList,
    steps: usize,
    data: &dyn Fn(usize) -> (Tensor, Tensor),
) -> Res<(BTreeMap<String, Tensor>, Vec<f64>)> {
    let stage = layers.build_stage(0..layers.len(), Device::Cpu)?;
    let mut opt = nn::Sgd::default().build(&stage.vs, 0.05)?;
    let mut losses = Vec::new();
    for s in 0..steps {
        let (x, y) = data(s);
        opt.zero_grad();
        let l = loss(&stage.forward(&x), &y);
        losses.push(l.double_value(&[]));
        l.backward();
        opt.step();
    }
    Ok((by_name(&stage.vs), losses))
}

fn split_data(s: usize) -> (Tensor, Tensor) {
    let x = ((Tensor::arange(16 * 64, (Kind::Float, Device::Cpu)).reshape([16, 64]) + s as f64) * 0.13).sin();
    let y = ((Tensor::arange(16 * 64, (Kind::Float, Device::Cpu)).reshape([16, 64]) - s as f64) * 0.05).cos();
    (x, y)
}

fn split(device: Device) -> Res<Outcome> {
    let layers = split_layers();
    let cpu_ref = layers.build_stage(0..layers.len(), Device::Cpu)?;
    let model = SplitModel::new(&layers, &Partition::sizes(&[2, 1], 3)?, &[device, device])?;
    for vs in model.var_stores() {
        copy_vars(vs, &cpu_ref.vs)?; // CUDA draws its own random numbers; start from the CPU's
    }
    let mut opts =
        model.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, 0.05)).collect::<Result<Vec<_>, _>>()?;
    for s in 0..STEPS {
        let (x, y) = split_data(s);
        opts.iter_mut().for_each(|o| o.zero_grad());
        let out = model.forward(&x.to_device(device));
        ensure(out.device() == device, || format!("output on {:?}", out.device()))?;
        loss(&out, &y.to_device(device)).backward();
        opts.iter_mut().for_each(|o| o.step());
    }
    let got: BTreeMap<String, Tensor> = model.var_stores().iter().flat_map(|vs| by_name(vs)).collect();
    let diff = max_diff(&got, &unsplit(&layers, STEPS, &split_data)?.0)?;
    ensure(diff < 1e-5, || format!("the split model differs from the unsplit CPU model by {diff:e}"))?;
    Ok(Pass(format!("2 stages on {device:?}, {STEPS} steps, max |diff| vs unsplit CPU {diff:.1e}")))
}

fn pipeline_1f1b(device: Device) -> Res<Outcome> {
    let layers = split_layers();
    let cpu_ref = layers.build_stage(0..layers.len(), Device::Cpu)?;
    let cfg = PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 4, ..Default::default() };
    let mut pipe = Pipeline::new(&layers, &Partition::sizes(&[2, 1], 3)?, &[device, device], cfg)?;
    for vs in pipe.var_stores() {
        copy_vars(vs, &cpu_ref.vs)?;
    }
    let mut opts =
        pipe.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, 0.05)).collect::<Result<Vec<_>, _>>()?;
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let (x, y) = split_data(s);
        let r = pipe.step(&x, &y, &loss)?;
        losses.push(r.loss);
        opts.iter_mut().for_each(|o| o.step());
        pipe.zero_grad()?;
    }
    let got: BTreeMap<String, Tensor> = pipe.var_stores().iter().flat_map(|vs| by_name(vs)).collect();
    let (want, want_losses) = unsplit(&layers, STEPS, &split_data)?;
    let diff = max_diff(&got, &want)?;
    let loss_diff = losses.iter().zip(&want_losses).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    ensure(diff < 1e-5 && loss_diff < 1e-5, || {
        format!("1F1B differs from the unsplit CPU model: parameters {diff:e}, losses {loss_diff:e}")
    })?;
    Ok(Pass(format!("2 stages on {device:?}, 4 microbatches, {STEPS} steps, max |diff| vs unsplit CPU {diff:.1e}")))
}

fn selfcheck() -> Res<Outcome> {
    let pg = group(Device::Cpu, BackendConfig::GLOO)?;
    let mut t = Tensor::arange(4, (Kind::Float, Device::Cpu));
    pg.allreduce(&mut t, ReduceOp::Sum)?;
    ensure(Vec::<f32>::try_from(&t)? == [0.0, 1.0, 2.0, 3.0], || "allreduce result wrong".into())?;
    let cuda = if tch::Cuda::is_available() {
        // the name is what throughput's MFU reads its peak from
        let name = memory::cuda_device_name(0).unwrap_or_else(|| "cuda:0 unnamed".into());
        let peak = tch_dist::throughput::peak_flops(&name)
            .map_or("no peak in the table".into(), |p| format!("bf16 peak {:.0} TFLOP/s", p / 1e12));
        format!("{} CUDA device(s), cuda:0 {name} ({peak})", memory::cuda_device_count())
    } else {
        "no CUDA device".into()
    };
    let nccl = if cfg!(feature = "cuda") { "NCCL built in" } else { "built without the cuda feature" };
    Ok(Pass(format!("libtorch loaded, gloo allreduce ok, {cuda}, {nccl}")))
}

/// A wait on NCCL work makes the stream wait, not the host: behind ~200 ms of queued matmuls,
/// `all_gather_into_tensor_async(..).wait()` returns at once, and the result is right once the stream
/// has run.
fn async_wait(device: Device) -> Res<Outcome> {
    if device == Device::Cpu {
        return Ok(Skip("needs a CUDA stream".into()));
    }
    let pg = group(device, BackendConfig::NCCL)?;
    let mut t = Tensor::full([1 << 20], 3.0, (Kind::Float, device));
    pg.allreduce(&mut t, ReduceOp::Sum)?;
    let (a, n) = matmuls_for_200ms(device);
    let start = Instant::now();
    let mut acc = a.zeros_like();
    for _ in 0..n {
        acc = a.matmul(&a);
    }
    // out of place, into zeros: the result shows whether the collective ran once the stream has
    let input = Tensor::full([1 << 20], 3.0, (Kind::Float, device));
    let mut out = input.zeros_like();
    let waited = Instant::now();
    pg.all_gather_into_tensor_async(&mut out, &input)?.wait()?;
    let waited = waited.elapsed();
    // the flight recorder counts it complete when its end event is, not when the host's wait returned
    let state = || {
        tch_dist::flight::entries()
            .into_iter()
            .rev()
            .find(|e| e.op.starts_with("all_gather_into_tensor"))
            .map(|e| e.state)
    };
    let while_queued = state();
    tch::Cuda::synchronize(0);
    let total = start.elapsed();
    pg.barrier()?;
    let after = state();
    ensure(
        while_queued == Some(tch_dist::flight::EntryState::Pending)
            && after == Some(tch_dist::flight::EntryState::Completed),
        || format!("the recorder had the all-gather {while_queued:?} while queued and {after:?} after it ran"),
    )?;
    drop(acc);
    ensure(total >= Duration::from_millis(150), || format!("only {total:?} of work queued; the check needs 150 ms"))?;
    ensure(waited < Duration::from_millis(20), || {
        format!("wait() held the host {waited:?} behind {total:?} of queued work (it must return in < 20 ms)")
    })?;
    ensure(out.equal(&input), || "the all-gather's result is wrong".into())?;
    Ok(Pass(format!(
        "wait() returned in {waited:?} behind {n} queued matmuls ({total:?}); result right; recorded pending \
         until its end event, then completed"
    )))
}

/// What `from_env` picks here with `LOCAL_RANK=1`, as under Slurm's `--gpus-per-task=1`: with one
/// visible GPU, `cuda:0` (never the CPU); with none, the CPU; with more, `cuda:1`.
fn device_from_env(_device: Device) -> Res<Outcome> {
    let vars = |k: &str| {
        let v = match k {
            "RANK" => "1",
            "WORLD_SIZE" => "2",
            "LOCAL_RANK" => "1",
            "MASTER_ADDR" => "127.0.0.1",
            "MASTER_PORT" => "29500",
            _ => return None,
        };
        Some(v.to_string())
    };
    let n = memory::cuda_device_count();
    let got = InitOptions::from_vars(&vars, n)?.device;
    let want = match n {
        0 => Device::Cpu,
        1 => Device::Cuda(0),
        _ => Device::Cuda(1),
    };
    ensure(got == want, || format!("LOCAL_RANK=1 with {n} visible GPU(s) gave {got:?}, not {want:?}"))?;
    Ok(Pass(format!("LOCAL_RANK=1 with {n} visible GPU(s): {got:?}")))
}

/// NCCL groups' lifecycle, in a process of its own whose stderr is read: a group with a bound device
/// creates its communicator when it is built (its first collective is faster than a lazy group's, which
/// pays the init), a mesh dimension splits from it, c10d's recorder names the groups, a group dropped
/// with an allreduce queued behind ~200 ms of matmuls shuts down (no abort, the right result), and the
/// process returns from `main` with another queued on the default group.
fn nccl_lifecycle(device: Device) -> Res<Outcome> {
    if device == Device::Cpu {
        return Ok(Skip("NCCL only".into()));
    }
    let out = std::process::Command::new(std::env::current_exe()?).arg("nccl-lifecycle-child").output()?;
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("CHILD-")).unwrap_or("no CHILD line").to_string();
    ensure(out.status.success() && line.starts_with("CHILD-OK"), || {
        format!("the child ended with {}: {line}; stderr: {}", out.status, stderr.lines().last().unwrap_or(""))
    })?;
    for bad in ["destroy_process_group() was not called", "abort", "Abort"] {
        ensure(!stderr.contains(bad), || format!("stderr says {bad:?}: {}", stderr.replace('\n', " | ")))?;
    }
    Ok(Pass(line.trim_start_matches("CHILD-OK ").to_string()))
}

fn nccl_lifecycle_child() -> Res<String> {
    let device = Device::Cuda(0);
    let opts = |bound: bool| GroupOptions {
        backend: BackendConfig::NCCL,
        timeout: Duration::from_secs(120),
        cuda_device: bound.then_some(0),
        ..GroupOptions::default()
    };
    let first = |pg: &ProcessGroup| -> Res<Duration> {
        let mut t = Tensor::ones([1024], (Kind::Float, device));
        let start = Instant::now();
        pg.allreduce(&mut t, ReduceOp::Sum)?;
        tch::Cuda::synchronize(0);
        Ok(start.elapsed())
    };
    let lazy = ProcessGroup::new(&Store::hash()?, 0, 1, &opts(false))?;
    let lazy_first = first(&lazy)?;
    let built = Instant::now();
    let world = Arc::new(ProcessGroup::new(&Store::hash()?, 0, 1, &opts(true))?);
    let build = built.elapsed();
    let eager_first = first(&world)?;
    ensure(eager_first * 2 < lazy_first, || {
        format!(
            "a bound group's first collective took {eager_first:?}, a lazy one's {lazy_first:?} (built in {build:?})"
        )
    })?;
    // a mesh dimension: its communicator split from the world's
    let mesh = tch_dist::mesh::DeviceMesh::new(&world, &[("dp", 1)])?;
    let dp = mesh.group("dp")?;
    let split_first = first(&dp)?;
    let trace = tch_dist::flight::nccl_trace_json()?;
    for name in ["default_pg", "mesh-dp"] {
        ensure(trace.contains(name), || {
            format!("c10d's recorder does not name {name:?}: {}", &trace[..trace.len().min(300)])
        })?;
    }
    // dropped with work queued: shut down, pending work first
    let (a, n) = matmuls_for_200ms(device);
    let mut acc = a.zeros_like();
    for _ in 0..n {
        acc = a.matmul(&a);
    }
    let mut t = acc.sum(Kind::Float).reshape([1]);
    let want = t.copy();
    let work = dp.allreduce_async(&mut t, ReduceOp::Sum)?;
    drop(work);
    drop(mesh);
    drop(dp);
    ensure(t.equal(&want), || "the allreduce of a dropped group left a wrong result".into())?;
    // and the process returns from main with one more queued on the default group
    tch_dist::init::set_default_group(world.clone())?;
    let mut last = acc.sum(Kind::Float).reshape([1]);
    drop(world.allreduce_async(&mut last, ReduceOp::Sum)?);
    Ok(format!(
        "CHILD-OK first allreduce {eager_first:?} on a bound group (built in {build:?}) vs {lazy_first:?} lazy; \
         split mesh group's first {split_first:?}; c10d's recorder names default_pg and mesh-dp; a group dropped \
         behind {n} matmuls shut down cleanly"
    ))
}

/// A 4096x4096 matrix and how many of its matmuls take ~200 ms on `device` (warmed, timed over ten).
fn matmuls_for_200ms(device: Device) -> (Tensor, usize) {
    let a = Tensor::randn([4096, 4096], (Kind::Float, device));
    let _ = a.matmul(&a);
    tch::Cuda::synchronize(0);
    let start = Instant::now();
    for _ in 0..10 {
        let _ = a.matmul(&a);
    }
    tch::Cuda::synchronize(0);
    let n = ((0.2 / (start.elapsed().as_secs_f64() / 10.0)).ceil() as usize).clamp(1, 100_000);
    (a, n)
}

/// Streams and events (`tch_dist::stream`, what FSDP's side streams stand on): behind ~200 ms of matmuls
/// on the compute stream, work on a side stream ends first; work ordered after the compute stream by an
/// event does not; pinned copies that do not block come back right.
fn streams(device: Device) -> Res<Outcome> {
    use tch_dist::stream::{self, Event, Stream, StreamGuard};
    if device == Device::Cpu {
        return Ok(Skip("needs CUDA streams".into()));
    }
    let compute = Stream::current(device)?;
    let side = Stream::high_priority(device)?;
    ensure(side != compute, || "the side stream is the current one".into())?;
    let (a, n) = matmuls_for_200ms(device);
    let small = Tensor::full([1 << 16], 1.0, (Kind::Float, device));
    // CUDA loads a kernel's module at its first launch, and that load waits for the whole context: the
    // side stream's add and sum run once here first, or their first launch would wait for the matmuls.
    let _ = small.shallow_clone().f_add_scalar_(0.0)?;
    let _ = a.sum(Kind::Float);
    tch::Cuda::synchronize(0);
    let mut acc = a.zeros_like();
    for _ in 0..n {
        acc = a.matmul(&a);
    }
    let busy = Event::record(&compute)?;
    // unordered: the side stream's work runs beside the queued matmuls
    let free = {
        let _on = StreamGuard::new(&side)?;
        let _ = small.shallow_clone().f_add_scalar_(1.0)?;
        Event::record(&side)?
    };
    ensure(Stream::current(device)? == compute, || "the guard did not restore the current stream".into())?;
    let t0 = Instant::now();
    while !free.query()? {
        ensure(t0.elapsed() < Duration::from_millis(100), || {
            "side-stream work waited behind the compute stream (not done within 100 ms)".into()
        })?;
        std::thread::sleep(Duration::from_micros(200));
    }
    let side_done = t0.elapsed();
    let overlapped = !busy.query()?;
    // ordered: after the matmuls, so not done while they run, and it sees their result
    side.wait_stream(&compute)?;
    let (ordered, total) = {
        let _on = StreamGuard::new(&side)?;
        stream::record_stream(&acc, &side)?;
        (acc.sum(Kind::Float), Event::record(&side)?)
    };
    let pending = !total.query()?;
    total.synchronize()?;
    let want = a.matmul(&a).sum(Kind::Float);
    let close = (f64::try_from(&ordered)? - f64::try_from(&want)?).abs() <= 1e-3 * f64::try_from(&want)?.abs();
    drop(acc);
    // pinned host memory: to the GPU and back without blocking, right once the event has passed
    let host = stream::empty_pinned(&[1 << 20], Kind::Float)?;
    host.shallow_clone().f_copy_(&Tensor::arange(1 << 20, (Kind::Float, Device::Cpu)))?;
    let on_gpu = Tensor::empty([1 << 20], (Kind::Float, device));
    let back = stream::empty_pinned(&[1 << 20], Kind::Float)?;
    stream::copy_non_blocking(&on_gpu, &host)?;
    let _ = on_gpu.shallow_clone().f_mul_scalar_(2.0)?;
    stream::copy_non_blocking(&back, &on_gpu)?;
    Event::record(&compute)?.synchronize()?;
    let round_trip = back.equal(&(host * 2.0));
    ensure(overlapped, || format!("the compute stream finished its {n} matmuls before the side stream's add"))?;
    ensure(pending, || "work ordered after the matmuls was done before them".into())?;
    ensure(close, || "the ordered sum differs from the matmul's".into())?;
    ensure(round_trip, || "a pinned round trip through the GPU came back wrong".into())?;
    Ok(Pass(format!(
        "side-stream work done in {side_done:?} behind {n} queued matmuls; event-ordered work waited for them; pinned copies right"
    )))
}

/// Counts libtorch's "called a synchronizing CUDA operation" warnings: stderr goes to a file while the
/// sync debug mode is on; both are undone when the counter is dropped, whatever happened meanwhile.
struct SyncCounter {
    saved: i32,
    path: std::path::PathBuf,
}

impl SyncCounter {
    fn start() -> Res<SyncCounter> {
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!("gpu-kit-syncs-{}.txt", std::process::id()));
        let file = std::fs::File::create(&path)?;
        tch_dist::sync_debug::set_mode(tch_dist::sync_debug::SyncDebugMode::Warn)?;
        // SAFETY: dup of this process's own stderr; the copy is closed (and stderr restored) on drop.
        let saved = unsafe { libc::dup(2) };
        let counter = SyncCounter { saved, path };
        // SAFETY: both descriptors are open (the file's for this call, `saved` checked here).
        if saved < 0 || unsafe { libc::dup2(file.as_raw_fd(), 2) } < 0 {
            return Err("cannot redirect stderr to count syncs".into());
        }
        Ok(counter)
    }

    fn count(&self) -> Res<usize> {
        Ok(std::fs::read_to_string(&self.path)?.matches("called a synchronizing CUDA operation").count())
    }
}

impl Drop for SyncCounter {
    fn drop(&mut self) {
        let _ = tch_dist::sync_debug::set_mode(tch_dist::sync_debug::SyncDebugMode::Off);
        if self.saved >= 0 {
            // SAFETY: `saved` is the descriptor dup'ed in `start`, still open; stderr gets it back.
            unsafe {
                libc::dup2(self.saved, 2);
                libc::close(self.saved);
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Warmed training steps make the host wait for the GPU nowhere (CUDA's sync debug mode, counted per
/// phase): DDP, DDP with clipping, DDP with a GradScaler (one read per step, the overflow flag before
/// the optimizer's step, as PyTorch's `GradScaler.step` makes), FSDP and TP.
fn sync_free_steps(device: Device) -> Res<Outcome> {
    if device == Device::Cpu {
        return Ok(Skip("CPU tensors never sync with a GPU".into()));
    }
    let pg = group(device, BackendConfig::NCCL)?;
    let data: Vec<(Tensor, Tensor)> =
        (0..6).map(|s| batch(s, 16)).map(|(x, y)| (x.to_device(device), y.to_device(device))).collect();
    type Phase<'a> = (&'static str, Box<dyn FnMut(usize) -> Res<()> + 'a>);
    // each case: its phases, run for 3 warm steps, then 3 counted; the syncs allowed per counted step
    let mut report = Vec::new();
    let mut run = |case: &str, allowed: usize, phases: &mut Vec<Phase>| -> Res<()> {
        for s in 0..3 {
            for (_, f) in phases.iter_mut() {
                f(s)?;
            }
        }
        tch::Cuda::synchronize(0);
        let counter = SyncCounter::start()?;
        // two deliberate syncs first: the count must see each, or the check proves nothing
        let one = Tensor::ones([1], (Kind::Float, device));
        let _ = (one.double_value(&[]), one.double_value(&[]));
        let seen = counter.count();
        let mut by_phase: Vec<(&str, usize)> = phases.iter().map(|(n, _)| (*n, 0)).collect();
        let mut failed = None;
        for s in 3..6 {
            for (k, (_, f)) in phases.iter_mut().enumerate() {
                let before = counter.count().unwrap_or(0);
                if let Err(e) = f(s) {
                    failed = Some(e);
                    break;
                }
                by_phase[k].1 += counter.count().unwrap_or(0) - before;
            }
        }
        drop(counter);
        if let Some(e) = failed {
            return Err(e);
        }
        let seen = seen?;
        ensure(seen == 2, || format!("the sync debug mode counted {seen} of 2 deliberate syncs"))?;
        let total: usize = by_phase.iter().map(|(_, n)| n).sum();
        let shown = by_phase.iter().map(|(n, c)| format!("{n} {c}")).collect::<Vec<_>>().join(", ");
        ensure(total <= 3 * allowed, || {
            format!("{case}: {total} host syncs in 3 warm steps (at most {}): {shown}", 3 * allowed)
        })?;
        report.push(format!("{case} {total}"));
        Ok(())
    };
    let ((vs, net), _) = twins(device, false)?;
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg.clone()))?;
    let opt = std::cell::RefCell::new(sgd(vs.trainable_variables()));
    let fwd_bwd = |s: usize| -> Res<()> {
        let (x, y) = &data[s];
        Ok(ddp.backward(&loss(&ddp.f_forward(x)?, y))?)
    };
    let step = |_| -> Res<()> { Ok(opt.borrow_mut().step()?) };
    let zero = |_| -> Res<()> { Ok(ddp.zero_grad()?) };
    run(
        "ddp",
        0,
        &mut vec![("forward+backward", Box::new(fwd_bwd)), ("step", Box::new(step)), ("zero_grad", Box::new(zero))],
    )?;
    let clip = |_| -> Res<()> { clip_grad_norm(&ddp.parameters(), 0.1, 2.0).map(|_| ()).map_err(Into::into) };
    run(
        "ddp+clip",
        0,
        &mut vec![
            ("forward+backward", Box::new(fwd_bwd)),
            ("clip", Box::new(clip)),
            ("step", Box::new(step)),
            ("zero_grad", Box::new(zero)),
        ],
    )?;
    let scaler = std::cell::RefCell::new(GradScaler::new().process_group(pg.clone()));
    let scaled = |s: usize| -> Res<()> {
        let (x, y) = &data[s];
        Ok(ddp.backward(&scaler.borrow().scale(&loss(&ddp.f_forward(x)?, y))?)?)
    };
    let unscale = |_| -> Res<()> { Ok(scaler.borrow_mut().unscale(&mut **opt.borrow_mut())?) };
    let scaled_step = |_| -> Res<()> {
        let mut sc = scaler.borrow_mut();
        sc.step(&mut **opt.borrow_mut())?;
        Ok(sc.update()?)
    };
    run(
        "ddp+scaler",
        1,
        &mut vec![
            ("forward+backward", Box::new(scaled)),
            ("unscale", Box::new(unscale)),
            ("step+update", Box::new(scaled_step)),
            ("zero_grad", Box::new(zero)),
        ],
    )?;
    let (_, (cpu_vs, _)) = twins(Device::Cpu, false)?;
    let model = fsdp_model(
        device,
        &[(D_IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, D_OUT)],
        &cpu_vs,
        FsdpOptions::default().process_group(pg.clone()),
    )?;
    let fopt = std::cell::RefCell::new(sgd(model.parameters()));
    let ffb = |s: usize| -> Res<()> {
        let (x, y) = &data[s];
        Ok(model.backward(&loss(&model.f_forward(x)?, y))?)
    };
    let fclip = |_| -> Res<()> { clip_grad_norm(&model.parameters(), 0.1, 2.0).map(|_| ()).map_err(Into::into) };
    let fstep = |_| -> Res<()> { Ok(fopt.borrow_mut().step()?) };
    let fzero = |_| -> Res<()> { Ok(model.zero_grad()?) };
    run(
        "fsdp+clip",
        0,
        &mut vec![
            ("forward+backward", Box::new(ffb)),
            ("clip", Box::new(fclip)),
            ("step", Box::new(fstep)),
            ("zero_grad", Box::new(fzero)),
        ],
    )?;
    let tvs = nn::VarStore::new(device);
    let w = |o: i64, i: i64| Tensor::randn([o, i], (Kind::Float, device)) * 0.1;
    let b = |o: i64| Tensor::zeros([o], (Kind::Float, device));
    let mlp =
        ParallelMlp::from_full(&tvs.root(), &w(HIDDEN, D_IN), &b(HIDDEN), &w(D_IN, HIDDEN), &b(D_IN), pg.clone())?;
    let topt = std::cell::RefCell::new(sgd(tvs.trainable_variables()));
    let tfb = |s: usize| -> Res<()> {
        let (x, _) = &data[s];
        Ok(mlp.f_forward(x)?.square().mean(Kind::Float).f_backward()?)
    };
    let tstep = |_| -> Res<()> {
        let mut o = topt.borrow_mut();
        o.step()?;
        Ok(o.zero_grad()?)
    };
    run("tp", 0, &mut vec![("forward+backward", Box::new(tfb)), ("step+zero_grad", Box::new(tstep))])?;
    Ok(Pass(format!("host syncs in 3 warm steps: {} (2 deliberate ones were counted)", report.join(", "))))
}

/// The two-process checks: both ranks on one GPU over Gloo (NCCL refuses two ranks on one GPU), each
/// with its half of the batch, against plain training on the CPU.
const RANK_CHECKS: &[&str] = &[
    "ddp-views-on",
    "ddp-views-off",
    "zero2",
    "fsdp-prefetch",
    "fsdp-offload",
    "fsdp-no-reshard",
    "pipeline-1f1b",
    "sync-bn",
    "tp-attention-dropout",
];

fn rank_check(what: &str, device: Device) -> Res<Outcome> {
    if !RANK_CHECKS.contains(&what) {
        return Err(format!("no two-process check {what:?} (one of {RANK_CHECKS:?})").into());
    }
    let mut init = InitOptions::from_env()?;
    init.backend = Some(Backend::Gloo.into());
    let pg = Arc::new(ProcessGroup::init(&init)?);
    let (rank, world) = (pg.rank() as i64, pg.size() as i64);
    let per = 16 / world;
    let half = |s: usize| {
        let (x, y) = batch(s, 16);
        (x.narrow(0, rank * per, per).to_device(device), y.narrow(0, rank * per, per).to_device(device))
    };
    let detail = match what {
        // on CUDA: prefetched gathers on the gather stream, reduce-scatters on the reduce stream; with
        // offload, pinned host shards and copies that do not block; without resharding, a reduction
        // left running through the next unit's backward, received into the gathered buffer
        "fsdp-prefetch" | "fsdp-offload" | "fsdp-no-reshard" => {
            let (_, (cpu_vs, _)) = twins_of(Device::Cpu, &wide_mlp)?;
            let w = 2048;
            let dims = [(D_IN, w), (w, w), (w, w), (w, w), (w, D_OUT)];
            let mut opts = FsdpOptions::default().prefetch(2).process_group(pg.clone());
            match what {
                "fsdp-offload" => opts = opts.offload(Device::Cpu),
                "fsdp-no-reshard" => opts = opts.reshard_after_forward(false),
                _ => {}
            }
            let model = fsdp_model(device, &dims, &cpu_vs, opts)?;
            let mut opt = sgd(model.parameters());
            for s in 0..STEPS {
                let (x, y) = half(s);
                model.backward(&loss(&model.f_forward(&x)?, &y))?;
                opt.step()?;
                model.zero_grad()?;
            }
            let got: BTreeMap<String, Tensor> =
                model.state_dict()?.into_iter().map(|(n, t)| (n, t.to_device(Device::Cpu))).collect();
            let diff = max_diff(&got, &reference_of(&wide_mlp, sgd)?)?;
            ensure(diff < 1e-5, || format!("rank {rank}: FSDP differs from plain CPU training by {diff:e}"))?;
            let mode = match what {
                "fsdp-offload" => ", shards offloaded to the host",
                "fsdp-no-reshard" => ", no resharding after forward",
                _ => "",
            };
            format!("FSDP, a unit per Linear, prefetch 2{mode}, {STEPS} steps, max |diff| vs CPU {diff:.1e}")
        }
        // the shim's SyncBatchNorm node on CUDA tensors (a one-rank group falls back to tch's kernel)
        "sync-bn" => sync_bn_rank(&pg, device)?,
        "tp-attention-dropout" => tp_attention_dropout_rank(&pg, device)?,
        "pipeline-1f1b" => {
            let layers = split_layers();
            let cpu_ref = layers.build_stage(0..layers.len(), Device::Cpu)?;
            let part = Partition::sizes(&[2, 1], 3)?;
            let cfg =
                PipelineConfig { device, schedule: ScheduleKind::OneFOneB, microbatches: 4, ..Default::default() };
            let mut stage = PipelineRank::build(pg.clone(), &layers, &part, cfg)?;
            for vs in stage.var_stores() {
                copy_vars(vs, &cpu_ref.vs)?;
            }
            let mut opts = stage
                .var_stores()
                .iter()
                .map(|vs| nn::Sgd::default().build(vs, 0.05))
                .collect::<Result<Vec<_>, _>>()?;
            for s in 0..STEPS {
                let (x, y) = split_data(s);
                stage.step(&x.to_device(device), &y.to_device(device), &loss)?;
                opts.iter_mut().for_each(|o| o.step());
                stage.zero_grad()?;
            }
            let got: BTreeMap<String, Tensor> = stage.var_stores().iter().flat_map(|vs| by_name(vs)).collect();
            let want: BTreeMap<String, Tensor> =
                unsplit(&layers, STEPS, &split_data)?.0.into_iter().filter(|(n, _)| got.contains_key(n)).collect();
            let diff = max_diff(&got, &want)?;
            ensure(diff < 1e-5, || format!("rank {rank}: its stage differs from the unsplit CPU model by {diff:e}"))?;
            format!("1F1B, stage {rank} of 2, 4 microbatches, {STEPS} steps, max |diff| vs unsplit CPU {diff:.1e}")
        }
        _ => {
            let ((vs, net), _) = twins_of(device, &wide_mlp)?;
            let views = what != "ddp-views-off";
            let opts =
                DdpOptions::default().gradient_as_bucket_view(views).bucket_cap_mb(4.0).process_group(pg.clone());
            let ddp = DistributedDataParallel::new(&vs, net, opts)?;
            let mut opt: Box<dyn Optimizer> = if what == "zero2" {
                Box::new(ShardedOptimizer::new(&ddp, ZeroStage::Two, |p| Box::new(Sgd::new(p, 0.05).momentum(0.9)))?)
            } else {
                sgd(vs.trainable_variables())
            };
            for s in 0..STEPS {
                let (x, y) = half(s);
                ddp.backward(&loss(&ddp.f_forward(&x)?, &y))?;
                opt.step()?;
                ddp.zero_grad()?;
            }
            let diff = max_diff(&by_name(&vs), &reference_of(&wide_mlp, sgd)?)?;
            ensure(diff < 1e-5, || format!("rank {rank}: parameters differ from plain CPU training by {diff:e}"))?;
            format!("5 x Linear 2048 wide (~51 MB), 4 MB buckets, {STEPS} steps, max |diff| vs CPU {diff:.1e}")
        }
    };
    // Gloo's send/recv read host memory: CUDA tensors go through the CPU on the way
    let sent = Tensor::arange(1000, (Kind::Float, device)) * (rank + 1);
    let got = Tensor::zeros([1000], (Kind::Float, device));
    let peer = (1 - rank) as usize;
    // one batch: a send and a receive between the same pair posted one by one would hang on NCCL
    pg.batch_isend_irecv(vec![P2pOp::send(&sent, peer).tag(3), P2pOp::recv(&got, peer).tag(3)])?.wait()?;
    ensure(
        got.device() == device && got.equal(&(Tensor::arange(1000, (Kind::Float, device)) * (peer as i64 + 1))),
        || "send/recv of a CUDA tensor over gloo went wrong".into(),
    )?;
    Ok(Pass(format!("rank {rank} of {world}, gloo on {device:?}: {detail}; send/recv ok")))
}

/// SyncBatchNorm2d over the two ranks (3 and 5 rows), two training steps on `device`: this rank's
/// output, input gradient and running statistics against tch's BatchNorm on the CPU over both ranks'
/// rows, which each rank computes itself.
/// Head-parallel attention over the two ranks with dropout: each rank's masks from a generator of its
/// own on the device (a new CUDA generator on the GPU). Without training it equals the full layer on the
/// CPU; in training with dropout 0.5 it differs and stays finite; with dropout 1 only the output bias is
/// left.
fn tp_attention_dropout_rank(pg: &Arc<ProcessGroup>, device: Device) -> Res<String> {
    let (d, heads, b, s) = (16i64, 4i64, 2i64, 8i64);
    let wave = |shape: &[i64], k: f64| {
        let n: i64 = shape.iter().product();
        ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + k).sin() * 0.3).view(shape)
    };
    let w = [wave(&[3 * d, d], 1.0), wave(&[3 * d], 2.0), wave(&[d, d], 3.0), wave(&[d], 4.0)];
    let x = wave(&[b, s, d], 5.0);
    // the full layer on the CPU, written out
    let want = {
        let hd = d / heads;
        let qkv = x.linear(&w[0], Some(&w[1])).view([b, s, 3, heads, hd]).permute([2, 0, 3, 1, 4]);
        let scores = qkv.get(0).matmul(&qkv.get(1).transpose(-2, -1)) / (hd as f64).sqrt();
        let future = Tensor::ones([s, s], (Kind::Bool, Device::Cpu)).triu(1);
        let probs = scores.masked_fill(&future, f64::NEG_INFINITY).softmax(-1, Kind::Float);
        probs.matmul(&qkv.get(2)).transpose(1, 2).contiguous().view([b, s, d]).linear(&w[2], Some(&w[3]))
    };
    let layer = |dropout: f64| -> Res<ParallelAttention> {
        let vs = nn::VarStore::new(device);
        let on = |t: &Tensor| t.to_device(device);
        let cfg = ParallelAttentionConfig { causal: true, dropout, ..Default::default() };
        Ok(ParallelAttention::from_full(
            &vs.root(),
            &on(&w[0]),
            &on(&w[1]),
            &on(&w[2]),
            &on(&w[3]),
            heads,
            pg.clone(),
            cfg,
        )?)
    };
    let xd = x.to_device(device);
    let half = layer(0.5)?;
    let cpu = |t: Tensor| t.to_device(Device::Cpu);
    let eval = cpu(half.f_forward_t(&xd, false)?);
    let train = cpu(half.f_forward_t(&xd, true)?);
    let all = cpu(layer(1.0)?.f_forward_t(&xd, true)?);
    let rank = pg.rank();
    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    let e = diff(&eval, &want);
    ensure(e < 1e-5, || format!("rank {rank}: without training the output differs from the CPU's by {e:e}"))?;
    let t = diff(&train, &want);
    ensure(t.is_finite() && t > 1e-3, || format!("rank {rank}: dropout 0.5 in training changed the output by {t:e}"))?;
    let a = diff(&all, &w[3].view([1, 1, d]));
    ensure(a < 1e-5, || format!("rank {rank}: dropout 1 left more than the output bias ({a:e})"))?;
    Ok(format!("ParallelAttention, {heads} heads over 2 ranks, dropout masks drawn per rank: eval vs CPU {e:.1e}, dropout 1 leaves the bias"))
}

fn sync_bn_rank(pg: &Arc<ProcessGroup>, device: Device) -> Res<String> {
    let (c, rows) = (4i64, [3i64, 5]);
    let rank = pg.rank();
    let data = |r: usize, n: i64, k: f64| {
        let x = (Tensor::arange(n * c * 6, (Kind::Float, Device::Cpu)).reshape([n, c, 3, 2]) * 0.31 + k + r as f64)
            .sin()
            * (r as f64 + 1.5);
        let t = (Tensor::arange(n * c * 6, (Kind::Float, Device::Cpu)).reshape([n, c, 3, 2]) * 0.17 + k).cos();
        (x, t)
    };
    // the reference: both ranks' rows, in one process on the CPU
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = nn::batch_norm2d(vs.root() / "bn", c, Default::default());
    // tch draws the scale uniformly: one fixed affine on both sides
    let affine = |w: &Option<Tensor>, b: &Option<Tensor>| {
        tch::no_grad(|| {
            if let (Some(w), Some(b)) = (w, b) {
                let _ = w.shallow_clone().fill_(1.5);
                let _ = b.shallow_clone().fill_(0.25);
            }
        })
    };
    affine(&bn.ws, &bn.bs);
    let cat = |k: f64| {
        let parts: Vec<(Tensor, Tensor)> = rows.iter().enumerate().map(|(r, &n)| data(r, n, k)).collect();
        let xs: Vec<&Tensor> = parts.iter().map(|p| &p.0).collect();
        let ts: Vec<&Tensor> = parts.iter().map(|p| &p.1).collect();
        (Tensor::cat(&xs, 0), Tensor::cat(&ts, 0))
    };
    let _ = bn.forward_t(&cat(10.0).0, true);
    let (x, t) = cat(0.0);
    let x = x.set_requires_grad(true);
    let y = bn.forward_t(&x, true);
    (&y * &t).sum(Kind::Float).backward();
    let at = if rank == 0 { 0 } else { rows[0] };
    let (want_y, want_gx) = (y.detach().narrow(0, at, rows[rank]), x.grad().narrow(0, at, rows[rank]));
    // this rank's layer on the device
    let vs = nn::VarStore::new(device);
    let sbn = tch_dist::sync_batch_norm::sync_batch_norm2d(vs.root() / "bn", c, Default::default(), pg.clone());
    affine(&sbn.ws, &sbn.bs);
    let _ = sbn.f_forward_t(&data(rank, rows[rank], 10.0).0.to_device(device), true)?;
    let (x, t) = data(rank, rows[rank], 0.0);
    let x = x.to_device(device).set_requires_grad(true);
    let y = sbn.f_forward_t(&x, true)?;
    (&y * &t.to_device(device)).sum(Kind::Float).backward();
    let cpu = |t: &Tensor| t.detach().to_device(Device::Cpu);
    let diffs = [
        ("output", (cpu(&y) - &want_y).abs().max().double_value(&[])),
        ("input gradient", (cpu(&x.grad()) - &want_gx).abs().max().double_value(&[])),
        ("running mean", (cpu(&sbn.running_mean) - &bn.running_mean).abs().max().double_value(&[])),
        ("running variance", (cpu(&sbn.running_var) - &bn.running_var).abs().max().double_value(&[])),
    ];
    for (what, d) in diffs {
        ensure(d < 1e-5, || format!("rank {rank}: SyncBatchNorm's {what} differs from one CPU process by {d:e}"))?;
    }
    let worst = diffs.iter().map(|(_, d)| *d).fold(0.0, f64::max);
    Ok(format!("SyncBatchNorm2d, rows 3 and 5, 2 steps, max |diff| vs one CPU process {worst:.1e}"))
}

/// Linear layers of `dims` on `device`, each an FSDP unit, with ReLU after the first, tanh between the
/// others (`mlp` and `wide_mlp` in units), starting from `cpu`'s values.
fn fsdp_model(
    device: Device,
    dims: &[(i64, i64)],
    cpu: &nn::VarStore,
    opts: FsdpOptions,
) -> Res<FullyShardedDataParallel<nn::Sequential>> {
    let vs = nn::VarStore::new(device);
    let layers: Vec<(nn::Path, nn::Linear)> = dims
        .iter()
        .enumerate()
        .map(|(i, &(d_in, d_out))| {
            let p = vs.root() / format!("l{}", i + 1);
            let l = nn::linear(&p, d_in, d_out, Default::default());
            (p, l)
        })
        .collect();
    // the CPU twin's values, before sharding takes them
    copy_vars(&vs, cpu)?;
    let f = FsdpBuilder::new(&vs, opts)?;
    let mut net = nn::seq();
    let last = layers.len() - 1;
    for (i, (p, l)) in layers.into_iter().enumerate() {
        let unit = f.fully_shard(&p, l)?;
        net = match i {
            0 => net.add(unit).add_fn(|x| x.relu()),
            i if i == last => net.add(unit),
            _ => net.add(unit).add_fn(|x| x.tanh()),
        };
    }
    Ok(f.finish(net)?)
}

// ---- benchmarks (the PyTorch side: torch_gpu.py, same model, same sizes)

const BENCH_WIDTH: i64 = 4096;
const BENCH_DEPTH: usize = 8;
const BENCH_BATCH: i64 = 64;

fn bench_ddp(steps: usize) -> Res<Outcome> {
    let Some(device) = device_of("cuda")? else { return Ok(Skip("no CUDA device".into())) };
    let pg = group(device, BackendConfig::NCCL)?;
    let vs = nn::VarStore::new(device);
    let mut net = nn::seq();
    for i in 0..BENCH_DEPTH {
        net = net
            .add(nn::linear(vs.root() / format!("l{i}"), BENCH_WIDTH, BENCH_WIDTH, Default::default()))
            .add_fn(|x| x.relu());
    }
    let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg))?;
    let mut opt = Sgd::new(vs.trainable_variables(), 1e-3);
    let x = Tensor::randn([BENCH_BATCH, BENCH_WIDTH], (Kind::Float, device));
    let mut step = || -> Res<()> {
        let l = ddp.f_forward(&x)?.square().mean(Kind::Float);
        ddp.backward(&l)?;
        opt.step()?;
        ddp.zero_grad()?;
        Ok(())
    };
    for _ in 0..5 {
        step()?;
    }
    tch::Cuda::synchronize(0);
    memory::reset_peak(device)?;
    let start = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    tch::Cuda::synchronize(0);
    let ms = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
    let peak = memory::peak(device)?;
    println!("BENCH ddp step_ms {ms:.3} peak_bytes {peak}");
    Ok(Pass(format!(
        "{BENCH_DEPTH} x Linear({BENCH_WIDTH}, {BENCH_WIDTH}), batch {BENCH_BATCH}: {ms:.2} ms/step, peak {peak} B"
    )))
}

fn bench_allreduce(iters: usize) -> Res<Outcome> {
    let Some(device) = device_of("cuda")? else { return Ok(Skip("no CUDA device".into())) };
    let pg = group(device, BackendConfig::NCCL)?;
    let mut shown = Vec::new();
    for mib in [1i64, 4, 16, 64, 256, 1024] {
        let mut t = Tensor::ones([mib * 1024 * 1024 / 4], (Kind::Float, device));
        for _ in 0..3 {
            pg.allreduce(&mut t, ReduceOp::Sum)?;
        }
        tch::Cuda::synchronize(0);
        let start = Instant::now();
        for _ in 0..iters {
            pg.allreduce_async(&mut t, ReduceOp::Sum)?.wait()?;
        }
        tch::Cuda::synchronize(0);
        let s = start.elapsed().as_secs_f64() / iters as f64;
        let gbs = (mib * 1024 * 1024) as f64 / s / 1e9;
        println!("BENCH allreduce mib {mib} us {:.1} gb_per_s {gbs:.2}", s * 1e6);
        shown.push(format!("{mib} MiB {gbs:.1} GB/s"));
    }
    Ok(Pass(shown.join(", ")))
}
