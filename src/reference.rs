//! libtorch's own implementations, reached through the shim, for tests that compare ours against them,
//! and switches that make the CPU take the paths a GPU takes.
pub use crate::ffi::reference::{count_ops, gloo_layout_check, libtorch_bucket_assignment};

/// Runs `f` with ring attention's blocks written out in matrix products on this thread (the path
/// taken where no fused kernel is wired, as on CUDA), so that the CPU checks that path too.
pub fn with_written_out_attention<R>(f: impl FnOnce() -> R) -> R {
    crate::context_parallel::ring::WRITTEN_OUT.with(|w| {
        let before = w.replace(true);
        let r = f();
        w.set(before);
        r
    })
}
