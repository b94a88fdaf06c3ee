//! `tchrun`: runs DDP jobs and any program (PyTorch scripts too) with torchrun's environment, reports a
//! failed worker clearly and stops the rest, restarts and resumes from checkpoints exactly, and forms one
//! group from two launchers ("nodes") on this machine.
use crate::common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn tchrun() -> Command {
    let mut c = Command::new(common::tchrun());
    c.env("TCH_DIST_TIMEOUT_SECS", "20").stdin(Stdio::null());
    c
}

fn example(name: &str) -> String {
    common::example(name).to_string_lossy().to_string()
}

fn run(mut c: Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let out = common::wait_all(vec![child], limit).pop().unwrap();
    (out, start.elapsed())
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string())
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tdx-tchrun-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn runs_ddp_on_2_and_3_ranks_with_prefixed_output() {
    for n in [2, 3] {
        let mut c = tchrun();
        c.args(["--standalone", "--nproc-per-node", &n.to_string(), "--", &example("ddp_elastic"), "--steps", "3"]);
        let (o, _) = run(c, Duration::from_secs(120));
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}\n{err}");
        assert!(out.contains("[rank0]: step 2 loss"), "{out}");
        for r in 0..n {
            assert!(out.contains(&format!("[rank{r}]: rank {r} done")), "{out}");
        }
    }
}

#[test]
fn runs_a_pytorch_script_as_torchrun_would() {
    let mut c = tchrun();
    c.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--",
        &common::python(),
        &common::repo_path("tests/py/allreduce_check.py").to_string_lossy(),
    ]);
    let (o, _) = run(c, Duration::from_secs(120));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("[rank1]: python rank 1 of 2: allreduce ok"), "{out}");
}

#[test]
fn a_failed_worker_stops_the_job_with_a_clear_report() {
    let mut c = tchrun();
    c.env("TDX_FAIL_RANK", "1").env("TDX_FAIL_STEP", "2");
    c.args(["--standalone", "--nproc-per-node", "3", "--", &example("ddp_elastic"), "--steps", "50"]);
    let (o, took) = run(c, Duration::from_secs(120));
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert!(err.contains("tchrun: rank 1 (local rank 1) failed with exit code 17"), "{err}");
    assert!(err.contains("tchrun:   rank 1: injected failure at step 2"), "{err}");
    assert!(!out.contains("rank 0 done"), "{out}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[test]
fn a_worker_killed_by_a_signal_is_reported_and_the_others_are_stopped() {
    // rank 1 kills itself; rank 0 would sleep for a minute unless tchrun stops it
    let mut c = tchrun();
    c.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--grace-secs",
        "1",
        "--",
        "sh",
        "-c",
        "echo started $RANK; if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 60",
    ]);
    let (o, took) = run(c, Duration::from_secs(60));
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("rank 1 (local rank 1) failed with signal 9 (SIGKILL)"), "{err}");
    assert!(err.contains("tchrun:   started 1"), "{err}");
    assert!(took < Duration::from_secs(15), "took {took:?}: rank 0 was not stopped");
}

#[test]
fn restart_resumes_from_the_checkpoint_and_ends_exactly_as_an_uninterrupted_run() {
    let d = tmp("restart");
    let (a, b) = (d.join("uninterrupted.f32"), d.join("restarted.f32"));
    let mut c = tchrun();
    c.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--",
        &example("ddp_elastic"),
        "--steps",
        "10",
        "--out",
        a.to_str().unwrap(),
    ]);
    let (o, _) = run(c, Duration::from_secs(120));
    assert!(o.status.success(), "{:?}", text(&o));

    let mut c = tchrun();
    c.env("TDX_FAIL_RANK", "1").env("TDX_FAIL_STEP", "7").env("TDX_FAIL_ONCE", d.join("failed-once"));
    c.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--redirect-logs",
        d.join("logs").to_str().unwrap(),
        "--",
        &example("ddp_elastic"),
        "--steps",
        "10",
        "--ckpt",
        d.join("ckpt.safetensors").to_str().unwrap(),
        "--every",
        "3",
        "--out",
        b.to_str().unwrap(),
    ]);
    let (o, _) = run(c, Duration::from_secs(120));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("restarting all 2 workers (restart 1 of 1)"), "{err}");
    assert!(out.contains("[rank0]: rank 0: resumed from") && out.contains("at step 6"), "{out}");
    // same parameters, bit for bit (2 ranks: sums of two are exact in any order)
    let (pa, pb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(!pa.is_empty() && pa == pb, "restarted run ended with different parameters");
    // logs of both attempts
    let log = std::fs::read_to_string(d.join("logs/rank1.restart0.log")).unwrap();
    assert!(log.contains("injected failure at step 7"), "{log}");
    assert!(d.join("logs/rank0.restart1.log").exists());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn two_launchers_form_one_group_of_four() {
    let port = common::free_port().to_string();
    let node = |r: &str| {
        let mut c = tchrun();
        c.args([
            "--nnodes",
            "2",
            "--node-rank",
            r,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--nproc-per-node",
            "2",
            "--",
            &example("ddp_elastic"),
            "--steps",
            "3",
        ]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let children = vec![node("0"), node("1")];
    let outs = common::wait_all(children, Duration::from_secs(120));
    for o in &outs {
        assert!(o.status.success(), "{:?}", text(o));
    }
    let (n1, _) = text(&outs[1]);
    assert!(n1.contains("[rank2]: rank 2 done") && n1.contains("[rank3]: rank 3 done"), "{n1}");
}

#[test]
fn bad_launcher_arguments_are_one_line_errors() {
    let mut c = tchrun();
    c.args(["--nnodes", "2", "--node-rank", "2", "--", "true"]);
    let (o, _) = run(c, Duration::from_secs(10));
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(err.trim(), "tchrun: invalid argument: --node-rank 2 is not below --nnodes 2");
    let mut c = tchrun();
    c.args(["--standalone", "--nproc-per-node", "2", "--", "/no/such/program"]);
    let (o, _) = run(c, Duration::from_secs(10));
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(err.contains("cannot start \"/no/such/program\" for rank 0"), "{err}");
}

/// An error after some workers started (here rank 1's log file cannot be created) stops those workers.
#[test]
fn an_early_error_leaves_no_worker_running() {
    let dir = std::env::temp_dir().join(format!("tdx-tchrun-logs-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("rank1.restart0.log")).unwrap(); // a directory where the file should go
    let start = Instant::now();
    let mut c = tchrun();
    c.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--redirect-logs",
        dir.to_str().unwrap(),
        "--",
        "sleep",
        "31.713",
    ]);
    let (o, _) = run(c, Duration::from_secs(60));
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("rank1.restart0.log"), "{}", common::show(&o));
    assert!(start.elapsed() < Duration::from_secs(20));
    let left = Command::new("pgrep").args(["-f", "sleep 31.713"]).output().unwrap();
    assert!(!left.status.success(), "a worker is still running: {}", String::from_utf8_lossy(&left.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The default dump directory is named after tchrun's process id, which the system reuses: a dump an
/// earlier job left there must not be read as this job's (it would hide the rank that left none).
#[test]
fn a_stale_flight_dump_is_not_read_as_this_jobs() {
    use tch_dist::flight::{Dump, Entry, EntryState};
    let dir = tmp("stale-dump");
    let attempt = dir.join("restart0");
    std::fs::create_dir_all(&attempt).unwrap();
    let stale = Dump {
        rank: 1,
        pid: 1,
        host: "elsewhere".into(),
        time: 0.0,
        reason: "an earlier job".into(),
        peers: Vec::new(),
        groups: Default::default(),
        entries: vec![Entry {
            id: 1,
            group: "default".into(),
            group_rank: 1,
            group_size: 2,
            seq: 7,
            collective_seq: 7,
            p2p_seq: 0,
            op: "allreduce(Sum) of Float[3] on Cpu".into(),
            backend: "gloo".into(),
            label: "stale label from an earlier job".into(),
            enqueued: 0.0,
            ended: None,
            state: EntryState::Pending,
            error: None,
        }],
    };
    let path = attempt.join("rank1.json");
    std::fs::write(&path, serde_json::to_string(&stale).unwrap()).unwrap();
    // a dump of a rank this launcher does not start is not its to remove
    let other = Dump { rank: 5, ..stale.clone() };
    std::fs::write(attempt.join("rank5.json"), serde_json::to_string(&other).unwrap()).unwrap();
    let mut c = tchrun();
    c.args(["--standalone", "--nproc-per-node", "2", "--grace-secs", "1", "--trace-dir"]).arg(&dir).args([
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60",
    ]);
    let (o, _) = run(c, Duration::from_secs(60));
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("rank 1 (local rank 1) failed with exit code 3"), "{err}");
    assert!(!path.exists(), "the stale dump is still there");
    assert!(attempt.join("rank5.json").exists(), "another launcher's rank's dump was removed");
    // only rank 5's dump is left, so nothing is said of rank 1's collectives
    assert!(!err.contains("rank 1 last recorded"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--trace-out` of a pipelined, sharded GPT (pp 2 x FSDP 2, 4 ranks): every rank's track holds FSDP's
/// forward spans, the pipeline's microbatch forwards and backwards (which run the units' backward), the
/// optimizer's steps, the reduce-scatters labelled by unit, and on the last stage its waits for the
/// activations the first one sends.
#[test]
fn a_pipelined_sharded_model_s_timeline_shows_each_part_of_a_step() {
    let dir = std::env::temp_dir().join(format!("tch-dist-timeline-pp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("trace.json");
    let mut c = tchrun();
    c.args(["--standalone", "--nproc-per-node", "4", "--trace-out", &file.to_string_lossy(), "--"]);
    c.args([&example("gpt"), "--corpus", &crate::common::corpus(), "--pp", "2", "--fsdp", "2", "--steps", "2"]);
    c.args(["--layers", "2", "--d", "32", "--heads", "2", "--context", "16", "--global-batch", "8"]);
    let (o, _) = run(c, Duration::from_secs(180));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let count = |rank: u64, cat: &str, name: &str| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == rank && e["cat"] == cat)
            .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with(name)))
            .count()
    };
    for rank in 0..4u64 {
        let parts = [("forward", "FSDP forward"), ("forward", "F"), ("backward", "B"), ("optimizer", "AdamW step")];
        for (cat, name) in parts {
            assert!(count(rank, cat, name) >= 2, "rank {rank}: {} {cat} spans named {name:?}", count(rank, cat, name));
        }
        let reduced = events.iter().any(|e| {
            e["pid"] == rank
                && e["cat"] == "collective"
                && e["name"].as_str().is_some_and(|n| n.starts_with("FSDP reduce-scatter, unit"))
        });
        assert!(reduced, "rank {rank}: no reduce-scatter labelled with its unit");
    }
    // the mesh is [pp, fsdp]: ranks 2 and 3 run the last stage, which waits for activations
    for rank in 2..4u64 {
        assert!(count(rank, "pipeline wait", "wait for Activation") >= 2, "rank {rank}: no waits for activations");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--trace-out`: one file, a track per rank, DDP's forward and backward spans on each, and the bucket
/// allreduces recorded during a backward of the same rank.
#[test]
fn a_timeline_of_every_rank_opens_in_perfetto() {
    let dir = std::env::temp_dir().join(format!("tch-dist-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("trace.json");
    let mut c = tchrun();
    c.args(["--standalone", "--nproc-per-node", "2", "--trace-out", &file.to_string_lossy()]);
    c.args(["--", &example("ddp_elastic"), "--steps", "3"]);
    let (o, _) = run(c, Duration::from_secs(120));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("timeline of 2 rank(s)"), "{err}");
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let spans = |rank: u64, name: &str| -> Vec<(f64, f64)> {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == rank && e["name"].as_str().is_some_and(|n| n.starts_with(name)))
            .map(|e| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()))
            .collect()
    };
    for rank in 0..2u64 {
        let named = events.iter().any(|e| e["name"] == "process_name" && e["pid"] == rank);
        assert!(named, "rank {rank} has no track");
        let (fwd, bwd, buckets) = (spans(rank, "DDP forward"), spans(rank, "DDP backward"), spans(rank, "DDP bucket"));
        assert!(fwd.len() >= 3 && bwd.len() >= 3, "rank {rank}: {} forwards, {} backwards", fwd.len(), bwd.len());
        let inside = buckets.iter().filter(|(s, e)| bwd.iter().any(|(bs, be)| bs <= s && e <= be)).count();
        assert!(inside >= 3, "rank {rank}: {inside} of {} bucket allreduces inside a backward", buckets.len());
    }
    // drawn as a PNG: a row of 24 pixels per track, within a 10-pixel margin (the header says its height)
    let png = dir.join("trace.png");
    let rows = tch_dist::timeline::write_png(&file, &png).unwrap();
    let mut tracks: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap()))
        .collect();
    tracks.sort();
    tracks.dedup();
    assert_eq!(rows, tracks.len());
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    let (w, h) =
        (u32::from_be_bytes(bytes[16..20].try_into().unwrap()), u32::from_be_bytes(bytes[20..24].try_into().unwrap()));
    assert_eq!((w, h), (1200, 24 * rows as u32 + 20), "{rows} rows");
    let _ = std::fs::remove_dir_all(&dir);
}
