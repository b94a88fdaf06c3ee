//! The training example on real data (scikit-learn's digits): 2 DDP ranks reach the accuracy of a single
//! process with the same global batch.
use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

fn run(world: usize) -> (f64, String) {
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("examples/train_ddp");
    let port = common::free_port();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&bin)
                .args(["--epochs", "8"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs = common::wait_all(children, Duration::from_secs(300));
    for o in &outs {
        assert!(o.status.success(), "{}", common::show(o));
    }
    let text = String::from_utf8_lossy(&outs[0].stdout).to_string();
    let line = text.lines().find(|l| l.starts_with("final test accuracy")).unwrap_or_else(|| panic!("{text}"));
    let acc: f64 = line.split_whitespace().nth(3).unwrap().trim_end_matches('%').parse().unwrap();
    (acc, text)
}

#[test]
fn two_ranks_reach_single_process_accuracy_on_digits() {
    let (single, _) = run(1);
    let (ddp, log) = run(2);
    assert!(log.contains("epoch  8"), "{log}");
    assert!(single > 90.0, "single process only reached {single}%");
    // Same global batch, averaged gradients: the runs agree up to float summation order.
    assert!((ddp - single).abs() <= 1.0, "DDP {ddp}% vs single {single}%");
}
