//! Callbacks queued for the end of a backward are freed when that backward fails. It counts the live
//! callbacks of the whole process, so it runs alone.
use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use tch_dist::hooks;

/// A callback queued for the end of a backward that fails before its callbacks run (here: a tensor-parallel
/// allreduce inside backward that the other rank never joins, so it times out) is freed, not leaked.
#[test]
fn callbacks_of_a_failed_backward_are_freed() {
    let _one = common::alone();
    let before = hooks::live_backward_callbacks();
    let res = common::run_threads(2, Duration::from_secs(2), move |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(4)); // never joins rank 0's allreduce
            return (true, false, true);
        }
        let w = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (queued, ran) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (q, r) = (queued.clone(), ran.clone());
        let _h = hooks::on_grad_accumulated(&w, move || {
            let r = r.clone();
            hooks::queue_backward_callback(move || {
                r.store(true, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
            q.store(true, Ordering::SeqCst);
        })
        .unwrap();
        let y = tch_dist::tp::ops::copy_to_parallel_region(&x, &pg).unwrap();
        let failed = (y * &w).sum(Kind::Float).f_backward().is_err();
        (failed, queued.load(Ordering::SeqCst), !ran.load(Ordering::SeqCst))
    });
    assert_eq!(res[0], (true, true, true), "(backward failed, callback queued, callback not run)");
    let start = Instant::now();
    while hooks::live_backward_callbacks() > before && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(hooks::live_backward_callbacks(), before, "the callback of the failed backward leaked");
}
