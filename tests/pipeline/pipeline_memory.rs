//! Activation recomputation, measured: the pipeline example's stage processes report their peak memory
//! (the memory module's counter, one process per stage), and recomputation lowers it on every stage.
use crate::common;

use std::process::Command;

fn peaks(recompute: bool) -> Vec<f64> {
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("examples/pipeline");
    let mut c = Command::new(&bin);
    c.args(["--schedule", "gpipe", "--microbatches", "8", "--steps", "2", "--batch", "512"]);
    if recompute {
        c.arg("--recompute");
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", common::show(&o));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    // "    stage 0: peak 115.41 MB (81.83 MB above its parameters), ..."
    let v: Vec<f64> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("stage ") && l.contains("above its parameters"))
        .map(|l| l.split('(').nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(v.len(), 2, "{text}");
    v
}

#[test]
fn recomputation_lowers_every_stages_peak() {
    let (full, lean) = (peaks(false), peaks(true));
    for s in 0..2 {
        // GPipe keeps 8 microbatches of 8 layers' outputs (64 rows x 1024 floats x 16 tensors each = 4 MB
        // per microbatch, 32 MB per stage); recomputation keeps only the inputs.
        assert!(lean[s] < full[s] - 10.0, "stage {s}: {} MB with recomputation vs {} MB without", lean[s], full[s]);
    }
}
