//! examples/cnn_ddp.rs, a small ResNet on scikit-learn's digits: 2 DDP ranks with SyncBatchNorm train as
//! one process with tch's BatchNorm on the same global batch (the first steps within float rounding, an
//! epoch within 1e-3), and the loss falls; with each rank's batch norm its own (`--local-bn`) the first
//! step already differs.
use crate::common;

#[test]
fn two_ranks_with_sync_batch_norm_train_as_one_process() {
    let dir = std::env::temp_dir().join(format!("tch-dist-cnn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |procs: usize, extra: &[&str], file: &str| {
        let mut args = vec!["--epochs", "1"];
        args.extend(extra);
        common::example_losses("cnn_ddp", procs, &args, &dir.join(file))
    };
    let one = run(1, &[], "one.txt");
    let sync = run(2, &[], "sync.txt");
    let local = run(2, &["--local-bn"], "local.txt");
    assert_eq!(one.len(), 23, "1,500 images in batches of 64, the last partial one dropped");
    assert_eq!((sync.len(), local.len()), (one.len(), one.len()));
    assert!(one[one.len() - 1] < one[0] - 0.3, "the loss must fall: {} -> {}", one[0], one[one.len() - 1]);
    for (s, (a, b)) in one.iter().zip(&sync).enumerate() {
        // rounding grows step by step through momentum (about 1e-6 at step 10, 1e-4 at step 20)
        let tol = if s < 10 { 1e-5 } else { 1e-3 };
        assert!((a - b).abs() <= tol, "step {s}: one process {a}, 2 ranks with SyncBatchNorm {b}");
    }
    assert!((one[0] - local[0]).abs() > 1e-4, "step 0: local batch norm {} vs the whole batch's {}", local[0], one[0]);
    let _ = std::fs::remove_dir_all(&dir);
}
