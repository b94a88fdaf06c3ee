//! Initialisation from torchrun's environment: bad or missing variables give an error naming the variable,
//! at once.
use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
#[ignore = "process spawned by bad_environment_names_the_variable"]
fn worker_init_from_env() {
    match tch_dist::ProcessGroup::from_env() {
        Ok(pg) => println!("joined as rank {}", pg.rank()),
        Err(e) => {
            println!("error: {e}");
            std::process::exit(2);
        }
    }
}

fn run(env: &[(&str, &str)]) -> String {
    // (the worker prints one line beginning "error:")
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--ignored", "--exact", common::test_name!("worker_init_from_env").as_str(), "--nocapture"]);
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        c.env_remove(v);
    }
    c.envs(env.iter().copied());
    let start = Instant::now();
    let o = c.output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(2), "{}", common::show(&o));
    String::from_utf8_lossy(&o.stdout).lines().find(|l| l.starts_with("error:")).unwrap_or_default().to_string()
}

#[test]
fn bad_environment_names_the_variable() {
    let ok = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    fn with(
        ok: &[(&'static str, &'static str)],
        k: &'static str,
        v: Option<&'static str>,
    ) -> Vec<(&'static str, String)> {
        ok.iter()
            .filter(|(n, _)| *n != k)
            .map(|(n, x)| (*n, x.to_string()))
            .chain(v.map(|v| (k, v.to_string())))
            .collect()
    }
    let with = |k, v| with(&ok, k, v);
    let cases: Vec<(Vec<(&str, String)>, &str)> = vec![
        (with("RANK", Some("2")), "RANK=2 is not below WORLD_SIZE=2"),
        (with("RANK", Some("one")), "environment variable RANK"),
        (with("WORLD_SIZE", Some("0")), "environment variable WORLD_SIZE"),
        (with("MASTER_ADDR", None), "environment variable MASTER_ADDR: is not set"),
        (with("MASTER_PORT", Some("99999")), "environment variable MASTER_PORT"),
        // the library's own settings: a value none of its parsers reads is named, never silently the default
        (with("TCH_DIST_VERIFY", Some("sometimes")), "environment variable TCH_DIST_VERIFY: \"sometimes\""),
        (with("TCH_DIST_STRICT_NCCL", Some("maybe")), "environment variable TCH_DIST_STRICT_NCCL: \"maybe\""),
        (with("TCH_DIST_COLLECTIVES", Some("tree")), "environment variable TCH_DIST_COLLECTIVES: \"tree\""),
        (with("TCH_DIST_HEARTBEAT_TIMEOUT_SECS", Some("soon")), "environment variable TCH_DIST_HEARTBEAT_TIMEOUT_SECS"),
        (with("TCH_DIST_TIMEOUT_SECS", Some("-1")), "environment variable TCH_DIST_TIMEOUT_SECS"),
    ];
    for (env, want) in cases {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let e = run(&env);
        assert!(e.contains(want), "{env:?}: {e}");
    }
}

#[test]
fn a_port_already_in_use_names_the_address() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let e = run(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)]);
    assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(e.to_lowercase().contains("in use"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
}

#[test]
fn an_unreachable_master_names_the_address_in_bounded_time() {
    let port = common::free_port().to_string(); // nobody listens there
    let start = Instant::now();
    let e = run(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
        ("TCH_DIST_TIMEOUT_SECS", "3"),
    ]);
    assert!(start.elapsed() < Duration::from_secs(20));
    assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
}

/// Fewer processes than WORLD_SIZE (3 given by hand to 2): both say within seconds who has arrived and
/// who is missing, and keep waiting until the timeout, which then names the missing rank.
#[test]
fn a_world_larger_than_the_processes_started_says_who_is_missing_within_seconds() {
    let port = common::free_port().to_string();
    let spawn = |rank: &str| {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args(["--ignored", "--exact", common::test_name!("worker_init_from_env").as_str(), "--nocapture"]);
        for v in ["LOCAL_RANK", "TCH_DIST_VERIFY"] {
            c.env_remove(v);
        }
        c.envs([
            ("RANK", rank),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("TCH_DIST_TIMEOUT_SECS", "9"),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let start = Instant::now();
    let children = vec![spawn("0"), spawn("1")];
    let outs = common::wait_all(children, Duration::from_secs(60));
    assert!(start.elapsed() < Duration::from_secs(40), "took {:?}", start.elapsed());
    let err0 = String::from_utf8_lossy(&outs[0].stderr).to_string();
    let err1 = String::from_utf8_lossy(&outs[1].stderr).to_string();
    assert!(
        err0.contains("tch-dist: rank 0: 2 of 3 ranks have arrived") && err0.contains("waiting for rank 2"),
        "{}",
        common::show(&outs[0])
    );
    assert!(err1.contains("tch-dist: rank 1: waiting for the other ranks"), "{}", common::show(&outs[1]));
    let out0 = String::from_utf8_lossy(&outs[0].stdout).to_string();
    assert!(
        out0.contains("error:") && out0.contains("rank 2 of WORLD_SIZE=3 did not arrive"),
        "{}",
        common::show(&outs[0])
    );
}
