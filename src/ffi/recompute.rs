//! Safe wrapper of the shim's recomputation node (tch-dist-sys/csrc/recompute.cpp): a forward whose
//! activations are not kept, run again in backward.
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::Tensor;

use super::check;
use super::hooks::write_error;
use crate::error::{Error, Result};

/// A block's forward over its inputs, which the node runs again in backward.
pub(crate) type ForwardFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

unsafe extern "C" fn forward_drop(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<ForwardFn> handed to the shim, which frees it once.
    drop(unsafe { Box::from_raw(ctx as *mut ForwardFn) });
}

unsafe extern "C" fn forward_trampoline(
    ctx: *mut c_void,
    inputs: *const super::tdx_tensor,
    n: libc::size_t,
    out: *mut super::tdx_tensor,
    err: *mut libc::c_char,
    errlen: libc::size_t,
) -> libc::c_int {
    // SAFETY: ctx is the live Box<ForwardFn>; inputs holds n live at::Tensor* borrowed for the call, and
    // clone_from_ptr makes handles of our own.
    let f = unsafe { &*(ctx as *const ForwardFn) };
    let xs: Vec<Tensor> =
        (0..n).map(|i| unsafe { Tensor::clone_from_ptr(*inputs.add(i) as *mut torch_sys::C_tensor) }).collect();
    let msg = match catch_unwind(AssertUnwindSafe(|| f(&xs))) {
        Ok(Ok(y)) => {
            let mut y = std::mem::ManuallyDrop::new(y);
            // SAFETY: the handle's ownership passes to the shim, which deletes it (as tch's Drop would).
            unsafe { *out = y.as_mut_ptr() as super::tdx_tensor };
            return 0;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => "the checkpointed block panicked".to_string(),
    };
    // SAFETY: the buffer the shim handed to this callback.
    unsafe { write_error(&msg, err, errlen) };
    1
}

unsafe extern "C" fn collect(ctx: *mut c_void, t: super::tdx_tensor) {
    // SAFETY: ctx is the &mut Vec<Tensor> passed for the call; t is a new handle we now own.
    let v = unsafe { &mut *(ctx as *mut Vec<Tensor>) };
    v.push(unsafe { Tensor::from_ptr(t as *mut torch_sys::C_tensor) });
}

/// `forward(x)` through a recomputation node. `params`: the leaves the forward uses whose gradients it
/// produces, or `None` to find them with one extra forward (the second value returned then; empty
/// otherwise).
pub(crate) fn checkpoint(x: &Tensor, params: Option<&[Tensor]>, forward: ForwardFn) -> Result<(Tensor, Vec<Tensor>)> {
    let ctx = Box::into_raw(Box::new(forward));
    let given: Vec<super::tdx_tensor> = params.unwrap_or_default().iter().map(super::handle).collect();
    let input = [super::handle(x)];
    let mut found: Vec<Tensor> = Vec::new();
    let mut out: super::tdx_tensor = std::ptr::null_mut();
    // SAFETY: x and the params are live for the call; the shim owns ctx from here on (freed through
    // forward_drop on every path); `found` outlives the call, during which the sink pushes into it.
    let code = unsafe {
        super::tdx_checkpoint(
            forward_trampoline,
            forward_drop,
            ctx as *mut c_void,
            input.as_ptr(),
            1,
            given.as_ptr(),
            given.len(),
            params.is_none() as libc::c_int,
            collect,
            &mut found as *mut Vec<Tensor> as *mut c_void,
            c"CheckpointBackward".as_ptr(),
            &mut out,
        )
    };
    check(code, std::time::Duration::ZERO, || format!("checkpointed forward of {:?}", x.size()))?;
    if out.is_null() {
        return Err(Error::invalid("checkpoint", "shim returned no tensor"));
    }
    // SAFETY: out is a new at::Tensor* whose ownership passes to Rust.
    let y = unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) };
    Ok((y, found))
}
