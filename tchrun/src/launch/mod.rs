//! The launcher behind `tchrun`: starts `nproc_per_node` workers with torchrun's environment, prefixes
//! their output with their rank, and when one fails stops the others (SIGTERM, then SIGKILL after a grace
//! period), reports which rank failed, how, and its last lines, and restarts the group if allowed.
//! With a rendezvous endpoint ([`ElasticConfig`]) the nodes form their membership through a TCPStore and
//! restart together (`tchrun --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`, see docs/tchrun.md).
mod elastic;
mod rendezvous;
mod summary;

/// tchrun's refusals: `op` is the flag or phase, `msg` what is wrong with it.
fn invalid(op: impl Into<String>, msg: impl Into<String>) -> Error {
    Error::Invalid { op: op.into(), msg: msg.into() }
}

pub use elastic::{parse_nnodes, ElasticConfig};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use summary::STOPPED;
use tch_dist::{Error, Result};

/// Everything the launcher needs; `tchrun`'s flags map onto it one to one.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub max_restarts: usize,
    pub redirect_logs: Option<PathBuf>,
    pub run_id: String,
    /// Between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    /// Lines of a failed worker's output to show.
    pub tail_lines: usize,
    pub program: String,
    pub args: Vec<String>,
    /// Appended to the workers' `LD_LIBRARY_PATH` (see [`libtorch_dir`]), so a program built without an
    /// rpath to libtorch starts; a directory the variable already names is not added again.
    pub libtorch_dir: Option<PathBuf>,
    /// Where workers dump their flight recorders on failure (`TCH_DIST_TRACE_DIR`, one subdirectory per
    /// restart), read back after a failure to name the culprit. A `TCH_DIST_TRACE_DIR` of the caller wins.
    pub trace_dir: Option<PathBuf>,
    /// Where workers write their timelines (`TCH_DIST_TIMELINE_DIR`), for `--trace-out`.
    pub timeline_dir: Option<PathBuf>,
    /// Elastic membership through a rendezvous (`--rdzv-endpoint`); `nnodes` and `node_rank` are then
    /// decided by each round.
    pub elastic: Option<ElasticConfig>,
    /// More variables for every worker (a fault-tolerant replica's id and lighthouse).
    pub env: Vec<(String, String)>,
}

/// libtorch's lib directory: the one this crate was built against while it exists, else that of the
/// `python3` on `PATH` that imports torch (binaries carried to another machine).
pub fn libtorch_dir() -> Option<PathBuf> {
    let built = PathBuf::from(tch_dist::LIBTORCH_LIB);
    if built.join("libtorch_cpu.so").exists() {
        return Some(built);
    }
    let out = Command::new("python3")
        .args(["-c", "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && dir.join("libtorch_cpu.so").exists()).then_some(dir)
}

/// `current` with `dir` appended, unless it already names it (the user's own entries keep priority).
fn with_lib_dir(current: Option<std::ffi::OsString>, dir: &std::path::Path) -> std::ffi::OsString {
    let mut parts: Vec<PathBuf> = current.as_deref().map(|c| std::env::split_paths(c).collect()).unwrap_or_default();
    parts.retain(|p| !p.as_os_str().is_empty());
    if !parts.iter().any(|p| p == dir) {
        parts.push(dir.to_path_buf());
    }
    std::env::join_paths(parts).unwrap_or_else(|_| dir.as_os_str().to_owned())
}

impl LaunchConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(invalid("tchrun", m));
        if self.nproc_per_node == 0 {
            return bad("--nproc-per-node must be at least 1".into());
        }
        if self.nnodes == 0 {
            return bad("--nnodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!("--node-rank {} is not below --nnodes {}", self.node_rank, self.nnodes));
        }
        if self.master_addr.trim().is_empty() {
            return bad("--master-addr is empty".into());
        }
        if self.program.is_empty() {
            return bad("no program to run (tchrun [OPTIONS] -- PROGRAM [ARGS...])".into());
        }
        if let Some(e) = &self.elastic {
            e.validate()?;
        }
        Ok(())
    }

    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }
}

/// A port free now on 127.0.0.1 (for `--standalone`), outside the range outgoing connections draw from.
pub fn free_port() -> Result<u16> {
    tch_dist::store::free_port("127.0.0.1").map_err(|e| invalid("tchrun --standalone", e.to_string()))
}

/// How a worker ended.
pub fn describe_status(s: &ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("signal {sig} ({})", signal_name(sig)),
        _ => "unknown status".into(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGINT => "SIGINT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        _ => "signal",
    }
}

struct Worker {
    rank: usize,
    child: Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    status: Option<ExitStatus>,
}

/// After the first failure, how long the other workers may take to end on their own before they are
/// stopped.
const SETTLE: Duration = Duration::from_millis(1000);

/// Set by SIGINT/SIGTERM to the launcher: stop the workers and leave.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
    }
}

fn pump(
    stream: impl std::io::Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    tail: Arc<Mutex<VecDeque<String>>>,
    keep: usize,
    log: Option<Arc<Mutex<std::fs::File>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut in_trace = false;
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "{prefix}{line}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "{prefix}{line}");
            }
            if let Some(f) = &log {
                if let Ok(mut f) = f.lock() {
                    let _ = writeln!(f, "{line}");
                }
            }
            // backtrace frames stay out of the tail: with RUST_BACKTRACE set, dozens of them would push
            // the error line (or a panic's message) out of it. Rust's numbered frames only after their
            // header (anyhow's indented, numbered "Caused by:" list stays); C++'s frames wherever they are
            let header = matches!(line.trim(), "stack backtrace:" | "Stack backtrace:");
            let cpp =
                line.trim_start().starts_with("frame #") || line.trim_start().starts_with("Exception raised from");
            in_trace = header || (in_trace && summary::is_frame(&line));
            if header || cpp || in_trace {
                continue;
            }
            if let Ok(mut t) = tail.lock() {
                if t.len() == keep {
                    t.pop_front();
                }
                t.push_back(line);
            }
        }
    })
}

fn spawn(cfg: &LaunchConfig, restart: usize) -> Result<Vec<Worker>> {
    if let Some(dir) = trace_dir(cfg, restart) {
        let first = cfg.node_rank * cfg.nproc_per_node;
        tch_dist::flight::clear_dumps(&dir, first..first + cfg.nproc_per_node)?;
    }
    let mut workers = Vec::with_capacity(cfg.nproc_per_node);
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let mut c = Command::new(&cfg.program);
        c.args(&cfg.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", cfg.world_size().to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("GROUP_RANK", cfg.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", cfg.world_size().to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", cfg.master_port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts.to_string())
            .env("TORCHELASTIC_RUN_ID", &cfg.run_id)
            .env("PYTHONUNBUFFERED", "1")
            .envs(cfg.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // its own process group, so stopping it reaches its children too
            .process_group(0);
        // SAFETY: runs in the child between fork and exec, calling only prctl(2), which is
        // async-signal-safe: the worker is killed if this launcher dies (even by SIGKILL), so no worker
        // outlives its node's launcher.
        unsafe {
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        if one_thread_each(cfg) {
            c.env("OMP_NUM_THREADS", "1");
        }
        if let Some(dir) = &cfg.timeline_dir {
            c.env("TCH_DIST_TIMELINE_DIR", dir);
        }
        if let Some(dir) = &cfg.libtorch_dir {
            c.env("LD_LIBRARY_PATH", with_lib_dir(std::env::var_os("LD_LIBRARY_PATH"), dir));
        }
        let dump_dir = trace_dir(cfg, restart);
        if let (Some(dir), None) = (&dump_dir, std::env::var_os("TCH_DIST_TRACE_DIR")) {
            c.env("TCH_DIST_TRACE_DIR", dir);
        }
        // c10d's own NCCL flight recorder (what PyTorch's fr_trace reads), dumped beside ours before
        // c10d's watchdog ends a worker on a timeout, unless the user set these
        for (var, value) in nccl_recorder_env(dump_dir.as_deref()) {
            if std::env::var_os(var).is_none() {
                c.env(var, value);
            }
        }
        // every early error stops the workers already started: no orphans
        let log = match open_log(cfg, rank, restart) {
            Ok(l) => l,
            Err(e) => {
                stop(&mut workers, Duration::ZERO);
                return Err(e);
            }
        };
        let mut child = match c.spawn() {
            Ok(ch) => ch,
            Err(e) => {
                stop(&mut workers, Duration::ZERO);
                return Err(invalid("tchrun", format!("cannot start {:?} for rank {rank}: {e}", cfg.program)));
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(cfg.tail_lines)));
        let prefix = format!("[rank{rank}]: ");
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(pump(out, prefix.clone(), false, tail.clone(), cfg.tail_lines, log.clone()));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(pump(err, prefix, true, tail.clone(), cfg.tail_lines, log));
        }
        workers.push(Worker { rank, child, tail, readers, status: None });
    }
    Ok(workers)
}

fn open_log(cfg: &LaunchConfig, rank: usize, restart: usize) -> Result<Option<Arc<Mutex<std::fs::File>>>> {
    let Some(dir) = &cfg.redirect_logs else { return Ok(None) };
    std::fs::create_dir_all(dir)
        .map_err(|e| invalid(format!("tchrun --redirect-logs {}", dir.display()), e.to_string()))?;
    let p = dir.join(format!("rank{rank}.restart{restart}.log"));
    let f = std::fs::File::create(&p).map_err(|e| invalid(format!("tchrun log {}", p.display()), e.to_string()))?;
    Ok(Some(Arc::new(Mutex::new(f))))
}

/// The variables that turn on c10d's NCCL flight recorder's dump on a watchdog timeout, into
/// `dir/nccl_trace_rank_<R>` (torchtitan sets the same).
fn nccl_recorder_env(dir: Option<&std::path::Path>) -> Vec<(&'static str, std::ffi::OsString)> {
    // c10d records by default (TORCH_FR_BUFFER_SIZE, 2000 entries); it dumps on a timeout only when asked
    let mut v = vec![("TORCH_NCCL_DUMP_ON_TIMEOUT", "1".into())];
    // c10d writes its dump into an existing directory only
    if let Some(d) = dir.filter(|d| std::fs::create_dir_all(d).is_ok()) {
        v.push(("TORCH_FR_DUMP_TEMP_FILE", d.join("nccl_trace_rank_").into_os_string()));
    }
    v
}

/// This attempt's dump directory: the caller's `TCH_DIST_TRACE_DIR`, or ours per restart.
fn trace_dir(cfg: &LaunchConfig, restart: usize) -> Option<PathBuf> {
    match std::env::var_os("TCH_DIST_TRACE_DIR") {
        Some(d) => Some(PathBuf::from(d)),
        None => cfg.trace_dir.as_ref().map(|d| d.join(format!("restart{restart}"))),
    }
}

fn signal_group(w: &Worker, sig: i32) {
    // SAFETY: kill(2) on the worker's process group; a stale id only yields ESRCH.
    unsafe {
        libc::kill(-(w.child.id() as i32), sig);
    }
}

/// Stops every worker still running: SIGTERM, then SIGKILL after the grace period.
fn stop(workers: &mut [Worker], grace: Duration) {
    for w in workers.iter().filter(|w| w.status.is_none()) {
        signal_group(w, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && workers.iter().any(|w| w.status.is_none()) {
        poll(workers);
        std::thread::sleep(Duration::from_millis(20));
    }
    for w in workers.iter_mut().filter(|w| w.status.is_none()) {
        signal_group(w, libc::SIGKILL);
        w.status = w.child.wait().ok();
    }
}

fn poll(workers: &mut [Worker]) {
    for w in workers.iter_mut().filter(|w| w.status.is_none()) {
        if let Ok(Some(s)) = w.child.try_wait() {
            w.status = Some(s);
        }
    }
}

/// Outcome of one attempt.
enum Attempt {
    Succeeded,
    Failed {
        rank: usize,
        status: ExitStatus,
        /// Every worker's last lines, and how it ended.
        tails: std::collections::BTreeMap<usize, Vec<String>>,
        exits: std::collections::BTreeMap<usize, String>,
    },
    Interrupted,
    /// `watch` asked to stop (another node failed, membership changed), with its reason.
    Stopped(String),
}

/// Runs one attempt of this node's workers; `watch`, called as the workers are polled, may stop them
/// (returning the reason) or fail (the workers are stopped first).
fn attempt(cfg: &LaunchConfig, restart: usize, watch: &mut dyn FnMut() -> Result<Option<String>>) -> Result<Attempt> {
    let mut workers = spawn(cfg, restart)?;
    let outcome = loop {
        poll(&mut workers);
        if INTERRUPTED.load(Ordering::SeqCst) {
            stop(&mut workers, cfg.grace);
            break Attempt::Interrupted;
        }
        match watch() {
            Ok(None) => {}
            Ok(Some(reason)) => {
                stop(&mut workers, cfg.grace);
                break Attempt::Stopped(reason);
            }
            Err(e) => {
                stop(&mut workers, cfg.grace);
                return Err(e);
            }
        }
        // The first worker to fail is the cause; the others usually fail after it.
        if let Some(w) = workers.iter().find(|w| matches!(w.status, Some(s) if !s.success())) {
            let (rank, status) = (w.rank, w.status.expect("checked"));
            // a moment for ranks that are ending on their own (one that finished its loop and is exiting
            // may be what this one failed on): they keep their own exit status
            let settle = Instant::now() + cfg.grace.min(SETTLE);
            while Instant::now() < settle && workers.iter().any(|w| w.status.is_none()) {
                std::thread::sleep(Duration::from_millis(20));
                poll(&mut workers);
            }
            // ranks that had ended on their own (an exit code 0 among them: a rank that finished early)
            let ended: Vec<usize> = workers.iter().filter(|w| w.status.is_some()).map(|w| w.rank).collect();
            stop(&mut workers, cfg.grace);
            let mut tails = std::collections::BTreeMap::new();
            for w in workers.iter_mut() {
                for r in w.readers.drain(..) {
                    let _ = r.join();
                }
                tails.insert(w.rank, w.tail.lock().map(|t| t.iter().cloned().collect()).unwrap_or_default());
            }
            let exits = workers
                .iter()
                .map(|w| {
                    let how = w.status.as_ref().map_or("no exit status".into(), describe_status);
                    let stopped = if ended.contains(&w.rank) { "" } else { STOPPED };
                    (w.rank, format!("{how}{stopped}"))
                })
                .collect();
            break Attempt::Failed { rank, status, tails, exits };
        }
        if workers.iter().all(|w| w.status.is_some()) {
            break Attempt::Succeeded;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for w in &mut workers {
        for r in w.readers.drain(..) {
            let _ = r.join();
        }
    }
    Ok(outcome)
}

/// After a failure: what the workers' flight-recorder dumps say (which rank never arrived where), if
/// they left any.
fn read_flight(
    cfg: &LaunchConfig,
    restart: usize,
    exits: &std::collections::BTreeMap<usize, String>,
) -> Option<(PathBuf, Result<tch_dist::flight::Analysis>)> {
    let dir = trace_dir(cfg, restart)?;
    if !dir.exists() {
        return None;
    }
    let a = tch_dist::flight::analyze(&dir, Some(cfg.world_size()), exits);
    Some((dir, a))
}

/// Whether each worker gets OMP_NUM_THREADS=1, as torchrun does: several per node and none set. Each
/// worker's intra-op threads would otherwise number the node's cores, and the node's workers together
/// many times that (a step of ring attention ran 6x slower so on 2 cores, 2 workers).
fn one_thread_each(cfg: &LaunchConfig) -> bool {
    cfg.nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none()
}

/// Runs the workers, restarting the group up to `max_restarts` times. Returns the exit code for the
/// launcher: 0 when every worker succeeded.
pub fn run(cfg: &LaunchConfig) -> Result<i32> {
    cfg.validate()?;
    install_signal_handlers();
    if one_thread_each(cfg) {
        eprintln!(
            "tchrun: OMP_NUM_THREADS is set to 1 for each worker, so that {} workers do not overload the node; \
             set it yourself to tune",
            cfg.nproc_per_node
        );
    }
    if let Some(e) = &cfg.elastic {
        return elastic::run(cfg, e);
    }
    for restart in 0..=cfg.max_restarts {
        if restart > 0 {
            eprintln!(
                "tchrun: restarting all {} workers (restart {restart} of {})",
                cfg.nproc_per_node, cfg.max_restarts
            );
        }
        match attempt(cfg, restart, &mut || Ok(None))? {
            Attempt::Succeeded => return Ok(0),
            Attempt::Interrupted => {
                eprintln!("tchrun: interrupted; workers stopped");
                return Ok(130);
            }
            Attempt::Stopped(_) => return Ok(1),
            Attempt::Failed { rank, status, tails, exits } => {
                report_failure(cfg, restart, rank, &status, &tails, &exits);
                if restart == cfg.max_restarts {
                    return Ok(1);
                }
            }
        }
    }
    Ok(1)
}

/// What a failed attempt prints: the culprit and its error line first, then the rank that failed first
/// and how, its last lines, and the flight recorder's findings.
fn report_failure(
    cfg: &LaunchConfig,
    restart: usize,
    rank: usize,
    status: &ExitStatus,
    tails: &std::collections::BTreeMap<usize, Vec<String>>,
    exits: &std::collections::BTreeMap<usize, String>,
) {
    let flight = read_flight(cfg, restart, exits);
    let analysis = flight.as_ref().and_then(|(_, a)| a.as_ref().ok());
    // ranks that end between two polls (a failure and the peer errors it causes) are found lowest rank
    // first: a rank the flight recorder names that also ended on its own, failing, is the one that failed
    let named = analysis.and_then(|a| a.culprits.first().copied()).filter(|&c| {
        c != rank && exits.get(&c).is_some_and(|how| !how.ends_with(STOPPED) && !summary::exited_normally(how))
    });
    let (rank, how) = match named {
        Some(c) => (c, exits.get(&c).cloned().unwrap_or_default()),
        None => (rank, describe_status(status)),
    };
    for l in summary::headline(rank, analysis, tails, exits) {
        eprintln!("tchrun: {l}");
    }
    eprintln!(
        "tchrun: rank {rank} (local rank {}) failed with {how}; stopped the other workers",
        rank - cfg.node_rank * cfg.nproc_per_node,
    );
    let tail = tails.get(&rank).map(Vec::as_slice).unwrap_or_default();
    if !tail.is_empty() {
        eprintln!("tchrun: last {} lines of rank {rank} (backtrace frames left out):", tail.len());
        for l in tail {
            eprintln!("tchrun:   {l}");
        }
    }
    match flight {
        None => eprintln!("tchrun: no flight-recorder dumps (no collective failed before the workers ended)"),
        Some((dir, Ok(a))) => {
            eprintln!(
                "tchrun: flight recorder ({}; `tchrun analyze {}` to read them again):",
                dir.display(),
                dir.display()
            );
            // the recorder's culprits as the headline reads them: no rank tchrun stopped beside one that
            // failed on its own
            let shown = summary::not_stopped_beside_failed(a.culprits.clone(), tails, exits);
            for l in &a.findings {
                match l.strip_prefix("culprit: ") {
                    Some(_) if shown != a.culprits && !shown.is_empty() => {
                        let names: Vec<String> = shown.iter().map(|r| format!("rank {r}")).collect();
                        eprintln!("tchrun:   culprit: {}", names.join(", "));
                    }
                    _ => eprintln!("tchrun:   {l}"),
                }
            }
        }
        Some((_, Err(e))) => eprintln!("tchrun: flight recorder: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With RUST_BACKTRACE set, a panic's message and an `Error:` line are followed by dozens of frames:
    /// the tail keeps the lines that are not frames, so the headline still finds them; anyhow's
    /// "Caused by:" list (indented and numbered too) stays.
    #[test]
    fn the_tail_keeps_the_error_behind_a_long_backtrace() {
        let panic = ["thread 'main' panicked at src/main.rs:3:5:", "boom", "stack backtrace:"];
        let anyhow = ["Error: the bad thing", "", "Caused by:", "    0: the inner cause", "", "Stack backtrace:"];
        for (head, kept_head, wanted) in
            [(&panic[..], &panic[..2], "boom"), (&anyhow[..], &anyhow[..5], "the bad thing")]
        {
            let mut out: Vec<String> = head.iter().map(|s| s.to_string()).collect();
            for i in 0..40 {
                out.push(format!("  {i:>2}: some::function::name"));
                out.push("             at /rustc/library/std/src/panicking.rs:697:5".to_string());
            }
            out.push("3: a line the program printed".to_string());
            let text = out.join("\n") + "\n";
            let tail = Arc::new(Mutex::new(VecDeque::new()));
            pump(std::io::Cursor::new(text.into_bytes()), "[test] ".into(), true, tail.clone(), 20, None)
                .join()
                .unwrap();
            let kept: Vec<String> = tail.lock().unwrap().iter().cloned().collect();
            let mut expected: Vec<&str> = kept_head.to_vec();
            expected.push("3: a line the program printed");
            assert_eq!(kept, expected, "{kept:?}");
            let line = summary::error_line(&kept).unwrap();
            assert!(line.contains(wanted), "{line}");
        }
    }

    #[test]
    fn lib_dir_is_appended_once() {
        let d = std::path::Path::new("/opt/torch/lib");
        assert_eq!(with_lib_dir(None, d), "/opt/torch/lib");
        assert_eq!(with_lib_dir(Some("/a:/b".into()), d), "/a:/b:/opt/torch/lib");
        assert_eq!(with_lib_dir(Some("/opt/torch/lib:/a".into()), d), "/opt/torch/lib:/a");
        assert_eq!(with_lib_dir(Some("".into()), d), "/opt/torch/lib");
    }
}
