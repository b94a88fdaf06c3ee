//! Autograd hooks on a leaf's gradient accumulator (what DDP's reducer uses), and the `.grad` slot.
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use tch::Tensor;

use super::check;
use crate::error::{crossing_autograd, Error, Result};
use crate::ffi;

type Callback = Box<dyn Fn() + Send + Sync>;

/// A registered hook; dropping it removes the hook. Don't drop it while a backward through its variable
/// runs on another thread; the type is not `Sync`, so it cannot be shared to do so by accident:
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<tch_dist::hooks::GradHook>();
/// ```
pub struct GradHook {
    ptr: NonNull<ffi::tdx_hook>,
    // Boxed twice so the C side holds a thin pointer; freed after the hook is removed.
    callback: *mut Callback,
}

// SAFETY: the callback is Send + Sync; the handle is only freed in Drop. Not Sync: removing a hook while a
// backward through its variable runs on another thread races inside libtorch (its node's hook list), so
// a GradHook is dropped by the one thread that owns it (DDP drops its hooks when it is dropped).
unsafe impl Send for GradHook {}

unsafe extern "C" fn trampoline(ctx: *mut c_void, _index: i64) {
    // SAFETY: ctx is the *mut Callback registered below, alive until the hook is removed.
    let f = unsafe { &*(ctx as *const Callback) };
    // Never unwind into libtorch's autograd engine.
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        eprintln!("tch-dist: a gradient hook panicked; the panic was contained");
    }
}

/// Runs `f` each time autograd has accumulated a gradient into `var.grad` (after accumulation, as
/// `Tensor.register_post_accumulate_grad_hook`). `var` must be a leaf that requires grad. On CUDA the
/// callback runs on autograd's device threads, hence `Send + Sync`.
///
/// ```no_run
/// let x = tch::Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let _h = tch_dist::hooks::on_grad_accumulated(&x, || println!("x.grad is ready"))?;
/// (&x * 2).sum(tch::Kind::Float).backward();
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub fn on_grad_accumulated(var: &Tensor, f: impl Fn() + Send + Sync + 'static) -> Result<GradHook> {
    let callback: *mut Callback = Box::into_raw(Box::new(Box::new(f)));
    let mut out = std::ptr::null_mut();
    // SAFETY: var is a live tensor; callback stays alive until GradHook drops.
    let code = unsafe {
        ffi::tdx_hook_register(var.as_ptr() as ffi::tdx_tensor, trampoline, callback as *mut c_void, 0, &mut out)
    };
    if let Err(e) = check(code, std::time::Duration::ZERO, || format!("register grad hook on {:?}", var.size())) {
        // SAFETY: registration failed, so nothing else refers to the callback.
        drop(unsafe { Box::from_raw(callback) });
        return Err(e);
    }
    match NonNull::new(out) {
        Some(ptr) => Ok(GradHook { ptr, callback }),
        None => {
            // SAFETY: as above.
            drop(unsafe { Box::from_raw(callback) });
            Err(Error::invalid("register grad hook", "shim returned a null hook"))
        }
    }
}

impl Drop for GradHook {
    fn drop(&mut self) {
        // SAFETY: removes the hook first, so the callback can no longer be reached, then frees it.
        unsafe {
            ffi::tdx_hook_free(self.ptr.as_ptr());
            drop(Box::from_raw(self.callback));
        }
    }
}

/// Runs backward from `output` with `grad` as its gradient (PyTorch's `output.backward(grad)`; tch's
/// `backward` takes none): what a pipeline stage does with the gradient the next stage sent back.
pub fn backward_with_grad(output: &Tensor, grad: &Tensor) -> Result<()> {
    // SAFETY: both tensors are live for the call; the shim reads them and returns.
    let code =
        unsafe { ffi::tdx_backward_with_grad(output.as_ptr() as ffi::tdx_tensor, grad.as_ptr() as ffi::tdx_tensor) };
    check(code, std::time::Duration::ZERO, || {
        format!("backward from {:?} with a gradient of {:?}", output.size(), grad.size())
    })
}

/// Sets `var.grad` to `grad` (which may be a view, e.g. into a flat bucket), or clears it with `None`.
pub fn set_grad(var: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    let g = grad.map_or(std::ptr::null_mut(), |g| g.as_ptr() as ffi::tdx_tensor);
    // SAFETY: both tensors are live for the call; the shim copies the at::Tensor handle.
    let code = unsafe { ffi::tdx_tensor_set_grad(var.as_ptr() as ffi::tdx_tensor, g) };
    check(code, std::time::Duration::ZERO, || format!("set .grad of {:?}", var.size()))
}

/// The address of `var.grad`'s data, or 0 when it is undefined (to check that a grad is a bucket view).
pub fn grad_data_ptr(var: &Tensor) -> Result<u64> {
    let mut out = 0u64;
    // SAFETY: var is live for the call.
    let code = unsafe { ffi::tdx_tensor_grad_data_ptr(var.as_ptr() as ffi::tdx_tensor, &mut out) };
    check(code, std::time::Duration::ZERO, || "read .grad".into())?;
    Ok(out)
}

/// Sets every `.grad` to none (PyTorch's `zero_grad(set_to_none=True)`): the memory goes back until the
/// next backward.
pub fn drop_grads(vars: &[Tensor]) -> Result<()> {
    vars.iter().try_for_each(|v| set_grad(v, None))
}

/// Zeroes every defined `.grad` in place, keeping its memory (a DDP bucket's, say): where the next
/// backward should accumulate into zeros rather than allocate. Every `zero_grad` of this crate, and
/// tch's `Optimizer::zero_grad`, sets gradients to none instead ([`drop_grads`]).
pub fn zero_grads(vars: &[Tensor]) -> Result<()> {
    let _guard = tch::no_grad_guard();
    for v in vars {
        let mut g = v.grad();
        if g.defined() {
            let _ = g.f_zero_()?;
        }
    }
    Ok(())
}

type EndCallback = Option<Box<dyn FnOnce() -> Result<()> + Send>>;

/// Backward callbacks queued and not yet freed (to test that none leaks).
static LIVE_CALLBACKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[cfg(feature = "testing")]
pub fn live_backward_callbacks() -> usize {
    LIVE_CALLBACKS.load(std::sync::atomic::Ordering::SeqCst)
}

unsafe extern "C" fn end_drop(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<EndCallback> handed over by queue_backward_callback; the shim frees it once.
    drop(unsafe { Box::from_raw(ctx as *mut EndCallback) });
    LIVE_CALLBACKS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
}

unsafe extern "C" fn end_trampoline(ctx: *mut c_void, err: *mut libc::c_char, errlen: libc::size_t) -> libc::c_int {
    // SAFETY: ctx is the live Box<EndCallback> the shim owns; autograd runs this at most once.
    let Some(f) = (unsafe { &mut *(ctx as *mut EndCallback) }).take() else { return 0 };
    let msg = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => crossing_autograd(e),
        Err(_) => "tch-dist: a backward callback panicked".to_string(),
    };
    // SAFETY: the buffer the shim handed to this callback.
    unsafe { write_error(&msg, err, errlen) };
    1
}

/// Runs `f` once when the backward pass in progress finishes (as PyTorch's reducer finalises DDP). Call it
/// from inside a gradient hook. If `f` returns an error, that backward fails with it: its message in
/// tch's error, and the error itself, of its kind, where that tch error becomes an [`Error`] (`?` in a
/// function returning `tch_dist::Result`).
pub fn queue_backward_callback(f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    let ctx: *mut EndCallback = Box::into_raw(Box::new(Some(Box::new(f))));
    LIVE_CALLBACKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: the shim takes ownership of ctx and frees it through end_drop on every path.
    let code = unsafe { ffi::tdx_queue_backward_callback(end_trampoline, end_drop, ctx as *mut c_void) };
    check(code, std::time::Duration::ZERO, || "queue a callback at the end of backward".into())
}

type MarkerCallback = Box<dyn Fn() -> Result<()> + Send + Sync>;

unsafe extern "C" fn marker_drop(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<MarkerCallback> handed over by backward_marker; the shim frees it once.
    drop(unsafe { Box::from_raw(ctx as *mut MarkerCallback) });
}

unsafe extern "C" fn marker_trampoline(ctx: *mut c_void, err: *mut libc::c_char, errlen: libc::size_t) -> libc::c_int {
    // SAFETY: ctx is the live Box<MarkerCallback> owned by the autograd node calling this.
    let f = unsafe { &*(ctx as *const MarkerCallback) };
    let msg = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => crossing_autograd(e),
        Err(_) => "tch-dist: a backward marker's callback panicked".to_string(),
    };
    // SAFETY: the buffer the shim handed to this callback.
    unsafe { write_error(&msg, err, errlen) };
    1
}

/// Copies `msg` into the shim's error buffer of `errlen` bytes, truncated and NUL-terminated.
///
/// # Safety
/// `err` is null or the shim's buffer of `errlen` writable bytes, handed to a callback.
pub(crate) unsafe fn write_error(msg: &str, err: *mut libc::c_char, errlen: libc::size_t) {
    if errlen > 0 && !err.is_null() {
        let n = msg.len().min(errlen - 1);
        // SAFETY: by the caller's contract the buffer has room for errlen bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
            *err.add(n) = 0;
        }
    }
}

/// `x` again (sharing its data), with a backward that first runs `f`: in a backward through the result,
/// `f` runs as soon as the gradient of the result is complete, before anything that computed `x` runs
/// backward. An error from `f` fails that backward with it, as in [`queue_backward_callback`]. Returns
/// `(x, false)` without calling anything later when grad mode is off or `x` does not require grad.
pub fn backward_marker(
    x: &Tensor,
    label: &str,
    f: impl Fn() -> Result<()> + Send + Sync + 'static,
) -> Result<(Tensor, bool)> {
    let ctx: *mut MarkerCallback = Box::into_raw(Box::new(Box::new(f)));
    let label_c = std::ffi::CString::new(label.replace('\0', " ")).unwrap_or_default();
    let mut out: ffi::tdx_tensor = std::ptr::null_mut();
    let mut attached = 0;
    // SAFETY: x is live; the shim owns ctx from here on and frees it through marker_drop on every path.
    let code = unsafe {
        ffi::tdx_backward_marker(
            x.as_ptr() as ffi::tdx_tensor,
            marker_trampoline,
            marker_drop,
            ctx as *mut c_void,
            label_c.as_ptr(),
            &mut out,
            &mut attached,
        )
    };
    check(code, std::time::Duration::ZERO, || format!("backward marker {label}"))?;
    if out.is_null() {
        return Err(Error::invalid("backward marker", "shim returned no tensor"));
    }
    // SAFETY: out is a new at::Tensor* whose ownership passes to Rust.
    Ok((unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) }, attached != 0))
}
