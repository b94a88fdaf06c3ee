//! Custom autograd functions (PyTorch's `torch.autograd.Function`): outputs computed without history get
//! one node whose backward is a Rust closure from the outputs' gradients to the inputs'. For algorithms
//! whose backward is not the composition of their forward's ops (ring attention's runs the ring again).
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::Tensor;

use super::check;
use crate::error::{crossing_autograd, Error, Result};
use crate::ffi;
use crate::hooks::write_error;

/// Maps the outputs' gradients (zeros where autograd has none) to one gradient per input (`None`: none).
/// Behind a lock because what it saved (tensors) is not `Sync`; a node's backward runs once at a time.
type Backward = std::sync::Mutex<Box<dyn FnMut(&[Tensor]) -> Result<Vec<Option<Tensor>>> + Send>>;

unsafe extern "C" fn backward_drop(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<Backward> handed over by `attach`; the shim frees it once.
    drop(unsafe { Box::from_raw(ctx as *mut Backward) });
}

unsafe extern "C" fn backward_trampoline(
    ctx: *mut c_void,
    grads: *const ffi::tdx_tensor,
    n_grads: libc::size_t,
    grad_ins: *mut ffi::tdx_tensor,
    n_ins: libc::size_t,
    err: *mut libc::c_char,
    errlen: libc::size_t,
) -> libc::c_int {
    // SAFETY: ctx is the live Box<Backward> owned by the node calling this; grads holds n_grads live
    // at::Tensor* borrowed for the call (clone_from_ptr makes handles of our own); grad_ins has room for
    // n_ins entries, all null on entry.
    let f = unsafe { &*(ctx as *const Backward) };
    let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
    let msg = match catch_unwind(AssertUnwindSafe(|| {
        let gs: Vec<Tensor> = (0..n_grads)
            .map(|i| unsafe { Tensor::clone_from_ptr(*grads.add(i) as *mut torch_sys::C_tensor) })
            .collect();
        (*f)(&gs)
    })) {
        Ok(Ok(out)) if out.len() == n_ins => {
            for (i, g) in out.into_iter().enumerate() {
                if let Some(g) = g {
                    let mut g = std::mem::ManuallyDrop::new(g);
                    // SAFETY: the handle's ownership passes to the shim, which deletes it.
                    unsafe { *grad_ins.add(i) = g.as_mut_ptr() as ffi::tdx_tensor };
                }
            }
            return 0;
        }
        Ok(Ok(out)) => format!("a custom backward gave {} gradients for {n_ins} inputs", out.len()),
        Ok(Err(e)) => crossing_autograd(e),
        Err(_) => "tch-dist: a custom backward panicked".to_string(),
    };
    // SAFETY: the buffer the shim handed to this callback.
    unsafe { write_error(&msg, err, errlen) };
    1
}

/// `outputs` (computed from `inputs` without autograd history) again, sharing their data, with one
/// backward node: `backward` gets the outputs' gradients and returns one per input. When grad mode is off
/// or no input requires grad, the outputs come back without history and `backward` is dropped.
pub(crate) fn attach(
    label: &str,
    inputs: &[&Tensor],
    outputs: &[Tensor],
    backward: impl FnMut(&[Tensor]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
) -> Result<Vec<Tensor>> {
    let ctx: *mut Backward = Box::into_raw(Box::new(std::sync::Mutex::new(Box::new(backward))));
    let label_c = std::ffi::CString::new(label.replace('\0', " ")).unwrap_or_default();
    let ins: Vec<ffi::tdx_tensor> = inputs.iter().map(|t| t.as_ptr() as ffi::tdx_tensor).collect();
    let outs: Vec<ffi::tdx_tensor> = outputs.iter().map(|t| t.as_ptr() as ffi::tdx_tensor).collect();
    let mut new_outs: Vec<ffi::tdx_tensor> = vec![std::ptr::null_mut(); outputs.len()];
    let mut attached = 0;
    // SAFETY: the tensors are live for the call; new_outs has room for one entry per output; the shim
    // owns ctx from here on and frees it through backward_drop on every path.
    let code = unsafe {
        ffi::tdx_custom_function(
            ins.as_ptr(),
            ins.len(),
            outs.as_ptr(),
            outs.len(),
            backward_trampoline,
            backward_drop,
            ctx as *mut c_void,
            label_c.as_ptr(),
            new_outs.as_mut_ptr(),
            &mut attached,
        )
    };
    check(code, std::time::Duration::ZERO, || format!("custom function {label}"))?;
    new_outs
        .into_iter()
        .map(|p| {
            if p.is_null() {
                return Err(Error::invalid(label, "shim returned no tensor"));
            }
            // SAFETY: each entry is a new at::Tensor* whose ownership passes to Rust.
            Ok(unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::attach;
    use tch::{Device, Kind, Tensor};

    /// y = 3x with a backward written by hand; an error in it fails the backward with its message.
    #[test]
    fn a_custom_backward_gives_the_inputs_gradients_and_its_errors() {
        let x = Tensor::arange(4, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = tch::no_grad(|| &x * 3.0);
        let y = attach("Triple", &[&x], &[y], |g| Ok(vec![Some(&g[0] * 3.0)])).unwrap().remove(0);
        let loss = (&y * &y).sum(Kind::Float);
        loss.backward();
        assert_eq!(Vec::<f32>::try_from(x.grad()).unwrap(), vec![0.0, 18.0, 36.0, 54.0]);
        // what the backward saved went with the graph: a second backward is refused
        let again = loss.f_backward().unwrap_err();
        assert!(again.to_string().contains("second time"), "{again}");

        let z = tch::no_grad(|| x.shallow_clone() + 1.0);
        let z = attach("Fails", &[&x], &[z], |_| Err(crate::Error::invalid("Fails", "no way back"))).unwrap().remove(0);
        let e = z.sum(Kind::Float).f_backward().unwrap_err();
        assert!(e.to_string().contains("no way back"), "{e}");
        // grad mode off: no history
        let w = tch::no_grad(|| attach("Off", &[&x], &[x.detach()], |_| Ok(vec![None])).unwrap().remove(0));
        assert!(!w.requires_grad());
    }
}
