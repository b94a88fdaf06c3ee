//! The shim's raw bindings (the `tch-dist-sys` crate), [`adopt`] for the tensors it hands over, and the
//! safe wrappers of its calls (and of the few C library calls the crate makes): `unsafe` lives here, so
//! that the modules above call only safe functions.
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

/// Turns a shim return code into a `Result`, reading the thread's last error message.
/// `op` is evaluated only on failure, so hot paths do not format strings.
pub(crate) fn check(
    code: libc::c_int,
    timeout: std::time::Duration,
    op: impl FnOnce() -> String,
) -> crate::error::Result<()> {
    if code == TDX_OK {
        return Ok(());
    }
    let msg = last_error();
    let op = op();
    Err(match code {
        TDX_ETIMEOUT => crate::error::Error::Timeout { op, timeout, msg },
        TDX_ENETWORK => crate::error::Error::PeerGone { op, msg },
        TDX_EINVALID => crate::error::classify_invalid(op, msg),
        TDX_EUNAVAILABLE => crate::error::Error::Unavailable { what: op, msg },
        _ => crate::error::classify_generic(op, msg),
    })
}

mod autocast;
pub(crate) mod bytes;
pub(crate) use autocast::{autocast_enter, autocast_exit};
pub(crate) mod c10d;
pub(crate) use c10d::nccl_trace_json;
pub(crate) mod function;
pub mod hooks;
mod identity;
pub(crate) use identity::{tensor_identity, WeakRef};
mod optim;
pub(crate) use optim::{
    adamw_step, adamw_two_pass_variant, add_scaled, amp_unscale, foreach_adamw, foreach_mul_, foreach_norms,
    foreach_sgd, fused_adamw, AdamScalars,
};

mod device;
pub(crate) use device::{
    cpu_allocated, cpu_counter_install, cpu_counter_installed, cpu_peak, cpu_reset_peak, cuda_current_device,
    cuda_device_count, cuda_device_name, cuda_memory, cuda_peak_reserved, cuda_reset_peak, cuda_set_device,
    cuda_set_sync_debug_mode, last_error,
};
mod os;
#[cfg(feature = "testing")]
pub(crate) use os::kill_self;
pub(crate) use os::{at_exit, hostname, peer_closed};
mod random;
pub(crate) mod recompute;
#[cfg(feature = "testing")]
pub(crate) mod reference;
pub(crate) mod tch_optimizer;
pub(crate) use random::{draw_seq, randperm, SavedRng};
mod storage;
pub mod store;
pub mod stream;
pub(crate) use storage::{storage_id, storage_move, storage_nbytes, storage_resize, storage_use_count};

fn handle(t: &tch::Tensor) -> tdx_tensor {
    t.as_ptr() as tdx_tensor
}
