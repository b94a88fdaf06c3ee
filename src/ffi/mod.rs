//! The shim's raw bindings (the `tch-dist-sys` crate), and [`adopt`] for the tensors it hands over.
pub(crate) use tch_dist_sys::*;

/// Takes ownership of `p`, a new `at::Tensor*` the shim returned through an out-parameter (null when it
/// made none).
///
/// # Safety
/// `p` is null or a tensor the shim made for the caller, owned by nothing else, and adopted once.
pub(crate) unsafe fn adopt(p: tdx_tensor, what: &str) -> crate::error::Result<tch::Tensor> {
    if p.is_null() {
        return Err(crate::error::Error::invalid(what.to_string(), "shim returned no tensor"));
    }
    // SAFETY: by the caller's contract; the Tensor built here frees it.
    Ok(unsafe { tch::Tensor::from_ptr(p as *mut torch_sys::C_tensor) })
}

mod optim;
pub(crate) use optim::{
    adamw_step, adamw_two_pass_variant, add_scaled, foreach_adamw, foreach_mul_, foreach_norms, foreach_sgd,
    fused_adamw, AdamScalars,
};

mod random;
pub(crate) use random::{draw_seq, randperm, SavedRng};
mod storage;
pub(crate) use storage::{storage_id, storage_move, storage_nbytes, storage_resize, storage_use_count};

fn handle(t: &tch::Tensor) -> tdx_tensor {
    t.as_ptr() as tdx_tensor
}
