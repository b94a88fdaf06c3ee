//! The GPU kit's checks (examples/gpu_kit.rs), run with their "GPU" side on the CPU: each compares a
//! distributed computation with plain CPU training, so a broken comparison or a broken feature fails
//! here, where there is no GPU. Only the checks that need a real NCCL group may skip.
use crate::common;

use std::process::Command;

#[test]
fn every_kit_check_passes_with_the_cpu_standing_in_for_the_gpu() {
    let kit = common::example("gpu_kit");
    let list = Command::new(&kit).arg("list").output().unwrap();
    assert!(list.status.success(), "{}", common::show(&list));
    let names: Vec<String> = String::from_utf8_lossy(&list.stdout).lines().map(str::to_string).collect();
    assert!(names.len() >= 13, "{names:?}");
    let mut skipped = Vec::new();
    for name in &names {
        let o = Command::new(&kit).args(["check", name, "--device", "cpu"]).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        println!("{}", out.trim());
        assert!(
            o.status.success() && out.starts_with(&format!("PASS {name}: "))
                || out.starts_with(&format!("SKIP {name}: ")),
            "{}",
            common::show(&o)
        );
        if out.starts_with("SKIP") {
            skipped.push(name.as_str());
        }
    }
    assert_eq!(
        skipped,
        [
            "nccl-refuses-cpu-tensors",
            "group-cpu-gloo-cuda-nccl",
            "async-wait",
            "streams",
            "sync-free-steps",
            "nccl-lifecycle"
        ]
    );
    // without a GPU, asking for one is a skip that says so
    let o = Command::new(&kit).args(["check", "ddp-views-on"]).output().unwrap();
    if !tch::Cuda::is_available() {
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "SKIP ddp-views-on: no CUDA device");
    }
    // an unknown check is a failure, not a silent pass
    let o = Command::new(&kit).args(["check", "no-such-check", "--device", "cpu"]).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stdout).starts_with("FAIL no-such-check"));
}

#[test]
fn the_two_process_kit_checks_pass_on_the_cpu() {
    let kit = common::example("gpu_kit");
    let list = Command::new(&kit).arg("rank-list").output().unwrap();
    let names: Vec<String> = String::from_utf8_lossy(&list.stdout).lines().map(str::to_string).collect();
    let want =
        ["ddp-views-on", "ddp-views-off", "zero2", "fsdp-prefetch", "fsdp-offload", "fsdp-no-reshard", "pipeline-1f1b"];
    assert_eq!(names, [&want[..], &["sync-bn", "tp-attention-dropout"]].concat());
    for name in &names {
        let o = Command::new(common::tchrun())
            .args(["--standalone", "--nproc-per-node", "2", "--"])
            .arg(&kit)
            .args(["rank", name, "--device", "cpu"])
            .env("TCH_DIST_TIMEOUT_SECS", "60")
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", common::show(&o));
        for r in 0..2 {
            assert!(out.contains(&format!("[rank{r}]: PASS gloo-2proc-{name}: rank {r} of 2")), "{out}");
        }
    }
    // an unknown two-process check fails on every rank
    let o = Command::new(common::tchrun())
        .args(["--standalone", "--nproc-per-node", "2", "--"])
        .arg(&kit)
        .args(["rank", "no-such-check", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stdout).contains("FAIL gloo-2proc-no-such-check"));
}
