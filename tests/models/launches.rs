//! scripts/bench-launches.sh, small (2 blocks, d 64): per training step and rank, the collectives and the
//! ATen operators of examples/gpt.rs under DDP, FSDP and HSDP in the strict NCCL mode are at most
//! PyTorch's twin's (scripts/launches_ref.py, run here), so that a change that adds launches per
//! parameter or per step fails without a GPU.
use std::process::Command;

use crate::common;

#[test]
fn launches_per_step_are_at_most_pytorch_s_in_every_layout() {
    let o = Command::new(common::python())
        .arg(common::repo_path("scripts/launches.py"))
        .arg("--tchrun")
        .arg(common::tchrun())
        .arg("--gpt")
        .arg(common::example("gpt"))
        .args(["--layers", "2", "--d", "64", "--heads", "2", "--context", "32", "--steps", "2"])
        .output()
        .expect("python runs");
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("launches ")).collect();
    assert!(o.status.success(), "a ratio above 1.0 or a failed run:\n{out}\n{}", common::show(&o));
    // each layout measured on both sides: a line per layout, with counts that are not zero
    for layout in ["ddp", "fsdp", "hsdp"] {
        let line = lines.iter().find(|l| l.starts_with(&format!("launches {layout}:"))).unwrap_or_else(|| {
            panic!("no line for {layout}:\n{out}");
        });
        let numbers: Vec<f64> =
            line.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter_map(|w| w.parse().ok()).collect();
        // R1, a, b, R2, c, d
        assert_eq!(numbers.len(), 6, "{line}");
        assert!(numbers.iter().all(|&n| n > 0.0), "{line}");
        assert!(numbers[0] <= 1.0 && numbers[3] <= 1.0, "{line}");
    }
}
