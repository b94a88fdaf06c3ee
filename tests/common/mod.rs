//! Helpers shared by the integration tests: ranks as threads (HashStore) or as processes (TCPStore).
#![allow(dead_code)]
pub mod bn;
pub mod model;
pub mod pipe;
pub mod scenario;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tch_dist::{Backend, GroupOptions, ProcessGroup, Store};

/// A port nobody listens on now, outside the range outgoing connections draw from ([`tch_dist::store::free_port`]).
pub fn free_port() -> u16 {
    tch_dist::store::free_port("127.0.0.1").expect("free port")
}

/// target/<profile>/, where cargo puts the binaries (this test binary is in its deps/).
fn profile_dir() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// An example built beside the test binaries (target/<profile>/examples/; scripts/test.sh builds them).
pub fn example(name: &str) -> std::path::PathBuf {
    let p = profile_dir().join("examples").join(name);
    assert!(p.exists(), "{} not built (scripts/test.sh builds the examples first)", p.display());
    p
}

/// The tchrun binary of this workspace (target/<profile>/tchrun, a package of its own: scripts/test.sh
/// builds it with the examples, `cargo build --bins --examples`).
pub fn tchrun() -> std::path::PathBuf {
    let p = profile_dir().join("tchrun");
    assert!(p.exists(), "{} not built (cargo build --bins, as scripts/test.sh does)", p.display());
    // `cargo test` builds this crate's tests, not another package's binary: an older tchrun than its
    // sources (its own and the library's) would test the launcher as it was
    let built = std::fs::metadata(&p).and_then(|m| m.modified()).unwrap();
    let newest = [repo_path("tchrun/src"), repo_path("src")].iter().filter_map(|d| newest_file(d)).max();
    assert!(
        newest.is_none_or(|n| n <= built),
        "{} is older than its sources: rebuild it (cargo build --bins, as scripts/test.sh does)",
        p.display()
    );
    p
}

/// The latest modification time of the files below `dir`.
fn newest_file(dir: &std::path::Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let path = e.path();
        let t = if path.is_dir() { newest_file(&path) } else { e.metadata().and_then(|m| m.modified()).ok() };
        newest = newest.max(t);
    }
    newest
}

pub fn gloo_opts(timeout: Duration) -> GroupOptions {
    GroupOptions {
        backend: Backend::Gloo.into(),
        timeout,
        hostname: Some("127.0.0.1".into()),
        // CI's legs set TCH_DIST_STRICT_NCCL, TCH_DIST_VERIFY and TCH_DIST_COLLECTIVES for every group
        ..GroupOptions::from_env().expect("the TCH_DIST_ settings")
    }
}

/// Runs `f(pg)` on `world` threads, each a rank of one Gloo group over a shared HashStore.
/// Returns each rank's result, in rank order.
pub fn run_threads<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    run_threads_with(world, gloo_opts(timeout), f)
}

/// [`run_threads`] with the group built from `opts`.
pub fn run_threads_with<T: Send + 'static>(
    world: usize,
    opts: GroupOptions,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let store = Store::hash().expect("hash store");
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f, opts) = (store.clone(), f.clone(), opts.clone());
            std::thread::spawn(move || {
                let pg = ProcessGroup::new(&store, rank, world, &opts).expect("group");
                f(pg)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

/// Held by every test of a binary whose tests must not run beside each other (tests/alone/): the
/// process-wide allocation counter and tch's global generator are shared by every thread.
pub fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// libtest's name of test `f` in the module whose `module_path!()` is `module`: a test binary holds one
/// module per file, and its tests' names start with the module's path below the crate.
pub fn qualified(module: &str, f: &str) -> String {
    match module.split_once("::") {
        Some((_, below)) => format!("{below}::{f}"),
        None => f.to_string(),
    }
}

/// The libtest name of the calling module's test `f` (for `--exact`, re-running this binary as a rank).
#[allow(unused_macros)] // a binary whose tests start no processes has no use for it
macro_rules! test_name {
    ($f:literal) => {
        $crate::common::qualified(module_path!(), $f)
    };
}
#[allow(unused_imports)]
pub(crate) use test_name;

/// Starts `world` copies of this test binary, each running the ignored test `worker` (its full name,
/// [`test_name!`]) with torchrun's
/// environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus `env`. Returns the children.
pub fn spawn_ranks(worker: &str, world: usize, env: &[(&str, String)]) -> Vec<std::process::Child> {
    spawn_mixed(worker, world, &[], "", env)
}

/// [`spawn_ranks`] with the ranks in `python_ranks` running the script `script` (a path under the
/// repository) in the torch venv's Python instead: a group of PyTorch and tch-dist ranks. The tch-dist
/// ranks speak PyTorch's exact protocol then (`TCH_DIST_VERIFY=0`).
pub fn spawn_mixed(
    worker: &str,
    world: usize,
    python_ranks: &[usize],
    script: &str,
    env: &[(&str, String)],
) -> Vec<std::process::Child> {
    let port = free_port();
    let exe = std::env::current_exe().expect("current exe");
    (0..world)
        .map(|rank| {
            let mut c = if python_ranks.contains(&rank) {
                let mut c = Command::new(python());
                c.arg(repo_path(script));
                c
            } else {
                let mut c = Command::new(&exe);
                c.args(["--ignored", "--exact", worker, "--nocapture", "--test-threads=1"]);
                c
            };
            c.env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if !python_ranks.is_empty() {
                // a Python peer speaks plain Gloo: no agreement checks, no strict mode's protocol
                c.env("TCH_DIST_VERIFY", "0").env("TCH_DIST_STRICT_NCCL", "0");
            }
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().expect("spawn rank process")
        })
        .collect()
}

/// Waits for every child, at most `limit` in all (killing stragglers), and returns their outputs.
pub fn wait_all(children: Vec<std::process::Child>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    let mut children: Vec<Option<std::process::Child>> = children.into_iter().map(Some).collect();
    loop {
        let done = children.iter_mut().all(|c| match c {
            Some(ch) => matches!(ch.try_wait(), Ok(Some(_))),
            None => true,
        });
        if done || start.elapsed() > limit {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .map(|c| {
            let mut ch = c.expect("child");
            if !matches!(ch.try_wait(), Ok(Some(_))) {
                let _ = ch.kill();
            }
            ch.wait_with_output().expect("child output")
        })
        .collect()
}

pub fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Spawns the ranks, waits, and asserts every one exited successfully.
pub fn run_ranks_ok(worker: &str, world: usize, env: &[(&str, String)], limit: Duration) -> Vec<Output> {
    let outs = wait_all(spawn_ranks(worker, world, env), limit);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} of {worker} failed:\n{}", show(o));
    }
    outs
}

/// The venv's Python (set by scripts/env.sh), else python3 on PATH.
pub fn python() -> String {
    std::env::var("TCH_DIST_PYTHON_BIN").unwrap_or_else(|_| "python3".into())
}

pub fn repo_path(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Python's documentation topics (`pydoc_data/topics.py`): a real English text on every machine with
/// CPython, the examples' training corpus.
pub fn corpus() -> String {
    let o = Command::new(python())
        .args(["-c", "import pydoc_data.topics as t; print(t.__file__)"])
        .output()
        .expect("python runs");
    assert!(o.status.success(), "{}", show(&o));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// Runs `example` on `procs` processes under tchrun with `args` and `--losses FILE`; returns the losses
/// of its `step loss` lines.
pub fn example_losses(example: &str, procs: usize, args: &[&str], losses: &std::path::Path) -> Vec<f64> {
    let o = Command::new(tchrun())
        .args(["--standalone", "--nproc-per-node", &procs.to_string(), "--"])
        .arg(self::example(example))
        .args(args)
        .arg("--losses")
        .arg(losses)
        .output()
        .expect("tchrun runs");
    assert!(o.status.success(), "{example} {args:?} on {procs} processes: {}", show(&o));
    std::fs::read_to_string(losses)
        .expect("the losses file")
        .lines()
        .map(|l| l.split_whitespace().nth(1).and_then(|x| x.parse().ok()).expect("a `step loss` line"))
        .collect()
}

/// Runs `example` (on the corpus, with `args`, `steps` steps) in one process and on each `(processes,
/// layout flags)`: every layout's loss equals the one process's within `tol` at every step, and the
/// one process's falls by more than 1.
pub fn layouts_train_like_one_process(
    example: &str,
    args: &[&str],
    steps: usize,
    layouts: &[(usize, &[&str])],
    tol: f64,
) {
    layouts_train_like(example, example, args, steps, layouts, tol)
}

/// [`layouts_train_like_one_process`] with another program as the one process: `reference` (the
/// one-process program that `example` ports) runs alone with `args`.
pub fn layouts_train_like(
    reference: &str,
    example: &str,
    args: &[&str],
    steps: usize,
    layouts: &[(usize, &[&str])],
    tol: f64,
) {
    // a folder per call: tests of one binary run at once, several of them over the same example
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tch-dist-{example}-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let corpus = corpus();
    let run = |procs: usize, layout: &[&str], file: &str| {
        let mut all = vec!["--corpus", corpus.as_str()];
        all.extend(args);
        all.extend(layout);
        let program = if procs == 1 && layout.is_empty() { reference } else { example };
        let losses = example_losses(program, procs, &all, &dir.join(file));
        assert_eq!(losses.len(), steps, "{layout:?}: one loss per step");
        losses
    };
    let one = run(1, &[], "one.txt");
    assert!(one[steps - 1] < one[0] - 1.0, "the loss must fall: {} -> {}", one[0], one[steps - 1]);
    for (procs, layout) in layouts {
        let got = run(*procs, layout, &format!("{}.txt", layout.join("")));
        for (s, (a, b)) in one.iter().zip(&got).enumerate() {
            assert!((a - b).abs() <= tol, "step {s}: one process {a}, {layout:?} {b}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
