//! examples/min_gpt.rs, tch-rs's min-gpt with constructors taking a `parallelize::Plan`, small (2
//! blocks, 32 features, 2 heads, 16 characters, no dropout): 15 steps with tch's own `nn::AdamW` and
//! `backward_step_clip` under DDP 2, FSDP 2, HSDP 2 × 2 and TP 2 give the one-process losses within
//! 1e-4, and the loss falls.
mod common;

use std::process::Command;

fn corpus() -> String {
    let o = Command::new(common::python())
        .args(["-c", "import pydoc_data.topics as t; print(t.__file__)"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::show(&o));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

fn run(procs: usize, layout: &[&str], losses: &std::path::Path) -> Vec<f64> {
    let o = Command::new(env!("CARGO_BIN_EXE_tchrun"))
        .args(["--standalone", "--nproc-per-node", &procs.to_string(), "--"])
        .arg(common::example("min_gpt"))
        .args(["--corpus", &corpus(), "--layers", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16"])
        .args(["--batch-size", "8", "--pdrop", "0", "--lr", "0.003", "--steps", "15", "--losses"])
        .arg(losses)
        .args(layout)
        .output()
        .unwrap();
    assert!(o.status.success(), "{layout:?}: {}", common::show(&o));
    std::fs::read_to_string(losses)
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect()
}

#[test]
fn every_layout_trains_like_one_process() {
    let dir = std::env::temp_dir().join(format!("tch-dist-min-gpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let one = run(1, &[], &dir.join("one.txt"));
    assert_eq!(one.len(), 15);
    assert!(one[14] < one[0] - 1.0, "the loss must fall: {} -> {}", one[0], one[14]);
    let layouts: [(usize, &[&str]); 4] =
        [(2, &["--dp", "2"]), (2, &["--fsdp", "2"]), (4, &["--hsdp", "2x2"]), (2, &["--tp", "2"])];
    for (procs, layout) in layouts {
        let got = run(procs, layout, &dir.join(format!("{}.txt", layout.join(""))));
        assert_eq!(got.len(), 15, "{layout:?}");
        for (s, (a, b)) in one.iter().zip(&got).enumerate() {
            assert!((a - b).abs() <= 1e-4, "step {s}: one process {a}, {layout:?} {b}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
