//! Pipeline-parallel training of a deep MLP on synthetic data (a fixed random "teacher" network).
//!
//!   pipeline [--stages 2] [--schedule gpipe|1f1b|interleaved] [--microbatches 8] [--chunks 2]
//!            [--steps 20] [--batch 256] [--recompute] [--form processes|threads] [--trace out.json] [--png out.png]
//!   pipeline --all        # 2 and 4 stages, every schedule: a summary table
//!   pipeline --unsplit    # the same model in one process, for comparison
//!
//! With `--form processes` (default) the example starts one process per stage (itself, through tchrun)
//! so each stage's peak memory is its own; stages talk through send/recv over Gloo.
//! Prints loss, throughput, the measured bubble fraction against the formula, and per-stage memory.
use std::process::{Command, Stdio};

use clap::Parser;
use std::sync::Arc;
use std::time::Instant;

use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
use tch_dist::pipeline::schedule::{Schedule, ScheduleKind};
use tch_dist::pipeline::{trace, ActionSpan, LayerList, Partition, Pipeline, PipelineConfig, PipelineRank};
use tch_dist::{memory, ProcessGroup};

const WIDTH: i64 = 1024;
const DEPTH: usize = 16; // linear layers, each followed by tanh
const DEFAULT_BATCH: i64 = 256;
const LR: f64 = 0.05;

#[derive(Parser, Clone, Debug)]
#[command(about = "Pipeline-parallel training of a 16-layer MLP on synthetic data")]
struct Cli {
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// gpipe, 1f1b or interleaved
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Model chunks per stage (interleaved: 2 by default)
    #[arg(long)]
    chunks: Option<usize>,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[arg(long, default_value_t = DEFAULT_BATCH)]
    batch: i64,
    /// Keep only stage inputs in flight, recompute forwards during backward
    #[arg(long)]
    recompute: bool,
    /// processes (one per stage, started through tchrun) or threads (one process)
    #[arg(long, default_value = "processes")]
    form: String,
    /// Chrome trace of the last step
    #[arg(long)]
    trace: Option<String>,
    /// PNG timeline of the last step
    #[arg(long)]
    png: Option<String>,
    /// 2 and 4 stages, every schedule: a summary table
    #[arg(long)]
    all: bool,
    /// The same model in one process, for comparison
    #[arg(long)]
    unsplit: bool,
    /// Intra-op threads of the unsplit run
    #[arg(long, default_value_t = 1)]
    threads: i32,
    /// (internal) run one stage; tchrun starts these
    #[arg(long, hide = true)]
    worker: bool,
}

struct Args {
    stages: usize,
    schedule: ScheduleKind,
    m: usize,
    v: usize,
    steps: usize,
    batch: i64,
    recompute: bool,
    threads_form: bool,
    trace: Option<String>,
    png: Option<String>,
}

fn parse(c: &Cli) -> Result<Args, Box<dyn std::error::Error>> {
    let schedule: ScheduleKind = c.schedule.parse()?;
    let v = c.chunks.unwrap_or(if schedule == ScheduleKind::Interleaved1F1B { 2 } else { 1 });
    Ok(Args {
        stages: c.stages,
        schedule,
        m: c.microbatches,
        v,
        steps: c.steps,
        batch: c.batch,
        recompute: c.recompute,
        threads_form: c.form == "threads",
        trace: c.trace.clone(),
        png: c.png.clone(),
    })
}

fn layers() -> LayerList {
    let mut l = LayerList::new().seed(7);
    for i in 0..DEPTH {
        l = l
            .add(&format!("fc{i}"), |p| nn::linear(p, WIDTH, WIDTH, Default::default()))
            .add_fn(&format!("tanh{i}"), |x| x.tanh());
    }
    l
}

thread_local! {
    /// The fixed W of the synthetic data, drawn once per thread (as scripts/bench_pipeline.py draws it).
    static TARGET_W: Tensor = {
        tch::manual_seed(10_000);
        Tensor::randn([WIDTH, WIDTH], (Kind::Float, Device::Cpu)) / (WIDTH as f64).sqrt()
    };
}

/// Synthetic regression data: y = sin(x W) for a fixed W; each step a fresh batch of `rows`.
fn batch(step: usize, rows: i64) -> (Tensor, Tensor) {
    let w = TARGET_W.with(|w| w.shallow_clone());
    tch::manual_seed(step as i64);
    let x = Tensor::randn([rows, WIDTH], (Kind::Float, Device::Cpu));
    let y = x.matmul(&w).sin();
    (x, y)
}

fn loss(out: &Tensor, y: &Tensor) -> Tensor {
    out.mse_loss(y, tch::Reduction::Mean)
}

fn partition(a: &Args) -> Result<Partition, Box<dyn std::error::Error>> {
    // Balanced by parameter bytes over p * v parts.
    let bytes: Vec<f64> = layers().param_bytes()?.into_iter().map(|b| b as f64).collect();
    Ok(Partition::balanced(&bytes, a.stages * a.v)?)
}

/// The schedule, microbatches, chunks per rank and recomputation the flags ask for.
fn config(a: &Args) -> PipelineConfig {
    PipelineConfig {
        schedule: a.schedule,
        microbatches: a.m,
        chunks: a.v,
        recompute: a.recompute,
        ..Default::default()
    }
}

/// (losses, spans of the last step, seconds, microbatches in flight per stage)
type ThreadsRun = (Vec<f64>, Vec<ActionSpan>, f64, Vec<usize>);

/// Runs the steps in one process.
fn run_threads(a: &Args) -> Result<ThreadsRun, Box<dyn std::error::Error>> {
    let mut pipe = Pipeline::new(&layers(), &partition(a)?, &vec![Device::Cpu; a.stages], config(a))?;
    let mut opts =
        pipe.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, LR)).collect::<Result<Vec<_>, _>>()?;
    let (mut losses, mut spans, mut inflight) = (Vec::new(), Vec::new(), vec![0; a.stages]);
    let start = Instant::now();
    for s in 0..a.steps {
        let (x, y) = batch(s, a.batch);
        let r = pipe.step(&x, &y, &loss)?;
        opts.iter_mut().for_each(|o| o.step());
        pipe.zero_grad()?;
        losses.push(r.loss);
        inflight.iter_mut().zip(&r.max_in_flight).for_each(|(a, b)| *a = (*a).max(*b));
        if s + 1 == a.steps {
            spans = r.spans;
        }
    }
    Ok((losses, spans, start.elapsed().as_secs_f64(), inflight))
}

/// One stage process (started by `run_processes` with torchrun's environment).
fn worker(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    tch::set_num_threads(1); // stages share the machine's cores
    memory::install_cpu_counter()?;
    let pg = Arc::new(ProcessGroup::from_env()?);
    let mut st = PipelineRank::build(pg.clone(), &layers(), &partition(a)?, config(a))?;
    let mut opts = st.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, LR)).collect::<Result<Vec<_>, _>>()?;
    let base = memory::allocated(Device::Cpu)?;
    memory::reset_peak(Device::Cpu)?;
    pg.barrier()?;
    let start = Instant::now();
    let cpu0 = cpu_seconds();
    let mut inflight = 0;
    for s in 0..a.steps {
        let (x, y) = batch(s, a.batch);
        let r = st.step(&x, &y, &loss)?;
        opts.iter_mut().for_each(|o| o.step());
        st.zero_grad()?;
        inflight = inflight.max(r.max_in_flight);
        if let Some(l) = r.loss {
            println!("loss {s} {}", l.double_value(&[]));
        }
        if s + 1 == a.steps {
            for sp in &r.spans {
                println!("span {} {} {} {} {} {}", sp.stage, sp.forward as u8, sp.mb, sp.chunk, sp.start, sp.end);
            }
        }
    }
    pg.barrier()?;
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    println!(
        "stage {} seconds {secs} base {base} peak {} inflight {inflight} cpu {cpu}",
        pg.rank(),
        memory::peak(Device::Cpu)?
    );
    Ok(())
}

/// This process's CPU time, all threads (a stage has one intra-op thread, so its CPU time is its busy time).
fn cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

struct Outcome {
    losses: Vec<f64>,
    spans: Vec<ActionSpan>,
    seconds: f64,
    per_stage: Vec<(i64, i64, usize)>, // base, peak, in flight
    /// Each stage's idle fraction, 1 - CPU time / wall time (processes only).
    idle: Vec<f64>,
}

/// One process per stage, started through tchrun (built beside this example); their lines come back
/// prefixed `[rankR]: `.
fn run_processes(a: &Args) -> Result<Outcome, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let tchrun =
        exe.parent().and_then(|d| d.parent()).map(|d| d.join("tchrun")).ok_or("no tchrun beside the example")?;
    if !tchrun.exists() {
        return Err(format!("{} not built (cargo build --bin tchrun)", tchrun.display()).into());
    }
    let o = Command::new(&tchrun)
        .args(["--standalone", "--nproc-per-node", &a.stages.to_string(), "--"])
        .arg(&exe)
        .args(["--worker", "--stages", &a.stages.to_string(), "--schedule", sched_name(a.schedule)])
        .args(["--microbatches", &a.m.to_string(), "--chunks", &a.v.to_string(), "--steps", &a.steps.to_string()])
        .args(["--batch", &a.batch.to_string()])
        .args(if a.recompute { &["--recompute"][..] } else { &[][..] })
        .stderr(Stdio::inherit())
        .output()?;
    if !o.status.success() {
        return Err(format!("the stage processes failed ({})", o.status).into());
    }
    let mut out = Outcome {
        losses: Vec::new(),
        spans: Vec::new(),
        seconds: 0.0,
        per_stage: vec![(0, 0, 0); a.stages],
        idle: vec![0.0; a.stages],
    };
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let Some((r, line)) = line.strip_prefix("[rank").and_then(|l| l.split_once("]: ")) else { continue };
        let r: usize = r.parse()?;
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.first() {
            Some(&"loss") => out.losses.push(w[2].parse()?),
            Some(&"span") => out.spans.push(ActionSpan {
                stage: w[1].parse()?,
                forward: w[2] == "1",
                mb: w[3].parse()?,
                chunk: w[4].parse()?,
                start: w[5].parse()?,
                end: w[6].parse()?,
            }),
            Some(&"stage") => {
                out.seconds = out.seconds.max(w[3].parse()?);
                out.per_stage[r] = (w[5].parse()?, w[7].parse()?, w[9].parse()?);
                let (secs, cpu): (f64, f64) = (w[3].parse()?, w[11].parse()?);
                out.idle[r] = 1.0 - cpu / secs;
            }
            _ => {}
        }
    }
    Ok(out)
}

fn sched_name(k: ScheduleKind) -> &'static str {
    match k {
        ScheduleKind::GPipe => "gpipe",
        ScheduleKind::OneFOneB => "1f1b",
        ScheduleKind::Interleaved1F1B => "interleaved",
        ScheduleKind::ZeroBubbleH1 => "zb-h1",
    }
}

fn unsplit(a: &Args, threads: i32) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    tch::set_num_threads(threads);
    let l = layers();
    let stage = l.build_stage(0..l.len(), Device::Cpu)?;
    let mut opt = nn::Sgd::default().build(&stage.vs, LR)?;
    let mut last = 0.0;
    let start = Instant::now();
    for s in 0..a.steps {
        let (x, y) = batch(s, a.batch);
        opt.zero_grad();
        let lo = loss(&stage.forward(&x), &y);
        last = lo.double_value(&[]);
        lo.backward();
        opt.step();
    }
    Ok((a.batch as f64 * a.steps as f64 / start.elapsed().as_secs_f64(), last))
}

fn report(a: &Args, o: &Outcome) -> Result<(), Box<dyn std::error::Error>> {
    let formula = Schedule::new(a.schedule, a.stages, a.m, a.v)?.ideal_bubble_fraction();
    let bubble = trace::bubble_fraction(&o.spans, a.stages);
    println!(
        "{:<12} p={} m={:<2} v={} recompute={:<5} loss {:.4} -> {:.4}  {:>7.1} samples/s  bubble {:.3} (formula {:.3})",
        sched_name(a.schedule),
        a.stages,
        a.m,
        a.v,
        a.recompute,
        o.losses.first().copied().unwrap_or(f64::NAN),
        o.losses.last().copied().unwrap_or(f64::NAN),
        a.batch as f64 * a.steps as f64 / o.seconds,
        bubble,
        formula
    );
    if !o.idle.is_empty() {
        println!(
            "    idle {:.4} (1 - CPU time / wall time, mean over the stages)",
            o.idle.iter().sum::<f64>() / o.idle.len() as f64
        );
    }
    for (s, (base, peak, inflight)) in o.per_stage.iter().enumerate() {
        if *peak > 0 {
            println!("    stage {s}: peak {:.2} MB ({:.2} MB above its parameters), {inflight} microbatch-chunks in flight at most", *peak as f64 / 1e6, (peak - base) as f64 / 1e6);
        } else {
            println!("    stage {s}: {inflight} microbatch-chunks in flight at most");
        }
    }
    if let Some(p) = &a.trace {
        trace::write_chrome_trace(std::path::Path::new(p), &o.spans)?;
        println!("    trace of the last step: {p} (open in chrome://tracing or ui.perfetto.dev)");
    }
    if let Some(p) = &a.png {
        trace::write_png(std::path::Path::new(p), &o.spans, a.stages)?;
        println!("    timeline of the last step: {p}");
    }
    Ok(())
}

fn run(a: &Args) -> Result<Outcome, Box<dyn std::error::Error>> {
    if a.threads_form {
        let (losses, spans, seconds, inflight) = run_threads(a)?;
        let per_stage = inflight.into_iter().map(|f| (0, 0, f)).collect();
        Ok(Outcome { losses, spans, seconds, per_stage, idle: Vec::new() })
    } else {
        run_processes(a)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let a = parse(&cli)?;
    if cli.worker {
        return worker(&a);
    }
    if cli.unsplit {
        let (tput, last) = unsplit(&a, cli.threads)?;
        println!("unsplit: {tput:.1} samples/s, final loss {last:.4}");
        return Ok(());
    }
    if cli.all {
        for p in [2, 4] {
            for (k, v) in [(ScheduleKind::GPipe, 1), (ScheduleKind::OneFOneB, 1), (ScheduleKind::Interleaved1F1B, 2)] {
                let b = Args { stages: p, schedule: k, v, trace: None, png: None, ..parse(&cli)? };
                report(&b, &run(&b)?)?;
            }
        }
        return Ok(());
    }
    report(&a, &run(&a)?)
}
