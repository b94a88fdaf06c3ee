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

/// [`reduce_from_parallel_region`] summing into `x` itself (Megatron's in-place reduce): for a partial
/// result the caller owns and nothing else reads (not saved for backward), to save a copy of it.
pub(crate) fn reduce_from_parallel_region_owned(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(7, "reduce_from_parallel_region", x, pg)
}

/// all_gather along the last dimension forward; backward keeps this rank's slice of the gradient.
pub fn gather_from_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(2, "gather_from_parallel_region", x, pg)
}

/// This rank's slice of the last dimension forward; backward all_gathers the gradient.
pub fn scatter_to_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(3, "scatter_to_parallel_region", x, pg)
}

/// Sequence parallelism's entry to a tensor-parallel region (Megatron's): all_gather along the sequence
/// (dimension 0 of `[s / t, b, h]`) forward; reduce-scatter of the gradient along it backward.
pub fn gather_from_sequence_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(4, "gather_from_sequence_parallel_region", x, pg)
}

/// Sequence parallelism's exit from a tensor-parallel region: reduce-scatter along the sequence
/// (the sum of the ranks' partial outputs, this rank's part of dimension 0) forward; all_gather backward.
pub fn reduce_scatter_to_sequence_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(5, "reduce_scatter_to_sequence_parallel_region", x, pg)
}

/// This rank's part of the sequence (dimension 0) forward; all_gather of the gradient backward.
pub fn scatter_to_sequence_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(6, "scatter_to_sequence_parallel_region", x, pg)
}

/// Sums, over the TP group, the gradients of parameters that sequence-parallel regions use whole
/// (LayerNorm's weight and bias, a row-parallel layer's bias): each rank's gradient covers only its part of
/// the sequence. Call after backward, before clipping and the optimizer (Megatron's
/// `allreduce_sequence_parallel_gradients`). Parameters without a gradient are skipped.
pub fn allreduce_sequence_parallel_grads(params: &[Tensor], pg: &ProcessGroup) -> Result<()> {
    for g in crate::optim::grads_of(params) {
        let mut g = g;
        pg.allreduce(&mut g, crate::group::ReduceOp::Sum)?;
    }
    Ok(())
}
