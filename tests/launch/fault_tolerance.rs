//! Fault-tolerant replicas (tch_dist::ft): a `tchrun lighthouse` and three replicas, each its own
//! `tchrun`, training DDP + AdamW in float64 (`examples/ft_ddp.rs`). A replica is SIGKILLed in the middle
//! of backward; the others go on in the same processes, and a restarted one is healed over the network.
//! The final parameters must equal a one-process replay of the membership the replicas logged (which
//! replicas' batches made each step's gradient), and healed replicas must hold bit-identical state.
use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use tch::Tensor;
use tch_dist::checkpoint;

const STEPS: u64 = 30;

/// One job at a time: they time recoveries, and this machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tdx-ft-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Lighthouse {
    child: Child,
    addr: String,
}

impl Drop for Lighthouse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lighthouse(min_replicas: usize) -> Lighthouse {
    let addr = format!("127.0.0.1:{}", common::free_port());
    let child = Command::new(common::tchrun())
        .args(["lighthouse", "--bind", &addr, "--min-replicas", &min_replicas.to_string()])
        .args(["--heartbeat-timeout", "2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    // replicas retry until it listens; a moment spares them the retries
    std::thread::sleep(Duration::from_millis(300));
    Lighthouse { child, addr }
}

/// Replica `id` (one rank) under its own tchrun, restarted at most `restarts` times.
fn replica(lh: &Lighthouse, d: &Path, id: usize, restarts: usize, args: &[&str], env: &[(&str, &str)]) -> Child {
    replica_of(lh, d, id, 1, restarts, args, env)
}

/// Replica `id` of `ranks` ranks (DDP among them).
fn replica_of(
    lh: &Lighthouse,
    d: &Path,
    id: usize,
    ranks: usize,
    restarts: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let mut c = Command::new(common::tchrun());
    c.args(["--standalone", "--nproc-per-node", &ranks.to_string(), "--grace-secs", "1"])
        .args(["--max-restarts", &restarts.to_string(), "--replica-id", &id.to_string(), "--lighthouse", &lh.addr])
        .arg("--")
        .arg(common::example("ft_ddp"))
        .args(["--steps", &STEPS.to_string(), "--f64", "--hidden", "128", "--step-ms", "60", "--log"])
        .arg(d.join(format!("r{id}.log")))
        .arg("--out")
        .arg(d.join(format!("r{id}.safetensors")))
        .args(args)
        .env("TCH_DIST_FT_TIMEOUT_SECS", "20")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().unwrap()
}

/// Replica `id`'s events; while it runs, a last line still being written is left out.
fn events(d: &Path, id: usize) -> Vec<Value> {
    let text = std::fs::read_to_string(d.join(format!("r{id}.log"))).unwrap_or_default();
    let whole = text.rfind('\n').map_or("", |end| &text[..end]);
    whole.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
}

fn of<'a>(ev: &'a [Value], kind: &str) -> Vec<&'a Value> {
    ev.iter().filter(|e| e["event"] == kind).collect()
}

fn state(d: &Path, name: &str) -> BTreeMap<String, Tensor> {
    let (step, tensors) = checkpoint::read(&d.join(name)).unwrap();
    assert_eq!(step, STEPS, "{name} ended at step {step}");
    tensors.into_iter().collect()
}

/// The one-process replay of what the replicas' logs say happened.
fn reference(d: &Path, ids: &[usize]) -> BTreeMap<String, Tensor> {
    reference_of(d, ids, 1)
}

fn reference_of(d: &Path, ids: &[usize], ranks: usize) -> BTreeMap<String, Tensor> {
    let mut c = Command::new(common::example("ft_ddp"));
    c.args(["--steps", &STEPS.to_string(), "--f64", "--hidden", "128", "--ranks-per-replica", &ranks.to_string()]);
    c.arg("--reference");
    for id in ids {
        c.arg(d.join(format!("r{id}.log")));
    }
    c.arg("--out").arg(d.join("reference.safetensors"));
    let o = c.output().unwrap();
    assert!(o.status.success(), "reference: {}", common::show(&o));
    state(d, "reference.safetensors")
}

fn assert_identical(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, what: &str) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}");
    for (k, t) in a {
        assert!(t.equal(&b[k]), "{what}: {k} differs");
    }
}

fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    diff_of(a, b, &["model/", "optim/"])
}

/// The largest difference between the entries of `a` and `b` under `prefixes`, which both must hold.
fn diff_of(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, prefixes: &[&str]) -> f64 {
    let under = |m: &BTreeMap<String, Tensor>| -> Vec<String> {
        m.keys().filter(|k| prefixes.iter().any(|p| k.starts_with(p))).cloned().collect()
    };
    let keys = under(a);
    assert!(!keys.is_empty(), "nothing under {prefixes:?}");
    assert_eq!(keys, under(b), "entries under {prefixes:?}");
    keys.iter()
        .map(|k| (a[k].to_kind(tch::Kind::Double) - b[k].to_kind(tch::Kind::Double)).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

fn ok(outs: &[Output]) {
    for o in outs {
        assert!(o.status.success(), "{}", common::show(o));
    }
}

/// Each step from a process's first commit on is committed once, in order, up to the last.
fn no_step_lost(ev: &[Value], id: usize) {
    for pid in pids(ev) {
        let steps: Vec<u64> =
            of(ev, "commit").iter().filter(|e| e["pid"] == pid).map(|e| e["step"].as_u64().unwrap()).collect();
        let want: Vec<u64> = (steps[0]..steps[0] + steps.len() as u64).collect();
        assert_eq!(steps, want, "replica {id} (pid {pid}) committed steps out of order or twice");
    }
}

/// The processes (local rank 0 of each start) that logged, in order.
fn pids(ev: &[Value]) -> Vec<Value> {
    of(ev, "start").iter().map(|e| e["pid"].clone()).collect()
}

/// Seconds from the kill to the first step a survivor committed after it.
fn recovery(ev: &[Value], killed_at: f64) -> f64 {
    of(ev, "commit").iter().map(|e| e["t"].as_f64().unwrap()).find(|&t| t > killed_at).unwrap() - killed_at
}

fn killed_at(ev: &[Value]) -> f64 {
    let k = of(ev, "kill");
    assert_eq!(k.len(), 1, "one kill: {ev:?}");
    k[0]["t"].as_f64().unwrap()
}

#[test]
fn survivors_of_a_killed_replica_go_on_in_the_same_processes_and_lose_no_step() {
    let _one = serial();
    let d = tmp("kill");
    let lh = lighthouse(2);
    let r: Vec<Child> = (0..3)
        .map(|id| {
            let kill: &[&str] = if id == 2 { &["--kill-at-step", "8"] } else { &[] };
            replica(&lh, &d, id, 0, kill, &[])
        })
        .collect();
    let mut outs = common::wait_all(r, Duration::from_secs(180));
    let killed = outs.pop().unwrap();
    assert!(!killed.status.success(), "replica 2 was killed: {}", common::show(&killed));
    ok(&outs);
    let t_kill = killed_at(&events(&d, 2));
    for id in 0..2 {
        let ev = events(&d, id);
        assert_eq!(pids(&ev).len(), 1, "replica {id} ran in one process: {ev:?}");
        assert!(ev.iter().all(|e| e["restart"] == "0"), "replica {id} was never restarted");
        no_step_lost(&ev, id);
        let discarded: Vec<&Value> = of(&ev, "discard");
        assert!(discarded.len() <= 1, "replica {id} redid {} steps: {discarded:?}", discarded.len());
        let after = recovery(&ev, t_kill);
        eprintln!(
            "replica {id}: next step committed {after:.3} s after the kill; {} step(s) run again",
            discarded.len()
        );
        assert!(after < 10.0, "replica {id} took {after:.1} s to commit a step after the kill");
        // the steps after the kill are the two survivors' alone
        let later: Vec<&Value> = of(&ev, "commit").into_iter().filter(|e| e["t"].as_f64().unwrap() > t_kill).collect();
        assert!(later.iter().all(|e| e["members"] == serde_json::json!(["0", "1"])), "{later:?}");
    }
    let (a, b) = (state(&d, "r0.safetensors"), state(&d, "r1.safetensors"));
    assert_identical(&a, &b, "the survivors");
    let diff = max_diff(&a, &reference(&d, &[0, 1, 2]));
    eprintln!("final state vs the replay of the logged membership: {diff:e}");
    assert!(diff < 1e-6, "{diff:e}");

    // the same kill in one DDP job of three ranks: tchrun restarts them all from the last checkpoint
    let ft = recovery(&events(&d, 0), t_kill);
    let job = Command::new(common::tchrun())
        .args(["--standalone", "--nproc-per-node", "3", "--max-restarts", "1", "--grace-secs", "1", "--"])
        .arg(common::example("ft_ddp"))
        .args(["--steps", &STEPS.to_string(), "--f64", "--hidden", "128", "--step-ms", "60", "--kill-at-step", "8"])
        .args(["--every", "5", "--restart-from"])
        .arg(d.join("baseline.ckpt"))
        .arg("--log")
        .arg(d.join("baseline.log"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(job.status.success(), "{}", common::show(&job));
    let text = std::fs::read_to_string(d.join("baseline.log")).unwrap();
    let ev: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let t_kill = killed_at(&ev);
    let commits = of(&ev, "commit");
    let before = commits.iter().filter(|e| e["t"].as_f64().unwrap() < t_kill).count();
    let after: Vec<&&Value> = commits.iter().filter(|e| e["t"].as_f64().unwrap() > t_kill).collect();
    let redone = after.iter().filter(|e| e["step"].as_u64().unwrap() < before as u64).count();
    let next = after[0]["t"].as_f64().unwrap() - t_kill;
    let regained =
        after.iter().find(|e| e["step"].as_u64() == Some(before as u64)).unwrap()["t"].as_f64().unwrap() - t_kill;
    eprintln!(
        "elastic restart: next step {next:.2} s after the kill, {redone} committed step(s) run again, back at \
         step {before} after {regained:.2} s; fault tolerance: next step after {ft:.2} s, no committed step run \
         again (both run the interrupted step again)"
    );
    assert_eq!(redone, 3, "the restart resumes from the checkpoint of step 5 and runs steps 5-7 again");
    let _ = std::fs::remove_dir_all(&d);
}

/// All three end with bit-identical parameters and optimizer state, equal to the replay.
fn all_healed(d: &Path) {
    let s: Vec<BTreeMap<String, Tensor>> = (0..3).map(|id| state(d, &format!("r{id}.safetensors"))).collect();
    assert_identical(&s[0], &s[1], "replicas 0 and 1");
    assert_identical(&s[0], &s[2], "replicas 0 and 2");
    let diff = max_diff(&s[0], &reference(d, &[0, 1, 2]));
    eprintln!("final state vs the replay of the logged membership: {diff:e}");
    assert!(diff < 1e-6, "{diff:e}");
}

/// The restarted process of replica `id` took a healthy replica's state (at the start of a step, which
/// may then have been discarded and run again).
fn healed(ev: &[Value], id: usize) -> String {
    let second = pids(ev)[1].clone();
    let h = of(ev, "healed")
        .into_iter()
        .find(|e| e["pid"] == second)
        .unwrap_or_else(|| panic!("replica {id} was not healed: {ev:?}"));
    assert_eq!(h["restart"], "1");
    let from = h["from"].as_str().unwrap();
    assert_ne!(from, id.to_string());
    if let Some(k) = of(ev, "kill").first() {
        let t = |e: &Value| e["t"].as_f64().unwrap() - k["t"].as_f64().unwrap();
        let start = of(ev, "start").into_iter().find(|e| e["pid"] == second).unwrap();
        eprintln!(
            "replica {id}: killed at step {}, restarted {:.2} s later, healed by replica {from} at step {}, {:.2} s \
             after the kill",
            k["step"],
            t(start),
            h["step"],
            t(h)
        );
    }
    from.to_string()
}

#[test]
fn a_restarted_replica_is_healed_by_a_healthy_one_and_ends_identical() {
    let _one = serial();
    let d = tmp("heal");
    let lh = lighthouse(2);
    let r: Vec<Child> = (0..3)
        .map(|id| {
            let kill: &[&str] = if id == 2 { &["--kill-at-step", "6"] } else { &[] };
            replica(&lh, &d, id, 1, kill, &[])
        })
        .collect();
    ok(&common::wait_all(r, Duration::from_secs(180)));
    let ev = events(&d, 2);
    assert_eq!(pids(&ev).len(), 2, "replica 2 ran twice: {ev:?}");
    let from = healed(&ev, 2);
    eprintln!("replica 2 restarted and was healed by replica {from}");
    for id in 0..2 {
        assert_eq!(pids(&events(&d, id)).len(), 1, "replica {id} was never restarted");
    }
    all_healed(&d);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn two_failures_in_a_row_are_survived_and_healed() {
    let _one = serial();
    let d = tmp("twice");
    let lh = lighthouse(1);
    let r: Vec<Child> = (0..3)
        .map(|id| {
            let kill: &[&str] = match id {
                1 => &["--kill-at-step", "5"],
                2 => &["--kill-at-step", "6"],
                _ => &[],
            };
            replica(&lh, &d, id, 1, kill, &[])
        })
        .collect();
    ok(&common::wait_all(r, Duration::from_secs(180)));
    for id in 1..3 {
        let ev = events(&d, id);
        assert_eq!(of(&ev, "kill").len(), 1, "replica {id} was killed once");
        healed(&ev, id);
    }
    assert_eq!(pids(&events(&d, 0)).len(), 1, "replica 0 was never restarted");
    all_healed(&d);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_replica_lost_while_it_sends_its_state_is_survived_too() {
    let _ = std::fs::remove_dir_all(sender_lost("kill-while-sending"));
}

/// The sender dies after the quorum formed, before the two ranks' group did: the receiver learns it from
/// the sender's heartbeat in their replicate group (3 s here), not at the group's timeout (20 s), and the
/// others, whose next quorum waits for the receiver, go on as soon.
#[test]
fn a_sender_lost_before_its_transfer_began_is_found_by_its_heartbeat() {
    let d = sender_lost("kill-before-sending");
    let ev0 = events(&d, 0);
    let first = pids(&ev0)[0].clone();
    let died = ev0.iter().filter(|e| e["pid"] == first).map(|e| e["t"].as_f64().unwrap()).fold(0.0, f64::max);
    for id in 1..3 {
        let next = of(&events(&d, id), "commit").iter().map(|e| e["t"].as_f64().unwrap()).find(|&t| t > died);
        let after = next.unwrap() - died;
        eprintln!("replica {id}: next step committed {after:.2} s after the sender's last event");
        assert!(after < 12.0, "replica {id} went on {after:.2} s later: the receiver waited for the group timeout");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Replica 2 dies and comes back; replica 0, the first to heal a replica behind after step 0 (the
/// restarted one, or one that joined late), dies at `fault` and comes back too. Returns the run's folder.
fn sender_lost(fault: &str) -> PathBuf {
    let _one = serial();
    let d = tmp(fault);
    let lh = lighthouse(1);
    let env = [("TCH_DIST_FT_PEER_HEARTBEAT_SECS", "3")];
    let faulty = [("TCH_DIST_FT_FAULT", fault), env[0]];
    let r: Vec<Child> = (0..3)
        .map(|id| match id {
            0 => replica(&lh, &d, id, 1, &[], &faulty),
            2 => replica(&lh, &d, id, 1, &["--kill-at-step", "6"], &env),
            _ => replica(&lh, &d, id, 1, &[], &env),
        })
        .collect();
    let outs = common::wait_all(r, Duration::from_secs(180));
    ok(&outs);
    assert!(
        String::from_utf8_lossy(&outs[0].stderr).contains("fault injected"),
        "replica 0 was not killed at {fault}: {}",
        common::show(&outs[0])
    );
    assert_eq!(pids(&events(&d, 0)).len(), 2, "replica 0 ran twice");
    all_healed(&d);
    d
}

/// Nodes on shaped links (`scripts/shaped-links.sh`), removed when dropped.
struct Links {
    name: String,
}

impl Links {
    /// `None` (the test says it is skipped) where this machine cannot make them.
    fn up(nodes: usize, rate: &str) -> Option<Links> {
        let script = common::repo_path("scripts/shaped-links.sh");
        if !Command::new(&script).arg("check").status().is_ok_and(|s| s.success()) {
            eprintln!("skipped: no network namespaces with tc tbf here (root, ip and tc are needed)");
            return None;
        }
        let name = format!("tdxft{}", std::process::id());
        let st = Command::new(&script).args(["up", &name, &nodes.to_string(), rate]).status().unwrap();
        assert!(st.success(), "shaped-links.sh up failed");
        Some(Links { name })
    }
    /// `cmd` run on node `k` (1-based).
    fn on(&self, k: usize, cmd: &mut Command) -> Command {
        let mut c = Command::new(common::repo_path("scripts/shaped-links.sh"));
        c.args(["exec", &self.name, &k.to_string()]).arg(cmd.get_program()).args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            if let Some(v) = v {
                c.env(k, v);
            }
        }
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }
    fn links(&self, k: usize, how: &str) {
        let st =
            Command::new(common::repo_path("scripts/shaped-links.sh")).args([how, &self.name, &k.to_string()]).status();
        assert!(st.unwrap().success(), "shaped-links.sh {how} {k}");
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        let _ = Command::new(common::repo_path("scripts/shaped-links.sh")).args(["down", &self.name]).status();
    }
}

/// Waits until replica `id` has committed `step`.
fn until_step(d: &Path, id: usize, step: u64) {
    let start = std::time::Instant::now();
    while !of(&events(d, id), "commit").iter().any(|e| e["step"].as_u64() >= Some(step)) {
        assert!(start.elapsed() < Duration::from_secs(60), "replica {id} did not reach step {step}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_replica_cut_off_by_the_network_stops_and_the_others_go_on_without_a_second_quorum() {
    let _one = serial();
    let Some(net) = Links::up(3, "1gbit") else { return };
    let d = tmp("partition");
    // the lighthouse on node 1, replica k on node k + 1
    let mut lh = net.on(
        1,
        Command::new(common::tchrun()).args(["lighthouse", "--bind", "127.0.1.1:29510", "--heartbeat-timeout", "2"]),
    );
    let mut lh = lh.stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let r: Vec<Child> = (0..3)
        .map(|id| {
            let node = id + 1;
            let mut c = Command::new(common::tchrun());
            c.args(["--standalone", "--nproc-per-node", "1", "--grace-secs", "1"])
                .args(["--local-addr", &format!("127.0.{node}.1"), "--replica-id", &id.to_string()])
                .args(["--lighthouse", "127.0.1.1:29510", "--"])
                .arg(common::example("ft_ddp"))
                .args(["--steps", &STEPS.to_string(), "--f64", "--hidden", "128", "--step-ms", "60", "--log"])
                .arg(d.join(format!("r{id}.log")))
                .arg("--out")
                .arg(d.join(format!("r{id}.safetensors")))
                .env("TCH_DIST_FT_TIMEOUT_SECS", "10")
                .env("TCH_DIST_FT_QUORUM_TIMEOUT_SECS", "8")
                .env("TCH_DIST_FT_PEER_HEARTBEAT_SECS", "3");
            net.on(node, &mut c).spawn().unwrap()
        })
        .collect();
    until_step(&d, 2, 8);
    net.links(3, "cut");
    let cut_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let mut outs = common::wait_all(r, Duration::from_secs(180));
    let _ = lh.kill();
    let _ = lh.wait();
    let cut = outs.pop().unwrap();
    ok(&outs);
    let text = common::show(&cut);
    assert!(!cut.status.success() && text.contains("cut off"), "the cut replica fails cleanly: {text}");
    eprintln!("the cut replica: {text}");
    // no split brain: the cut replica commits nothing after the cut, and a step it and the others both
    // committed had the same members
    let (r0, r2) = (events(&d, 0), events(&d, 2));
    for c in of(&r2, "commit") {
        assert!(c["t"].as_f64().unwrap() < cut_at, "replica 2 committed after the cut: {c}");
        for e in of(&r0, "commit").iter().filter(|e| e["step"] == c["step"]) {
            assert_eq!(e["members"], c["members"], "step {} committed by two quorums", c["step"]);
        }
    }
    for id in 0..2 {
        let ev = events(&d, id);
        no_step_lost(&ev, id);
        let after = recovery(&ev, cut_at);
        let failed = of(&ev, "discard").iter().map(|e| e["t"].as_f64().unwrap() - cut_at).find(|&t| t > 0.0);
        eprintln!("replica {id}: its step failed {failed:.2?} s after the cut, the next committed {after:.2} s after");
    }
    let (a, b) = (state(&d, "r0.safetensors"), state(&d, "r1.safetensors"));
    assert_identical(&a, &b, "the replicas on the connected side");
    let diff = max_diff(&a, &reference(&d, &[0, 1, 2]));
    assert!(diff < 1e-6, "{diff:e}");
    drop(net);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn replicas_of_two_ranks_each_survive_a_loss_and_heal() {
    let _one = serial();
    let d = tmp("two-ranks");
    let lh = lighthouse(2);
    let r: Vec<Child> = (0..3)
        .map(|id| {
            let kill: &[&str] = if id == 2 { &["--kill-at-step", "6"] } else { &[] };
            replica_of(&lh, &d, id, 2, 1, kill, &[])
        })
        .collect();
    ok(&common::wait_all(r, Duration::from_secs(180)));
    let from = healed(&events(&d, 2), 2);
    eprintln!("replica 2 (2 ranks) restarted and was healed by replica {from}");
    let first = state(&d, "r0.safetensors");
    for id in 0..3 {
        for name in [format!("r{id}.safetensors"), format!("r{id}.safetensors.rank1")] {
            assert_identical(&first, &state(&d, &name), &name);
        }
    }
    let diff = max_diff(&first, &reference_of(&d, &[0, 1, 2], 2));
    eprintln!("final state vs the replay of the logged membership: {diff:e}");
    assert!(diff < 1e-6, "{diff:e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// HSDP replicas of two ranks ended alike: each local rank's shards and optimizer state bit-identical
/// across the three, and the gathered parameters equal to the replay.
fn hsdp_healed(d: &Path) {
    for local in ["", ".rank1"] {
        let first = state(d, &format!("r0.safetensors{local}"));
        assert!(first.keys().any(|k| k.starts_with("shard/")), "the shards were saved");
        for id in 1..3 {
            let name = format!("r{id}.safetensors{local}");
            assert_identical(&first, &state(d, &name), &name);
        }
    }
    let (rank0, rank1) = (state(d, "r0.safetensors"), state(d, "r0.safetensors.rank1"));
    assert_eq!(diff_of(&rank0, &rank1, &["model/"]), 0.0, "the gathered parameters are the same on both ranks");
    let diff = diff_of(&rank0, &reference_of(d, &[0, 1, 2], 2), &["model/"]);
    eprintln!("final parameters vs the replay of the logged membership: {diff:e}");
    assert!(diff < 1e-6, "{diff:e}");
}

/// HSDP: each replica shards the model with FSDP over its two ranks, and the manager sums each
/// reduce-scattered chunk across the replicas. A replica killed between two units' sums is restarted and
/// healed rank by rank (local rank L from a healthy replica's local rank L, shards and optimizer state).
#[test]
fn hsdp_replicas_survive_a_loss_and_heal_shard_by_shard() {
    let _one = serial();
    let d = tmp("hsdp");
    let lh = lighthouse(2);
    let r: Vec<Child> = (0..3)
        .map(|id| {
            let args: &[&str] = if id == 2 { &["--fsdp", "--kill-at-step", "6"] } else { &["--fsdp"] };
            replica_of(&lh, &d, id, 2, 1, args, &[])
        })
        .collect();
    ok(&common::wait_all(r, Duration::from_secs(180)));
    let ev = events(&d, 2);
    let t_kill = killed_at(&ev);
    let from = healed(&ev, 2);
    for id in 0..2 {
        let ev = events(&d, id);
        assert_eq!(pids(&ev).len(), 1, "replica {id} was never restarted");
        no_step_lost(&ev, id);
        eprintln!("replica {id}: next step committed {:.3} s after the kill", recovery(&ev, t_kill));
    }
    eprintln!("replica 2 (FSDP over 2 ranks) restarted and was healed by replica {from}");
    hsdp_healed(&d);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn when_every_replica_is_lost_they_resume_from_the_last_checkpoint() {
    let d = every_replica_lost(1, &[]);
    all_healed(&d);
    let _ = std::fs::remove_dir_all(&d);
}

/// The same with HSDP replicas: the quorum's first replica saves sharded checkpoints (its two ranks
/// together), and every replica's ranks load their shards from the newest.
#[test]
fn hsdp_replicas_all_lost_resume_from_their_sharded_checkpoint() {
    let d = every_replica_lost(2, &["--fsdp"]);
    hsdp_healed(&d);
    let _ = std::fs::remove_dir_all(&d);
}

/// Three replicas of `ranks` ranks, in lockstep, all die in the backward of step 12; the quorum's first
/// saved at step 10. Returns the run's folder.
fn every_replica_lost(ranks: usize, extra: &[&str]) -> PathBuf {
    let _one = serial();
    let d = tmp(&format!("all-lost-{ranks}"));
    let lh = lighthouse(1);
    let ckpt = d.join("ckpt");
    let mut args = vec!["--kill-at-step", "12", "--ckpt", ckpt.to_str().unwrap(), "--every", "5"];
    args.extend_from_slice(extra);
    let r: Vec<Child> = (0..3).map(|id| replica_of(&lh, &d, id, ranks, 1, &args, &[])).collect();
    ok(&common::wait_all(r, Duration::from_secs(180)));
    let all: Vec<Value> = (0..3).flat_map(|id| events(&d, id)).collect();
    let t = |e: &Value| e["t"].as_f64().unwrap();
    let mut from = Vec::new();
    for id in 0..3 {
        let ev = events(&d, id);
        assert_eq!(of(&ev, "kill").len(), 1, "replica {id} was killed once");
        let restarted = pids(&ev)[1].clone();
        let resumed: Vec<&Value> = of(&ev, "resumed").into_iter().filter(|e| e["pid"] == restarted).collect();
        assert_eq!(resumed.len(), 1, "replica {id} resumed from the checkpoint: {ev:?}");
        // the newest saved before it looked for one (a replica restarted first may train alone and save
        // again, and a save logged while it was loading committed after it looked)
        // (logged just after its commit: one logged before it looked was there to be seen, one logged
        // before it resumed may have been)
        let newest_before =
            |at: f64| of(&all, "saved").into_iter().filter(|s| t(s) < at).filter_map(|s| s["step"].as_u64()).max();
        let (looked, step) = (resumed[0]["looked"].as_f64().unwrap(), resumed[0]["step"].as_u64());
        let (seen, maybe) = (newest_before(looked), newest_before(t(resumed[0])));
        let saved = of(&all, "saved").iter().any(|s| s["step"].as_u64() == step);
        assert!(
            saved && seen.is_some() && step >= seen && step <= maybe,
            "replica {id} resumed from {step:?}, not the newest saved: {seen:?} (or up to {maybe:?})"
        );
        from.push(resumed[0]["step"].as_u64().unwrap());
    }
    assert_eq!(from.iter().min(), Some(&10), "the first back resumed from the last saved before the kill: {from:?}");
    d
}
