//! The fault-injection suite: a training job (examples/fault_drill.rs) under tchrun with one fault
//! injected. Every fault ends every rank within the collective timeout plus a few seconds, the culprit
//! is named (in the ranks' errors and in tchrun's report), and nothing already saved is lost.
//! `scripts/faults.sh` runs the same drills and prints the table in docs/failures.md.
use crate::common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The collective timeout the drills run with.
const TIMEOUT: u64 = 10;
/// What "a few seconds" may add: tchrun's grace period for SIGTERM before SIGKILL, and start-up. The
/// 4-rank drills (pp x dp, a mesh) allow it three times over: their start-up and first steps under a
/// loaded machine took 11.1 s where 3 + 8 was allowed, still far from the collective timeout (600 s)
/// the bound tells apart.
const SLACK: u64 = 8;

/// Runs `ranks` ranks of the drill with `fault`; (output, seconds).
fn drill(ranks: usize, mode: &str, fault: &str, extra: &[&str]) -> (Output, f64) {
    drill_env(ranks, mode, fault, extra, &[])
}

/// The same, with more environment variables (they win over the drill's own).
fn drill_env(ranks: usize, mode: &str, fault: &str, extra: &[&str], env: &[(&str, &str)]) -> (Output, f64) {
    let start = Instant::now();
    let o = Command::new(common::tchrun())
        .args(["--standalone", "--nproc-per-node", &ranks.to_string(), "--grace-secs", "2", "--"])
        .arg(common::example("fault_drill"))
        .args(["--mode", mode, "--steps", "8"])
        .args(extra)
        .env("TDX_FAULT", fault)
        .env("TCH_DIST_TIMEOUT_SECS", TIMEOUT.to_string())
        .env("RUST_BACKTRACE", "0")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (o, start.elapsed().as_secs_f64())
}

/// The collective timeout by default (600 s), so that only the mechanism under test can end the job.
const DEFAULT_TIMEOUT: (&str, &str) = ("TCH_DIST_TIMEOUT_SECS", "600");

/// Ranks of the drill started by hand (no launcher), rank `i` with `WORLD_SIZE=worlds[i]` and `RANK=ranks[i]`,
/// all at one store; each one's output and how long until all had ended.
fn by_hand(ranks: &[usize], worlds: &[usize]) -> (Vec<Output>, f64) {
    let port = common::free_port().to_string();
    let start = Instant::now();
    let children: Vec<_> = ranks
        .iter()
        .zip(worlds)
        .map(|(r, w)| {
            Command::new(common::example("fault_drill"))
                .envs([("RANK", r.to_string()), ("WORLD_SIZE", w.to_string())])
                .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port), DEFAULT_TIMEOUT])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    (outs, start.elapsed().as_secs_f64())
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn assert_failed_in_time(o: &Output, secs: f64, within: u64) {
    assert!(!o.status.success(), "the job should have failed:\n{}", text(o));
    assert!(secs < within as f64, "took {secs:.1}s (limit {within}s):\n{}", text(o));
}

#[test]
fn a_stopped_rank_is_named_during_ddp_zero2_and_a_pipeline() {
    for (mode, ranks) in [("ddp", 3), ("zero2", 3), ("pipeline", 2)] {
        let (o, secs) = drill(ranks, mode, "stop@1:3", &[]);
        let t = text(&o);
        assert_failed_in_time(&o, secs, TIMEOUT + SLACK);
        // the ranks' own errors name rank 1 and say its process shows no sign of life
        assert!(t.contains("rank 1") && t.contains("no sign of life"), "{mode}:\n{t}");
        // tchrun's merge of the dumps names it too, and the collective the others wait in
        assert!(t.contains("tchrun:   culprit: rank 1"), "{mode}:\n{t}");
        if mode != "pipeline" {
            assert!(t.contains("rank 1 never entered collective #"), "{mode}:\n{t}");
            assert!(t.contains("stuck in collective #"), "{mode}:\n{t}");
        }
    }
}

#[test]
fn a_rank_killed_mid_bucket_ends_the_others_at_once() {
    let (o, secs) = drill(3, "ddp", "killbucket@1:2", &[]);
    let t = text(&o);
    // the others see the connection drop: no need to wait for the timeout
    assert_failed_in_time(&o, secs, SLACK);
    assert!(t.contains("rank 1 (local rank 1) failed with signal 9 (SIGKILL)"), "{t}");
}

#[test]
fn the_rank_holding_the_store_killed_ends_the_others_at_once() {
    // rank 0 serves the TCPStore
    let (o, secs) = drill(3, "ddp", "killbucket@0:2", &[]);
    let t = text(&o);
    assert_failed_in_time(&o, secs, SLACK);
    assert!(t.contains("rank 0 (local rank 0) failed with signal 9 (SIGKILL)"), "{t}");
}

#[test]
fn a_rank_calling_another_collective_is_a_mismatch_on_every_rank() {
    let (o, secs) = drill(3, "ddp", "mismatch@2:2", &[]);
    let t = text(&o);
    assert_failed_in_time(&o, secs, SLACK);
    assert!(
        t.contains("ranks disagree on dtype/shape: rank 0: Float[5], rank 1: Float[5], rank 2: Float[3]; the odd one out: rank 2"),
        "{t}"
    );
    // every rank saw the disagreement and left its flight-recorder dump, which tchrun read
    for r in 0..3 {
        assert!(t.contains(&format!("tchrun:   rank {r} last recorded #")), "rank {r}'s dump:\n{t}");
    }
}

#[test]
fn a_failing_stage_tells_the_other_stages_at_once() {
    let (o, secs) = drill(2, "pipeline", "badloss@1:2", &[]);
    let t = text(&o);
    assert_failed_in_time(&o, secs, SLACK);
    assert!(t.contains("[rank0]: Error: pipeline stage 0 waiting for Grad of microbatch 0: rank 1 failed"), "{t}");
}

/// pp 2 x DDP 2: world rank 3 is rank 1 of its pipeline group [1, 3]. The others, and tchrun's headline,
/// name it by its world rank (before, rank 1 read "rank 1 failed": its own number).
#[test]
fn a_failing_stage_is_named_by_its_world_rank_under_data_parallelism() {
    let (o, secs) = drill(4, "pipeline-dp", "badloss@3:2", &[]);
    let t = text(&o);
    assert_failed_in_time(&o, secs, SLACK);
    assert!(t.contains("[rank1]: Error: pipeline stage 0 waiting for Grad of microbatch 0: rank 3 failed"), "{t}");
    let culprit = t.lines().find(|l| l.contains("culprit: ")).unwrap_or_default();
    assert!(culprit.contains("culprit: rank 3 ("), "the headline names world rank 3 alone: {t}");
}

/// A rank stopped under pp 2 x DDP 2: the peers waiting on it in a subgroup name it by its world rank
/// beside its rank there, and tchrun's headline follows that to it (before, the headline named rank 2,
/// the first to pass the failure on).
#[test]
fn a_stopped_rank_of_a_subgroup_is_named_by_its_world_rank() {
    let env = [DEFAULT_TIMEOUT, ("TCH_DIST_HEARTBEAT_TIMEOUT_SECS", "3")];
    let (o, secs) = drill_env(4, "pipeline-dp", "stop@3:3", &[], &env);
    let t = text(&o);
    assert_failed_in_time(&o, secs, 3 + 3 * SLACK);
    let named = t.lines().find(|l| l.contains("(world rank 3) of group mesh-")).unwrap_or_default();
    assert!(named.contains("rank 1 (world rank 3) of group mesh-") && named.contains("published no heartbeat"), "{t}");
    let culprit = t.lines().find(|l| l.contains("culprit: ")).unwrap_or_default();
    assert!(culprit.contains("culprit: rank 3 ("), "the headline names world rank 3: {t}");
}

/// A 2 x 2 mesh whose world rank 3 stops: rank 2, waiting for it in their tp group, never enters the dp
/// all-reduce rank 0 waits in. The recorder names rank 3 (it left no dump), not rank 2, which is held up
/// (found by an outside user: the headline named rank 2).
#[test]
fn a_rank_held_up_in_another_group_is_not_the_culprit() {
    let env = [DEFAULT_TIMEOUT, ("TCH_DIST_HEARTBEAT_TIMEOUT_SECS", "3")];
    let (o, secs) = drill_env(4, "mesh", "stop@3:3", &[], &env);
    let t = text(&o);
    assert_failed_in_time(&o, secs, 3 + 3 * SLACK);
    let culprit = t.lines().find(|l| l.contains("culprit: ")).unwrap_or_default();
    assert!(culprit.contains("culprit: rank 3 (named by the flight recorder"), "{t}");
    assert!(t.contains("rank 2 never entered #") && t.contains("(it waits in #"), "{t}");
    assert!(t.contains("rank 3 of mesh-tp [2, 3] left no dump"), "{t}");
}

#[test]
fn an_unwritable_checkpoint_fails_every_rank_at_once_naming_rank_0_and_the_file() {
    let (o, secs) = drill(2, "ddp", "none@0:0", &["--ckpt", "/dev/null/ckpt.safetensors"]);
    let t = text(&o);
    assert_failed_in_time(&o, secs, SLACK);
    assert!(
        t.contains(
            "[rank1]: Error: checkpoint save on rank 1 of 2: rank 0 failed: checkpoint /dev/null/ckpt.safetensors"
        ),
        "{t}"
    );
}

#[test]
fn a_damaged_or_truncated_checkpoint_is_refused_by_name_and_the_good_one_stays() {
    use tch::{nn, Device};
    use tch_dist::{checkpoint, ProcessGroup, Store};
    let pg = ProcessGroup::new(&Store::hash().unwrap(), 0, 1, &common::gloo_opts(Duration::from_secs(30))).unwrap();
    let dir = std::env::temp_dir().join(format!("tdx-faults-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(vs.root() / "fc", 64, 64, Default::default());
    let good = dir.join("good.safetensors");
    checkpoint::save_var_store(&pg, &good, 5, &vs).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    // one bit flipped in the data
    let mut flipped = bytes.clone();
    let at = flipped.len() - 100;
    flipped[at] ^= 0x10;
    let bad = dir.join("flipped.safetensors");
    std::fs::write(&bad, &flipped).unwrap();
    let e = checkpoint::load_var_store(&pg, &bad, &vs).unwrap_err().to_string();
    assert!(e.contains("flipped.safetensors") && e.contains("checksum") && e.contains("damaged"), "{e}");
    // cut short
    let cut = dir.join("truncated.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = checkpoint::load_var_store(&pg, &cut, &vs).unwrap_err().to_string();
    assert!(e.contains("truncated.safetensors") && e.contains("unreadable"), "{e}");
    // a failed save elsewhere leaves the good checkpoint as it was
    assert!(checkpoint::save_var_store(&pg, std::path::Path::new("/dev/null/x.safetensors"), 6, &vs).is_err());
    assert_eq!(std::fs::read(&good).unwrap(), bytes);
    assert_eq!(checkpoint::load_var_store(&pg, &good, &vs).unwrap(), Some(5));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_environment_values_are_named() {
    for (var, value, want) in [
        ("TCH_DIST_TIMEOUT_SECS", "-1", "TCH_DIST_TIMEOUT_SECS: \"-1\" is not a positive number of seconds"),
        ("TCH_DIST_TIMEOUT_SECS", "inf", "is not a positive number of seconds"),
        ("TCH_DIST_BACKEND", "mpi", "environment variable TCH_DIST_BACKEND"),
        ("WORLD_SIZE", "two", "environment variable WORLD_SIZE: \"two\" is not a valid number"),
    ] {
        let o = Command::new(common::example("fault_drill"))
            .envs([("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")])
            .env("MASTER_PORT", common::free_port().to_string())
            .env(var, value)
            .output()
            .unwrap();
        let t = text(&o);
        assert!(!o.status.success() && t.contains(want), "{var}={value}:\n{t}");
    }
    let o = Command::new(common::tchrun()).args(["--grace-secs", "inf", "--", "true"]).output().unwrap();
    assert!(!o.status.success() && text(&o).contains("--grace-secs inf is not a number of seconds"), "{}", text(&o));
}

#[test]
fn a_world_size_that_differs_between_ranks_is_named_at_once() {
    let (outs, secs) = by_hand(&[0, 1], &[2, 3]);
    for o in &outs {
        let t = text(o);
        assert_failed_in_time(o, secs, SLACK);
        assert!(
            t.contains("ranks were launched with different world sizes: rank 0 (WORLD_SIZE=2")
                && t.contains("rank 1 (WORLD_SIZE=3"),
            "{t}"
        );
    }
}

#[test]
fn a_rank_given_to_two_processes_is_named_on_every_rank_at_once() {
    // rank 2 never comes: without the check, everyone would wait for it
    let (outs, secs) = by_hand(&[0, 1, 1], &[3, 3, 3]);
    for o in &outs {
        let t = text(o);
        assert_failed_in_time(o, secs, SLACK);
        assert!(t.contains("RANK=1 was given to two processes"), "{t}");
    }
}

#[test]
fn launchers_that_disagree_on_nproc_per_node_are_named_at_once() {
    let port = common::free_port().to_string();
    let start = Instant::now();
    let launchers: Vec<_> = [1, 2]
        .iter()
        .enumerate()
        .map(|(node, n)| {
            Command::new(common::tchrun())
                .args(["--nnodes", "2", "--node-rank", &node.to_string(), "--nproc-per-node", &n.to_string()])
                .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--grace-secs", "2", "--"])
                .arg(common::example("fault_drill"))
                .envs([DEFAULT_TIMEOUT])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = launchers.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let secs = start.elapsed().as_secs_f64();
    for o in &outs {
        let t = text(o);
        assert_failed_in_time(o, secs, SLACK);
        assert!(t.contains("tchrun: culprit: rank "), "{t}");
        assert!(t.contains("the launchers disagree on --nproc-per-node (1 on node 0, 2 on node 1)"), "{t}");
    }
}

#[test]
fn a_frozen_rank_is_found_by_its_heartbeat_long_before_the_collective_timeout() {
    for mode in ["ddp", "fsdp"] {
        let env = [DEFAULT_TIMEOUT, ("TCH_DIST_HEARTBEAT_TIMEOUT_SECS", "3")];
        let (o, secs) = drill_env(3, mode, "stop@1:3", &[], &env);
        let t = text(&o);
        assert_failed_in_time(&o, secs, 3 + SLACK);
        assert!(t.contains("rank 1 of group default has published no heartbeat for 3."), "{mode}:\n{t}");
        assert!(t.contains("tchrun: culprit: rank 1 (named by the flight recorder)"), "{mode}:\n{t}");
    }
}

#[test]
fn a_slow_rank_whose_heartbeat_goes_on_is_never_ended() {
    // rank 1 sleeps 6 s, three heartbeat timeouts: its heartbeat thread goes on publishing
    for mode in ["ddp", "fsdp"] {
        let env = [DEFAULT_TIMEOUT, ("TCH_DIST_HEARTBEAT_TIMEOUT_SECS", "2")];
        let (o, _) = drill_env(3, mode, "sleep@1:3", &[], &env);
        let t = text(&o);
        assert!(o.status.success() && t.contains("sleeping 6 s") && t.matches("]: done").count() == 3, "{mode}:\n{t}");
    }
}

#[test]
fn a_forward_on_one_rank_only_is_named_by_the_loop_check_in_ddp_and_fsdp() {
    for (mode, who) in [("ddp", "DDP"), ("fsdp", "FSDP")] {
        let (o, secs) = drill_env(2, mode, "sample@0:3", &[], &[DEFAULT_TIMEOUT]);
        let t = text(&o);
        assert_failed_in_time(&o, secs, SLACK);
        let want = format!("rank 0 is starting {who} forward with 4 forwards and 3 backwards done");
        assert!(t.contains("ranks disagree on the training loop") && t.contains(&want), "{mode}:\n{t}");
        assert!(t.matches(": Error: ").count() >= 2, "every rank learns it:\n{t}");
    }
}

/// FSDP's `state_dict` (collective) called on rank 0 alone while rank 1 trains on: rank 1 finds it
/// within seconds from the ranks' published call contexts, and the headline names rank 0, the rank that
/// called it alone, not the timeout (600 s).
#[test]
fn a_state_dict_called_on_one_rank_alone_ends_the_job_naming_that_rank() {
    let (o, secs) = drill_env(2, "fsdp", "statedict@0:3", &[], &[DEFAULT_TIMEOUT]);
    let t = text(&o);
    assert_failed_in_time(&o, secs, SLACK);
    assert!(t.contains("tchrun: culprit: rank 0 "), "{t}");
    assert!(t.contains("the odd one out: rank 0, which called FSDP state_dict alone"), "{t}");
}

#[test]
fn uneven_steps_never_blame_the_rank_that_finished_and_suggest_join() {
    for mode in ["ddp", "fsdp"] {
        let (o, secs) = drill_env(2, mode, "extra@1:5", &[], &[DEFAULT_TIMEOUT]);
        let t = text(&o);
        assert_failed_in_time(&o, secs, SLACK);
        assert!(t.contains("tchrun: culprit: rank 1 ") && !t.contains("culprit: rank 0"), "{mode}:\n{t}");
        assert!(t.contains("rank 0 exited normally (exit code 0)") && t.contains("ddp.join(..)"), "{mode}:\n{t}");
    }
}

#[test]
fn a_libtorch_error_heads_the_report_without_its_frames() {
    let (o, secs) = drill_env(2, "ddp", "torcherr@1:2", &[], &[DEFAULT_TIMEOUT, ("RUST_BACKTRACE", "1")]);
    let t = text(&o);
    assert_failed_in_time(&o, secs, SLACK);
    let head = t.lines().find(|l| l.starts_with("tchrun: culprit: ")).unwrap_or_default();
    assert!(head.starts_with("tchrun: culprit: rank 1 "), "{t}");
    assert!(head.contains("The size of tensor a (4) must match the size of tensor b (3)"), "{t}");
    assert!(!head.contains("frame #") && !head.contains("Exception raised from"), "{head}");
}

#[test]
fn pytorchs_own_analyzer_reads_the_dumps_and_names_the_same_culprit() {
    // rank 1 computes for 6 s, past the 3 s collective timeout: alive, so it dumps when asked
    let dir = std::env::temp_dir().join(format!("tdx-faults-fr-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().to_string();
    let env = [("TCH_DIST_TIMEOUT_SECS", "3"), ("TCH_DIST_TRACE_DIR", d.as_str())];
    let (o, secs) = drill_env(3, "ddp", "sleep@1:3", &[], &env);
    let t = text(&o);
    assert_failed_in_time(&o, secs, 3 + SLACK);
    assert!(t.contains("tchrun:   culprit: rank 1"), "{t}");
    let torch = dir.join(tch_dist::flight::TORCH_DIR);
    let py = Command::new(common::python())
        .args(["-m", "torch.distributed.flight_recorder.fr_trace"])
        .arg(&torch)
        .args(["-p", "fr_rank_"])
        .output()
        .unwrap();
    let report = text(&py);
    assert!(py.status.success(), "{report}");
    assert!(report.contains("Not all ranks joining collective") && report.contains("missing ranks: {1}"), "{report}");
    assert!(report.contains("collective: gloo:all_gather") && report.contains("DDP forward"), "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}
