//! Safe wrappers of the shim's seeded draws and of the default generators' saved states
//! (tch-dist-sys/csrc/random.cpp).
use std::time::Duration;

use tch::Tensor;

use super::adopt;
use super::check;
use crate::error::{Error, Result};

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))`, as a tensor.
pub(crate) fn randperm(n: i64, seed: u64) -> Result<Tensor> {
    let mut out: super::tdx_tensor = std::ptr::null_mut();
    // SAFETY: `out` is valid for the call.
    let code = unsafe { super::tdx_randperm(n, seed, &mut out) };
    check(code, Duration::ZERO, || format!("randperm({n}) with seed {seed}"))?;
    // SAFETY: `out` is null or the tensor the shim just made for this call.
    unsafe { adopt(out, "randperm") }
}

/// `torch.manual_seed(seed)` and then a normal draw of each shape in turn, in the dtype with the shim's
/// code `dtype`.
pub(crate) fn draw_seq(seed: u64, dtype: i32, shapes: &[Vec<i64>]) -> Result<Vec<Tensor>> {
    let ndims: Vec<i64> = shapes.iter().map(|s| s.len() as i64).collect();
    let sizes: Vec<i64> = shapes.iter().flatten().copied().collect();
    let mut outs: Vec<super::tdx_tensor> = vec![std::ptr::null_mut(); shapes.len()];
    // SAFETY: the arrays are valid for the call (no bounds: normal draws), `ndims` and `outs` have one
    // entry per shape and `sizes` holds all their dimensions.
    let code = unsafe {
        super::tdx_draw_seq(
            seed,
            dtype,
            shapes.len(),
            ndims.as_ptr(),
            sizes.as_ptr(),
            std::ptr::null(),
            outs.as_mut_ptr(),
        )
    };
    // on failure the shim created none, or some: take ownership of those either way
    // SAFETY: each non-null slot is a tensor the shim just made for this call, adopted once.
    let made: Vec<Result<Tensor>> =
        outs.into_iter().filter(|p| !p.is_null()).map(|p| unsafe { adopt(p, "random draw") }).collect();
    check(code, Duration::ZERO, || format!("random draws with seed {seed}"))?;
    made.into_iter().collect()
}

/// The default generators' states (the CPU's and every CUDA device's), put back and freed when dropped.
pub(crate) struct SavedRng(std::ptr::NonNull<super::tdx_rng_saved>);

impl SavedRng {
    pub(crate) fn save() -> Result<SavedRng> {
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is valid for the call; on success it owns the saved states until `Drop`.
        check(unsafe { super::tdx_rng_save(&mut p) }, Duration::ZERO, || "save the generators".into())?;
        std::ptr::NonNull::new(p).map(SavedRng).ok_or_else(|| Error::invalid("save the generators", "no state"))
    }
}

impl Drop for SavedRng {
    fn drop(&mut self) {
        // SAFETY: the states the shim saved for this value, restored and freed once.
        unsafe { super::tdx_rng_restore(self.0.as_ptr()) }
    }
}
