//! examples/gpt.rs, small: 20 steps of a 2-layer GPT (d 32, 2 heads, context 16) on Python's
//! documentation text, in one process and on several meshes under tchrun (tp 2; DDP 2, FSDP 2, HSDP
//! 2 × 2; pp 2 × DDP 2, pp 2 × FSDP 2, pp 2 × DDP 2 × tp 2), one model source over a
//! `parallelize::Plan`, each stage's data parallelism run by the pipeline: the losses agree within 1e-4
//! at every step, and fall.
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

fn run(procs: usize, mesh: &[&str], losses: &std::path::Path) -> Vec<f64> {
    let o = Command::new(env!("CARGO_BIN_EXE_tchrun"))
        .args(["--standalone", "--nproc-per-node", &procs.to_string(), "--"])
        .arg(common::example("gpt"))
        .args(["--corpus", &corpus(), "--layers", "2", "--d", "32", "--heads", "2", "--context", "16"])
        .args(["--global-batch", "8", "--steps", "20", "--losses"])
        .arg(losses)
        .args(mesh)
        .output()
        .unwrap();
    assert!(o.status.success(), "{procs} processes: {}", common::show(&o));
    std::fs::read_to_string(losses)
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect()
}

#[test]
fn every_mesh_trains_like_one_process() {
    let dir = std::env::temp_dir().join(format!("tch-dist-gpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let one = run(1, &[], &dir.join("one.txt"));
    assert_eq!(one.len(), 20);
    assert!(one[19] < one[0] - 1.0, "the loss must fall: {} -> {}", one[0], one[19]);
    let meshes: [(usize, &[&str]); 7] = [
        (2, &["--tp", "2"]),
        (2, &["--dp", "2"]),
        (2, &["--fsdp", "2"]),
        (4, &["--hsdp", "2x2"]),
        (4, &["--pp", "2", "--dp", "2"]),
        (4, &["--pp", "2", "--fsdp", "2"]),
        (8, &["--pp", "2", "--dp", "2", "--tp", "2"]),
    ];
    for (procs, mesh) in meshes {
        let got = run(procs, mesh, &dir.join(format!("{}.txt", mesh.join(""))));
        assert_eq!(got.len(), 20, "{mesh:?}");
        for (s, (a, b)) in one.iter().zip(&got).enumerate() {
            assert!((a - b).abs() <= 1e-4, "step {s}: one process {a}, {mesh:?} {b}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
