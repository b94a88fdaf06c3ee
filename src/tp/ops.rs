//! The conjugate operators (Megatron-LM's f and g, and the gather/scatter pair) as autograd ops. Their
//! backward runs the collective inside libtorch's autograd (csrc/tp.cpp), so they compose with any model.
use tch::Tensor;

use crate::error::{check, Error, Result};
use crate::ffi;
use crate::group::ProcessGroup;

fn op(code: i32, name: &str, x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let desc = || format!("{name} of {} on {pg:?}", crate::group::describe(x));
    let engine = pg.engine_ptr(x.device(), &desc)?;
    let mut out: ffi::tdx_tensor = std::ptr::null_mut();
    // SAFETY: x and the engine are live for the call (the autograd node keeps its own reference to the
    // engine); on success `out` is a new at::Tensor* we own.
    let rc = unsafe { ffi::tdx_tp_op(engine, code, x.as_ptr() as ffi::tdx_tensor, &mut out) };
    check(rc, pg.timeout(), desc)?;
    if out.is_null() {
        return Err(Error::invalid(name, "shim returned no tensor"));
    }
    // SAFETY: ownership of the new tensor passes to Rust.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// f: identity forward, allreduce (sum) of the gradient backward. Enters a parallel region.
pub fn copy_to_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(0, "copy_to_parallel_region", x, pg)
}

/// g: allreduce (sum) forward, identity backward. Leaves a parallel region.
pub fn reduce_from_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(1, "reduce_from_parallel_region", x, pg)
}

/// all_gather along the last dimension forward; backward keeps this rank's slice of the gradient.
pub fn gather_from_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(2, "gather_from_parallel_region", x, pg)
}

/// This rank's slice of the last dimension forward; backward all_gathers the gradient.
pub fn scatter_to_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(3, "scatter_to_parallel_region", x, pg)
}
