//! Elastic tchrun: three launchers on this machine act as three nodes (`--nnodes 2:3`, one rendezvous
//! endpoint) training DDP + ZeRO-2 with a fixed global batch and sharded checkpoints. A launcher killed
//! with SIGKILL: the two survivors restart as a world of 2, resume from the checkpoint (resharded) and
//! finish, with the parameters of an uninterrupted run that changed world size at the same step. A node
//! arriving late joins at the next round. Fewer than MIN nodes: a clear error after the timeout.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tch_dist::checkpoint;

const STEPS: &str = "24";

/// One job at a time: they time heartbeats, and this machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn tchrun() -> Command {
    let mut c = Command::new(common::tchrun());
    c.env("TCH_DIST_TIMEOUT_SECS", "20").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

fn example() -> String {
    common::example("elastic_zero").to_string_lossy().to_string()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tdx-elastic-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A launcher of an elastic job of 2 to 3 nodes, one worker each.
fn node(port: u16, run: &str, d: &Path, name: &str, max_restarts: &str) -> Child {
    let mut c = tchrun();
    c.args(["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", &format!("127.0.0.1:{port}")]);
    c.args(["--rdzv-last-call", "1", "--rdzv-heartbeat-timeout", "3", "--rdzv-timeout", "60"]);
    c.args(["--max-restarts", max_restarts, "--run-id", run, "--grace-secs", "1", "--"]);
    c.arg(example()).args(["--steps", STEPS, "--every", "2", "--step-ms", "150", "--ckpt"]);
    c.arg(d.join("ckpt")).arg("--out").arg(d.join(format!("final-{name}.f32")));
    c.spawn().unwrap()
}

/// Waits until a checkpoint of at least `step` is committed.
fn until_checkpoint(root: &Path, step: u64) {
    let start = Instant::now();
    while checkpoint::committed_steps(root).last().is_none_or(|&s| s < step) {
        assert!(start.elapsed() < Duration::from_secs(60), "no checkpoint of step {step} after 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn text(o: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The step the last round resumed from, at world size `world`, as rank 0 printed it.
fn resumed_at(outs: &[Output], world: usize) -> usize {
    let pat = format!("at world size {world} (restart ");
    outs.iter()
        .flat_map(|o| String::from_utf8_lossy(&o.stdout).lines().map(String::from).collect::<Vec<_>>())
        .filter(|l| l.contains(&pat))
        .filter_map(|l| l.split("resumed from step ").nth(1)?.split(' ').next()?.parse().ok())
        .next_back()
        .unwrap_or_else(|| {
            panic!("no rank 0 resumed at world size {world}:\n{}", outs.iter().map(text).collect::<String>())
        })
}

fn floats(p: &Path) -> Vec<f32> {
    std::fs::read(p).unwrap().chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// The uninterrupted run that changes world size at `step`: `first` ranks to it, `then` ranks after.
fn reference(d: &Path, first: &str, step: usize, then: &str) -> Vec<f32> {
    let (ckpt, out) = (d.join("ref-ckpt"), d.join("ref.f32"));
    for (n, stop) in [(first, Some(step)), (then, None)] {
        let mut c = tchrun();
        c.args(["--standalone", "--nproc-per-node", n, "--"]).arg(example());
        c.args(["--steps", STEPS, "--every", "2", "--ckpt"]).arg(&ckpt).arg("--out").arg(&out);
        if let Some(s) = stop {
            c.args(["--stop-at", &s.to_string()]);
        }
        let o = common::wait_all(vec![c.spawn().unwrap()], Duration::from_secs(120)).remove(0);
        assert!(o.status.success(), "reference on {n}: {}", text(&o));
    }
    floats(&out)
}

fn final_params(d: &Path) -> Vec<f32> {
    let written: Vec<PathBuf> =
        ["a", "b", "c"].iter().map(|n| d.join(format!("final-{n}.f32"))).filter(|p| p.exists()).collect();
    assert_eq!(written.len(), 1, "rank 0 of the last round writes the parameters once: {written:?}");
    floats(&written[0])
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn a_killed_node_leaves_two_that_resume_from_the_checkpoint_and_finish() {
    let _one = serial();
    let d = tmp("kill");
    let port = common::free_port();
    let a = node(port, "kill", &d, "a", "2");
    std::thread::sleep(Duration::from_millis(500)); // a hosts the store
    let b = node(port, "kill", &d, "b", "2");
    let mut c = node(port, "kill", &d, "c", "2");
    until_checkpoint(&d.join("ckpt"), 6);
    c.kill().unwrap(); // SIGKILL: no goodbye, its worker dies with it
    let killed_at = Instant::now();
    let _ = c.wait();
    let outs = common::wait_all(vec![a, b], Duration::from_secs(120));
    for o in &outs {
        assert!(o.status.success(), "{}", text(o));
    }
    let all: String = outs.iter().map(text).collect();
    assert!(all.contains("resumed from step 0 at world size 3 (restart 0)"), "{all}");
    assert!(all.contains("round 1: node 1 of 2, world size 2"), "{all}");
    let step = resumed_at(&outs, 2);
    assert!(step >= 6, "resumed from step {step}");
    eprintln!("killed after step 6; survivors resumed from {step}, {:?} after the kill", killed_at.elapsed());
    let got = final_params(&d);
    let want = reference(&d, "3", step, "2");
    let diff = max_diff(&got, &want);
    eprintln!("final parameters vs an uninterrupted run changing world size at step {step}: {diff:e}");
    assert!(diff < 1e-5, "{diff:e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_node_arriving_late_joins_at_the_next_round_without_using_a_restart() {
    let _one = serial();
    let d = tmp("join");
    let port = common::free_port();
    let a = node(port, "join", &d, "a", "0");
    std::thread::sleep(Duration::from_millis(500));
    let b = node(port, "join", &d, "b", "0");
    until_checkpoint(&d.join("ckpt"), 4);
    let c = node(port, "join", &d, "c", "0");
    let outs = common::wait_all(vec![a, b, c], Duration::from_secs(120));
    for o in &outs {
        assert!(o.status.success(), "{}", text(o));
    }
    let all: String = outs.iter().map(text).collect();
    assert!(all.contains("resumed from step 0 at world size 2 (restart 0)"), "{all}");
    assert!(all.contains("membership: 1 node(s) waiting to join"), "{all}");
    let step = resumed_at(&outs, 3);
    assert!(step >= 4, "resumed from step {step}");
    let diff = max_diff(&final_params(&d), &reference(&d, "2", step, "3"));
    eprintln!("late joiner: resumed at world size 3 from step {step}; {diff:e} from the uninterrupted run");
    assert!(diff < 1e-5, "{diff:e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn fewer_than_min_nodes_is_an_error_after_the_timeout_not_a_hang() {
    let _one = serial();
    let d = tmp("alone");
    let port = common::free_port();
    let mut c = tchrun();
    c.args(["--nnodes", "2:3", "--rdzv-endpoint", &format!("127.0.0.1:{port}"), "--rdzv-timeout", "3", "--"]);
    c.arg(example()).arg("--ckpt").arg(d.join("ckpt"));
    let start = Instant::now();
    let o = common::wait_all(vec![c.spawn().unwrap()], Duration::from_secs(60)).remove(0);
    let took = start.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("1 of at least 2 nodes joined round 0 within 3s"), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_launcher_that_stops_heartbeating_is_taken_as_lost() {
    let _one = serial();
    let d = tmp("silent");
    let port = common::free_port();
    let a = node(port, "silent", &d, "a", "2");
    std::thread::sleep(Duration::from_millis(500));
    let b = node(port, "silent", &d, "b", "2");
    let mut c = node(port, "silent", &d, "c", "2");
    until_checkpoint(&d.join("ckpt"), 4);
    // frozen, not dead: its worker's connections stay open, only the heartbeats stop
    // SAFETY: kill(2) with a pid this test spawned and still holds.
    unsafe { libc::kill(c.id() as i32, libc::SIGSTOP) };
    let outs = common::wait_all(vec![a, b], Duration::from_secs(120));
    let _ = c.kill();
    let _ = c.wait();
    for o in &outs {
        assert!(o.status.success(), "{}", text(o));
    }
    let all: String = outs.iter().map(text).collect();
    assert!(all.contains("lost (no heartbeat for 3s)"), "{all}");
    assert!(resumed_at(&outs, 2) >= 4);
    let _ = std::fs::remove_dir_all(&d);
}
