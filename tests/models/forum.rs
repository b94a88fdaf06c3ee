//! The forum example: memory at each point of the forum's program equals PyTorch DDP's on this machine,
//! measured in both processes with the same counting allocator, for bucket views off and on.
use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs 2 ranks of `cmd args`, returns (rank, stage) -> bytes.
fn run(cmd: &PathBuf, args: &[&str]) -> BTreeMap<(usize, String), i64> {
    let port = common::free_port();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(cmd)
                .args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("TCH_DIST_MEMORY_LIB", tch_dist::memory::ruler_library_path())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut rows = BTreeMap::new();
    for (r, o) in common::wait_all(children, Duration::from_secs(120)).iter().enumerate() {
        assert!(o.status.success(), "rank {r} of {}:\n{}", cmd.display(), common::show(o));
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            let parts: Vec<&str> = line.split_whitespace().collect();
            if parts.first() == Some(&"rank") {
                let bytes: i64 = parts[parts.len() - 1].parse().unwrap();
                rows.insert((parts[1].parse().unwrap(), parts[2..parts.len() - 1].join(" ")), bytes);
            }
        }
    }
    rows
}

#[test]
fn forum_repro_memory_equals_pytorch_ddp() {
    let rust = common::example("forum_repro");
    let python = PathBuf::from(common::python());
    let script = common::repo_path("scripts/forum_repro.py");
    for view in ["off", "on"] {
        let ours = run(&rust, &["--view", view]);
        let theirs = run(&python, &[script.to_str().unwrap(), "--view", view]);
        assert_eq!(ours.len(), 12, "{ours:?}");
        assert_eq!(ours, theirs, "view {view}: tch-dist vs PyTorch");
        // The forum's story, in numbers: DDP doubles the model; backward adds grads unless they are views.
        for r in 0..2 {
            let at = |s: &str| ours[&(r, s.to_string())];
            let model = at("model created");
            assert_eq!(at("wrapped in DDP"), 2 * model);
            assert_eq!(at("after one backward"), if view == "on" { 2 } else { 3 } * model);
            // tch's optimizer's zero_grad sets gradients to none: what stays is the model and its buckets
            assert_eq!(at("after step and zero_grad"), 2 * model);
        }
    }
}
