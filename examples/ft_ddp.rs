//! DDP replicas that survive the loss of one another (tch_dist::ft), for `tchrun` and the fault-tolerance
//! tests. Start a lighthouse, then one `tchrun` per replica:
//!
//!   tchrun lighthouse --bind 127.0.0.1:29510 &
//!   for r in 0 1 2; do
//!     tchrun --standalone --nproc-per-node 1 --max-restarts 1 --replica-id $r --lighthouse 127.0.0.1:29510 \
//!       -- ft_ddp --steps 50 --log /tmp/ft/r$r.log --out /tmp/ft/r$r.safetensors &
//!   done
//!
//! Each replica trains on its own batches (drawn from its replica id, local rank and step), and the
//! gradient of a step is the mean over the replicas that took part. `--log` gets one JSON line per event:
//! `commit` (a step counted, with the quorum's members), `discard` (a step run again), `kill`.
//! `--out` gets the final parameters and optimizer state (`model/*`, `optim/*`; local rank L > 0 of a
//! replica writes `OUT.rankL`).
//!
//! `--reference LOG...` replays in one process what the replicas' logs say happened (per step, the members
//! whose batches made the gradient) and writes the result to `--out`: the fault-tolerant run must equal it.
//!
//! `--ckpt DIR --every K`: the quorum's first replica saves a sharded checkpoint every K steps (its ranks
//! together, `checkpoint::Checkpointer`), and replicas resume from the newest when they start (the
//! fallback when every replica was lost).
//!
//! `--restart-from CKPT` trains the same way as one DDP job of all ranks, checkpointing every `--every`
//! steps: the baseline, whose only recovery is `tchrun --max-restarts` restarting every worker (there
//! `--kill-at-step` kills the last rank).
//!
//! `--kill-at-step S` SIGKILLs this replica in the middle of the backward of step S, or of the first step
//! after S it runs when it joined later (on its first start only; a restarted one goes on): some gradient
//! buckets are already being reduced across replicas.
//!
//! `--fsdp`: HSDP instead of DDP. Each replica shards the model with FSDP over its own ranks (a unit
//! per layer), and the manager sums each reduce-scattered chunk across the replicas; healing sends each
//! rank's shards. `--out` then holds the full parameters (`model/*`, gathered), this rank's shards
//! (`shard/*`) and its optimizer state (`optim/*`, of the shards).
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;
use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::checkpoint::{self, Checkpointer, StateDict};
use tch_dist::ddp::{CommHook, DdpOptions, DistributedDataParallel, GradBucket, HookFuture};
use tch_dist::fsdp::{FsdpBuilder, FsdpOptions, FullyShardedDataParallel, Replicas};
use tch_dist::ft::{Manager, ManagerConfig};
use tch_dist::optim::{AdamW, Optimizer};
use tch_dist::DistModule;
use tch_dist::ProcessGroup;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Append one JSON line per event here
    #[arg(long)]
    log: Option<PathBuf>,
    /// Write the final parameters and optimizer state here (safetensors)
    #[arg(long)]
    out: Option<PathBuf>,
    /// SIGKILL this replica in the middle of backward at this step (first start only)
    #[arg(long)]
    kill_at_step: Option<u64>,
    /// Train in float64 (the tests compare with a reference run to 1e-6)
    #[arg(long)]
    f64: bool,
    /// Sleep this long in each step (stands for a bigger model's compute, so that restarts happen while
    /// the others train)
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// Width of the hidden layers
    #[arg(long, default_value_t = 256)]
    hidden: i64,
    /// Replay these replicas' logs in one process instead (see the module docs)
    #[arg(long, num_args = 1..)]
    reference: Vec<PathBuf>,
    /// With --reference: ranks per replica in the run being replayed
    #[arg(long, default_value_t = 1)]
    ranks_per_replica: usize,
    /// Fault tolerance: save sharded checkpoints under this directory every --every steps (the first
    /// member of the quorum does), and resume from the newest at start (every replica lost)
    #[arg(long)]
    ckpt: Option<PathBuf>,
    /// For comparison: train as one DDP job of all ranks (rank R draws replica R's batches), whose only
    /// recovery is tchrun's restart of every worker from this checkpoint
    #[arg(long)]
    restart_from: Option<PathBuf>,
    /// With --ckpt or --restart-from: save the checkpoint every this many steps
    #[arg(long, default_value_t = 5)]
    every: u64,
    /// HSDP: shard each replica with FSDP over its own ranks (see the module docs)
    #[arg(long)]
    fsdp: bool,
}

const IN: i64 = 32;

fn kind(args: &Args) -> Kind {
    if args.f64 {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// The three linear layers, created in order from the seed and then cast to the run's dtype.
fn layers(vs: &mut nn::VarStore, args: &Args) -> Vec<(&'static str, nn::Linear)> {
    let h = args.hidden;
    let out = {
        let root = vs.root();
        [("l1", IN, h), ("l2", h, h), ("l3", h, 1)]
            .into_iter()
            .map(|(n, i, o)| (n, nn::linear(&root / n, i, o, Default::default())))
            .collect()
    };
    vs.set_kind(kind(args));
    out
}

/// The layers with tanh between them, each passed through `wrap` (an FSDP unit, or as it is).
fn stack<M: Module + 'static>(
    layers: Vec<(&'static str, nn::Linear)>,
    mut wrap: impl FnMut(&str, nn::Linear) -> tch_dist::Result<M>,
) -> tch_dist::Result<nn::Sequential> {
    let n = layers.len();
    let mut seq = nn::seq();
    for (k, (name, l)) in layers.into_iter().enumerate() {
        seq = seq.add(wrap(name, l)?);
        if k + 1 < n {
            seq = seq.add_fn(|x| x.tanh());
        }
    }
    Ok(seq)
}

fn model(vs: &mut nn::VarStore, args: &Args) -> tch_dist::Result<nn::Sequential> {
    stack(layers(vs, args), |_, l| Ok(l))
}

/// The batch of replica `replica`'s local rank `local` at `step`: the same wherever it is drawn.
fn batch(replica: u64, local: usize, step: u64, kind: Kind) -> (Tensor, Tensor) {
    tch::manual_seed((step * 1000 + replica * 10 + local as u64) as i64 + 1);
    let x = Tensor::randn([64, IN], (kind, Device::Cpu));
    let y = x.sum_dim_intlist(1, true, kind).sin();
    (x, y)
}

fn loss(net: &impl Module, x: &Tensor, y: &Tensor) -> Tensor {
    net.forward(x).mse_loss(y, tch::Reduction::Mean)
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// This process's events (local rank 0 of a replica writes them; the others' would repeat them).
struct Log(Option<std::fs::File>);

impl Log {
    fn open(path: &Option<PathBuf>) -> std::io::Result<Log> {
        let local0 = std::env::var("LOCAL_RANK").map_or(true, |r| r == "0");
        if local0 {
            Self::open_any_rank(path)
        } else {
            Ok(Log(None))
        }
    }
    fn open_any_rank(path: &Option<PathBuf>) -> std::io::Result<Log> {
        Ok(Log(match path {
            Some(p) => Some(std::fs::OpenOptions::new().create(true).append(true).open(p)?),
            None => None,
        }))
    }
    fn event(&mut self, mut v: serde_json::Value) {
        v["replica"] = std::env::var("TCH_DIST_REPLICA_ID").unwrap_or_default().into();
        v["t"] = now().into();
        v["pid"] = std::process::id().into();
        v["restart"] = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default().into();
        if let Some(f) = self.0.as_mut() {
            // one write per line: readers polling the file see whole lines
            let _ = f.write_all(format!("{v}\n").as_bytes());
        }
    }
}

/// Passes buckets to the manager's hook; at `--kill-at-step`, SIGKILLs this process once the second
/// bucket is ready, before its reduction is posted (the first one's is under way), so that the step
/// can never complete with this replica's gradients.
#[derive(Debug)]
struct KillMidBackward {
    inner: Arc<dyn CommHook>,
    step: Arc<AtomicU64>,
    at: Option<u64>,
    log: Option<PathBuf>,
}

impl CommHook for KillMidBackward {
    fn run(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket) -> tch_dist::Result<HookFuture> {
        let first_start = std::env::var("TORCHELASTIC_RESTART_COUNT").map_or(true, |c| c == "0");
        let step = self.step.load(Ordering::SeqCst);
        if first_start && self.at.is_some_and(|at| step >= at) && bucket.index() == 1.min(bucket_count(bucket) - 1) {
            if let Ok(mut l) = Log::open_any_rank(&self.log) {
                l.event(serde_json::json!({"event": "kill", "step": step, "bucket": bucket.index()}));
            }
            // SAFETY: raising a signal on this process has no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        self.inner.run(pg, bucket)
    }
    fn fixed_layout(&self) -> bool {
        self.inner.fixed_layout()
    }
}

/// HSDP's twin of [`KillMidBackward`]: SIGKILLs this process when the second unit's chunk is about to
/// be summed across replicas at `--kill-at-step` (the last layer's sum is done).
#[derive(Debug)]
struct KillMidSum {
    inner: Arc<dyn Replicas>,
    step: Arc<AtomicU64>,
    at: Option<u64>,
    log: Option<PathBuf>,
    /// (step, sums started in it)
    seen: std::sync::Mutex<(u64, usize)>,
}

impl Replicas for KillMidSum {
    fn count(&self) -> usize {
        self.inner.count()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> tch_dist::Result<()> {
        let step = self.step.load(Ordering::SeqCst);
        let nth = {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen.0 != step {
                *seen = (step, 0);
            }
            seen.1 += 1;
            seen.1
        };
        let first_start = std::env::var("TORCHELASTIC_RESTART_COUNT").map_or(true, |c| c == "0");
        if first_start && self.at.is_some_and(|at| step >= at) && nth == 2 {
            if let Ok(mut l) = Log::open(&self.log) {
                l.event(serde_json::json!({"event": "kill", "step": step, "unit": nth - 1}));
            }
            // SAFETY: raising a signal on this process has no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        self.inner.all_reduce_sum(t)
    }
}

fn bucket_count(b: &GradBucket) -> usize {
    if b.is_last() {
        b.index() + 1
    } else {
        b.index() + 2
    }
}

fn state(vs: &nn::VarStore, opt: &dyn Optimizer) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (format!("model/{n}"), t)).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v.extend(opt.state_dict().into_iter().map(|(k, t)| (format!("optim/{k}"), t)));
    v
}

/// Loads what [`state`] saved into the variables and the optimizer; the step it was saved at.
fn load(path: &std::path::Path, vs: &nn::VarStore, opt: &mut dyn Optimizer) -> Result<u64, Box<dyn std::error::Error>> {
    let (step, saved) = checkpoint::read(path)?;
    let vars = vs.variables();
    let mut optim = Vec::new();
    for (k, t) in saved {
        if let Some(v) = k.strip_prefix("model/").and_then(|n| vars.get(n)) {
            let _g = tch::no_grad_guard();
            v.shallow_clone().f_copy_(&t)?;
        } else if let Some(key) = k.strip_prefix("optim/") {
            optim.push((key.to_string(), t));
        }
    }
    opt.load_state_dict(&optim)?;
    Ok(step)
}

/// A replica's model: DDP among its ranks, or FSDP over them (HSDP across the replicas).
enum Net {
    Ddp(DistributedDataParallel<nn::Sequential>),
    Fsdp(FullyShardedDataParallel<nn::Sequential>),
}

impl Net {
    fn backward(&self, x: &Tensor, y: &Tensor) -> tch_dist::Result<()> {
        match self {
            Net::Ddp(d) => d.backward(&d.forward_with(|m| loss(m, x, y))?),
            Net::Fsdp(f) => f.backward(&f.f_forward(x)?.mse_loss(y, tch::Reduction::Mean)),
        }
    }
}

fn replica_number(id: &str) -> Result<u64, String> {
    id.trim_start_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .map_err(|_| format!("replica id {id:?} does not end in a number (the batches are drawn from it)"))
}

fn train(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let kind = kind(args);
    let own = Arc::new(ProcessGroup::from_env()?);
    let local = own.rank();
    let cfg = ManagerConfig::from_env()?;
    let replica = replica_number(&cfg.replica_id)?;
    let mut log = Log::open(&args.log)?;
    log.event(serde_json::json!({"event": "start", "replica": cfg.replica_id, "local": local}));
    let mut manager = Manager::new(cfg, Some(own.clone()))?;

    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let step = Arc::new(AtomicU64::new(0));
    let net = if args.fsdp {
        let layers = layers(&mut vs, args);
        let replicas = Arc::new(KillMidSum {
            inner: manager.fsdp_replicas(),
            step: step.clone(),
            at: args.kill_at_step,
            log: args.log.clone(),
            seen: Default::default(),
        });
        let opts = FsdpOptions::default().process_group(own.clone()).gather_once_below(0).replicas(replicas);
        let fsdp = FsdpBuilder::new(&vs, opts)?;
        let seq = stack(layers, |name, l| fsdp.fully_shard(&(vs.root() / name), l))?;
        Net::Fsdp(fsdp.finish(seq)?)
    } else {
        let net = model(&mut vs, args)?;
        let hook = Arc::new(KillMidBackward {
            inner: manager.comm_hook(),
            step: step.clone(),
            at: args.kill_at_step,
            log: args.log.clone(),
        });
        let opts = DdpOptions::default()
            .process_group(own.clone())
            .comm_hook(hook)
            .bucket_cap_mb(0.1)
            .first_bucket_bytes(64 << 10);
        Net::Ddp(DistributedDataParallel::new(&vs, net, opts)?)
    };
    // the VarStore's trainable variables: the parameters, or under FSDP this rank's shards
    let mut opt = AdamW::new(vs.trainable_variables(), 1e-3);
    // sharded checkpoints of the replica's ranks (each rank its shard under FSDP), loadable by any replica
    let mut ckpt = match &args.ckpt {
        Some(root) => Some(Checkpointer::new(own.clone(), root)?),
        None => None,
    };
    if let Some(ck) = ckpt.as_mut() {
        // when it looked for the newest: a save committed later (by a replica back first) is not seen
        let looked = now();
        if let Some(step) = ck.load(StateDict::new().var_store("model", &vs).optimizer("optim", &mut opt))? {
            manager.resume(step);
            log.event(serde_json::json!({"event": "resumed", "step": step, "looked": looked}));
        }
    }

    while manager.step() < args.steps {
        let started = match &net {
            Net::Ddp(_) => manager.start_step(&vs, &mut opt)?,
            Net::Fsdp(f) => manager.start_step(f, &mut opt)?,
        };
        let s = manager.step();
        if let Some(from) = &started.healed_from {
            // the state of step s came from `from` (this step may still be discarded and run again)
            log.event(serde_json::json!({"event": "healed", "step": s, "from": from}));
        }
        step.store(s, Ordering::SeqCst);
        let (x, y) = batch(replica, local, s, kind);
        std::thread::sleep(std::time::Duration::from_millis(args.step_ms));
        net.backward(&x, &y)?;
        let members: Vec<&str> = started.quorum.members.iter().map(|m| m.replica.as_str()).collect();
        if manager.should_commit()? {
            opt.step()?;
            log.event(serde_json::json!({
                "event": "commit", "step": s, "members": members, "quorum": started.quorum.id,
                "reconfigured": started.reconfigured, "healed_from": started.healed_from,
                "sent_to": started.sent_to, "retries": started.retries,
            }));
            // periodic saves go on as usual: one replica (the quorum's first) writes what all hold
            let first = started.quorum.members.first().is_some_and(|m| m.replica == manager.replica_id());
            if let (Some(ck), true) = (ckpt.as_mut(), first) {
                if (s + 1) % args.every == 0 {
                    // collective over the replica's ranks; committed when all of them wrote
                    ck.save(s + 1, StateDict::new().var_store("model", &vs).optimizer("optim", &mut opt))?;
                    log.event(serde_json::json!({"event": "saved", "step": s + 1}));
                }
            }
        } else {
            log.event(
                serde_json::json!({"event": "discard", "step": s, "members": members, "why": manager.last_failure()}),
            );
        }
        opt.zero_grad()?;
    }
    if let Some(out) = &args.out {
        // local rank 0 writes OUT, rank L OUT.rankL
        let path = if local == 0 { out.clone() } else { PathBuf::from(format!("{}.rank{local}", out.display())) };
        let saved = match &net {
            Net::Ddp(_) => state(&vs, &opt),
            Net::Fsdp(f) => {
                let mut v: Vec<(String, Tensor)> =
                    f.state_dict()?.into_iter().map(|(n, t)| (format!("model/{n}"), t)).collect();
                v.extend(f.named_parameters().into_iter().map(|(n, t)| (format!("shard/{n}"), t)));
                v.extend(opt.state_dict().into_iter().map(|(k, t)| (format!("optim/{k}"), t)));
                v
            }
        };
        checkpoint::write_atomic(&path, manager.step(), &saved)?;
    }
    log.event(serde_json::json!({"event": "done", "step": manager.step()}));
    Ok(())
}

/// The same training as one DDP job, without fault tolerance: a lost rank stops every rank, tchrun
/// restarts them all, and they resume from the last checkpoint.
fn restart_baseline(args: &Args, ckpt: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let kind = kind(args);
    let pg = Arc::new(ProcessGroup::from_env()?);
    let rank = pg.rank();
    let mut log = Log::open(&args.log)?;
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = model(&mut vs, args)?;
    let mut opt = AdamW::new(vs.trainable_variables(), 1e-3);
    let mut start = 0;
    if ckpt.exists() {
        start = load(ckpt, &vs, &mut opt)?;
        log.event(serde_json::json!({"event": "resumed", "step": start}));
    }
    let step = Arc::new(AtomicU64::new(start));
    let hook = Arc::new(KillMidBackward {
        inner: tch_dist::ddp::comm_hook::allreduce(),
        step: step.clone(),
        // the last rank, as replica 2 of three
        at: args.kill_at_step.filter(|_| rank + 1 == pg.size()),
        log: args.log.clone(),
    });
    let opts =
        DdpOptions::default().process_group(pg.clone()).comm_hook(hook).bucket_cap_mb(0.1).first_bucket_bytes(64 << 10);
    let ddp = DistributedDataParallel::new(&vs, net, opts)?;
    let members: Vec<String> = (0..pg.size()).map(|r| r.to_string()).collect();
    for s in start..args.steps {
        step.store(s, Ordering::SeqCst);
        let (x, y) = batch(rank as u64, 0, s, kind);
        std::thread::sleep(std::time::Duration::from_millis(args.step_ms));
        ddp.backward(&ddp.forward_with(|m| loss(m, &x, &y))?)?;
        opt.step()?;
        opt.zero_grad()?;
        log.event(serde_json::json!({"event": "commit", "step": s, "members": members}));
        if (s + 1) % args.every == 0 {
            if rank == 0 {
                checkpoint::write_atomic(ckpt, s + 1, &state(&vs, &opt))?;
            }
            pg.barrier()?;
        }
    }
    log.event(serde_json::json!({"event": "done", "step": args.steps}));
    Ok(())
}

/// Per committed step, the replicas whose batches made its gradient.
type Schedule = Vec<(u64, Vec<String>)>;

/// The steps that made the final state, with their members, read from the replicas' logs. A process's
/// state comes from its own commits back to where it was last healed (or resumed), and before that from
/// the process it was healed from (the one of that replica that had committed the step before, by then),
/// or from the process that saved the checkpoint it resumed from: commits of a process that died before
/// anyone took its state are not part of it.
fn committed(paths: &[PathBuf]) -> Result<Schedule, Box<dyn std::error::Error>> {
    let mut events = Vec::new();
    for path in paths {
        for line in std::fs::read_to_string(path)?.lines() {
            events.push(serde_json::from_str::<serde_json::Value>(line)?);
        }
    }
    let num = |v: &serde_json::Value, k: &str| v[k].as_f64().ok_or_else(|| format!("an event without {k}: {v}"));
    let done = events.iter().find(|e| e["event"] == "done").ok_or("no process finished")?;
    let (mut replica, mut pid) = (done["replica"].clone(), done["pid"].clone());
    let mut upto = u64::MAX;
    let mut steps: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
    let of = |kind: &str, replica: &serde_json::Value, pid: &serde_json::Value, upto: u64| -> Vec<&serde_json::Value> {
        events
            .iter()
            .filter(|e| e["event"] == kind && e["replica"] == *replica && e["pid"] == *pid)
            .filter(|e| e["step"].as_u64().is_some_and(|s| s < upto))
            .collect()
    };
    loop {
        // where this process's state of its steps below `upto` began: its last healing, or its resume
        // from the checkpoint, or the initial parameters
        let last = |kind: &str| of(kind, &replica, &pid, upto).into_iter().max_by_key(|e| e["step"].as_u64()).cloned();
        let (healed, resumed) = (last("healed"), last("resumed"));
        let step_of = |e: &Option<serde_json::Value>| e.as_ref().and_then(|e| e["step"].as_u64());
        let from = match (step_of(&healed), step_of(&resumed)) {
            (Some(h), r) if r.is_none_or(|r| h >= r) => h,
            (_, Some(r)) => r,
            _ => 0,
        };
        for e in of("commit", &replica, &pid, upto).into_iter().filter(|e| e["step"].as_u64() >= Some(from)) {
            let m = e["members"].as_array().ok_or("a commit without members")?;
            let m = m.iter().filter_map(|x| x.as_str().map(String::from)).collect();
            steps.insert(e["step"].as_u64().ok_or("a commit without a step")?, m);
        }
        if from == 0 {
            break; // from the initial parameters, which every replica draws alike
        }
        // the process that held the state of step `from`: the sender's (the one of its replica that had
        // committed the step before, last before the healing), or the checkpoint's saver
        let (kind, key, t) = match (&healed, step_of(&healed) == Some(from)) {
            (Some(h), true) => ("commit", h["from"].clone(), num(h, "t")?),
            _ => {
                let r = resumed.as_ref().ok_or("no origin")?;
                ("saved", serde_json::Value::Null, num(r, "t")?)
            }
        };
        let step = if kind == "commit" { from - 1 } else { from };
        let source = events
            .iter()
            .filter(|e| e["event"] == kind && e["step"].as_u64() == Some(step))
            .filter(|e| key.is_null() || e["replica"] == key)
            .filter(|e| e["t"].as_f64().is_some_and(|et| et < t))
            .max_by(|a, b| a["t"].as_f64().partial_cmp(&b["t"].as_f64()).unwrap_or(std::cmp::Ordering::Equal))
            .ok_or_else(|| {
                format!("replica {replica} (pid {pid}) began at step {from}, and no process held it before")
            })?;
        (replica, pid, upto) = (source["replica"].clone(), source["pid"].clone(), from);
    }
    for (i, s) in steps.keys().enumerate() {
        if *s != i as u64 {
            return Err(format!("step {i} is missing from the lineage of the final state").into());
        }
    }
    Ok(steps.into_iter().collect())
}

fn reference(args: &Args, logs: &[PathBuf]) -> Result<(), Box<dyn std::error::Error>> {
    let kind = kind(args);
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = model(&mut vs, args)?;
    let mut opt = AdamW::new(vs.trainable_variables(), 1e-3);
    let steps = committed(logs)?;
    for (s, members) in &steps {
        let mut n = 0;
        for m in members {
            for local in 0..args.ranks_per_replica {
                let (x, y) = batch(replica_number(m)?, local, *s, kind);
                loss(&net, &x, &y).backward();
                n += 1;
            }
        }
        for p in vs.trainable_variables() {
            let mut g = p.grad();
            let _ = g.f_div_scalar_(n as f64)?;
        }
        opt.step()?;
        opt.zero_grad()?;
    }
    if let Some(out) = &args.out {
        checkpoint::write_atomic(out, steps.len() as u64, &state(&vs, &opt))?;
    }
    println!("replayed {} steps", steps.len());
    Ok(())
}

fn main() {
    let args = Args::parse();
    if args.fsdp && args.restart_from.is_some() {
        eprintln!("ft_ddp: --restart-from is the DDP baseline; drop --fsdp");
        std::process::exit(2);
    }
    let r = match (&args.restart_from, args.reference.is_empty()) {
        (Some(ckpt), _) => restart_baseline(&args, ckpt),
        (None, true) => train(&args),
        (None, false) => reference(&args, &args.reference),
    };
    if let Err(e) = r {
        eprintln!("ft_ddp: {e}");
        std::process::exit(1);
    }
}
