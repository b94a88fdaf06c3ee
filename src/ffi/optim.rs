//! Safe wrappers of the shim's optimizer kernels: ATen's fused AdamW, torch.optim's multi-tensor (foreach)
//! AdamW and SGD, the single-tensor AdamW, and the multi-tensor norm and scale that clipping uses.
use tch::Tensor;

use super::check;
use super::handle;
use crate::error::{Error, Result};

/// AdamW's scalars for one step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamScalars {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

fn same_lengths(what: &str, n: usize, others: &[usize]) -> Result<()> {
    if others.iter().any(|&k| k != n) {
        return Err(Error::invalid(what, format!("lists of different lengths ({n} and {others:?})")));
    }
    Ok(())
}

fn handles(ts: &[Tensor]) -> Vec<super::tdx_tensor> {
    ts.iter().map(handle).collect()
}

/// ATen's fused AdamW (`torch.optim.AdamW(fused=True)`) over tensors of one device and dtype; `steps[i]`
/// is parameter i's step count after this step, a float32 scalar tensor on its device.
pub(crate) fn fused_adamw(
    p: &[Tensor],
    g: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    steps: &[Tensor],
    s: AdamScalars,
) -> Result<()> {
    same_lengths("fused AdamW", p.len(), &[g.len(), m.len(), v.len(), steps.len()])?;
    let (hp, hg, hm, hv, hs) = (handles(p), handles(g), handles(m), handles(v), handles(steps));
    // SAFETY: every handle points to a tensor borrowed for the call, and the five lists have p.len() entries.
    let code = unsafe {
        super::tdx_fused_adamw(
            hp.as_ptr(),
            hg.as_ptr(),
            hm.as_ptr(),
            hv.as_ptr(),
            hs.as_ptr(),
            p.len(),
            s.lr,
            s.beta1,
            s.beta2,
            s.weight_decay,
            s.eps,
        )
    };
    check(code, std::time::Duration::ZERO, || format!("fused AdamW step over {} parameters", p.len()))
}

/// torch.optim.AdamW's multi-tensor path (`foreach=True`) over tensors of one device and dtype;
/// `steps[i]` is parameter i's step count after this step.
pub(crate) fn foreach_adamw(
    p: &[Tensor],
    g: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    steps: &[i64],
    s: AdamScalars,
) -> Result<()> {
    same_lengths("foreach AdamW", p.len(), &[g.len(), m.len(), v.len(), steps.len()])?;
    let (hp, hg, hm, hv) = (handles(p), handles(g), handles(m), handles(v));
    // SAFETY: every handle points to a tensor borrowed for the call, and the five lists have p.len() entries.
    let code = unsafe {
        super::tdx_foreach_adamw(
            hp.as_ptr(),
            hg.as_ptr(),
            hm.as_ptr(),
            hv.as_ptr(),
            steps.as_ptr(),
            p.len(),
            s.lr,
            s.beta1,
            s.beta2,
            s.weight_decay,
            s.eps,
        )
    };
    check(code, std::time::Duration::ZERO, || format!("foreach AdamW step over {} parameters", p.len()))
}

/// One parameter's AdamW update with torch.optim's single-tensor floats, `chunk` elements at a time.
pub(crate) fn adamw_step(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: i64,
    chunk: i64,
    s: AdamScalars,
) -> Result<()> {
    // SAFETY: the four handles point to tensors borrowed for the call.
    let code = unsafe {
        super::tdx_adamw_step(
            handle(p),
            handle(g),
            handle(m),
            handle(v),
            s.lr,
            s.beta1,
            s.beta2,
            s.weight_decay,
            s.eps,
            step,
            chunk,
        )
    };
    check(code, std::time::Duration::ZERO, || format!("AdamW step of a {:?} {:?} parameter", p.size(), p.kind()))
}

/// torch.optim.SGD's multi-tensor path (`foreach=True`) over tensors of one device and dtype. `bufs` are
/// the momentum buffers: those that are `None` are made by this step (when momentum is not 0).
#[allow(clippy::too_many_arguments)]
pub(crate) fn foreach_sgd(
    p: &[Tensor],
    g: &[Tensor],
    bufs: &mut [Option<Tensor>],
    lr: f64,
    momentum: f64,
    dampening: f64,
    nesterov: bool,
    weight_decay: f64,
) -> Result<()> {
    same_lengths("foreach SGD", p.len(), &[g.len(), bufs.len()])?;
    let (hp, hg) = (handles(p), handles(g));
    let mut hb: Vec<super::tdx_tensor> = bufs.iter().map(|b| b.as_ref().map_or(std::ptr::null_mut(), handle)).collect();
    // SAFETY: every non-null handle points to a tensor borrowed for the call; the lists have p.len() entries;
    // the shim writes a new at::Tensor* only into slots that were null, adopted below once each.
    let code = unsafe {
        super::tdx_foreach_sgd(
            hp.as_ptr(),
            hg.as_ptr(),
            hb.as_mut_ptr(),
            p.len(),
            lr,
            momentum,
            dampening,
            nesterov as i32,
            weight_decay,
        )
    };
    // buffers the shim made are owned here, also when it failed after making them
    for (b, h) in bufs.iter_mut().zip(hb) {
        if b.is_none() && !h.is_null() {
            // SAFETY: a null slot the shim filled holds a tensor made for this call alone.
            *b = Some(unsafe { super::adopt(h, "foreach SGD's momentum buffer") }?);
        }
    }
    check(code, std::time::Duration::ZERO, || format!("foreach SGD step over {} parameters", p.len()))
}

/// The `ord`-norm of each tensor, all of one dtype (ATen's `_foreach_norm`; 16-bit ones in float32), stacked:
/// a 1-D tensor of `ts.len()`.
pub(crate) fn foreach_norms(ts: &[Tensor], ord: f64) -> Result<Tensor> {
    let h = handles(ts);
    let mut out: super::tdx_tensor = std::ptr::null_mut();
    // SAFETY: the handles point to tensors borrowed for the call; `out` receives a new tensor, adopted once.
    let code = unsafe { super::tdx_foreach_norms(h.as_ptr(), h.len(), ord, &mut out) };
    check(code, std::time::Duration::ZERO, || format!("the {ord}-norms of {} tensors", ts.len()))?;
    // SAFETY: on success the shim made `out` for this call alone.
    unsafe { super::adopt(out, "foreach norm") }
}

/// Multiplies every tensor in place by `factor`, a scalar tensor on their device (`_foreach_mul_`).
pub(crate) fn foreach_mul_(ts: &[Tensor], factor: &Tensor) -> Result<()> {
    let h = handles(ts);
    // SAFETY: the handles point to tensors borrowed for the call.
    let code = unsafe { super::tdx_foreach_mul_(h.as_ptr(), h.len(), handle(factor)) };
    check(code, std::time::Duration::ZERO, || format!("scaling {} tensors", ts.len()))
}

/// Which variant of the shim's two-pass CPU AdamW update gave ATen's floats (`None`: none did).
pub(crate) fn adamw_two_pass_variant() -> Option<i32> {
    // SAFETY: no arguments; the shim catches everything.
    let v = unsafe { super::tdx_adamw_two_pass_variant() };
    (v >= 0).then_some(v)
}

/// `a + alpha * b` in one ATen op (`add(b, alpha)`, as torch.optim.SGD): in place into `a` (returned), or
/// into a new tensor.
pub(crate) fn add_scaled(a: &Tensor, b: &Tensor, alpha: f64, in_place: bool) -> Result<Tensor> {
    let mut out: super::tdx_tensor = std::ptr::null_mut();
    let what = || format!("SGD's add of {:?}{:?} times {alpha}", b.kind(), b.size());
    // SAFETY: both tensors are borrowed for the call; `out` is null (in place) or receives a new at::Tensor*
    // that `adopt` takes over once.
    let code = unsafe {
        super::tdx_add_scaled(handle(a), handle(b), alpha, if in_place { std::ptr::null_mut() } else { &mut out })
    };
    check(code, std::time::Duration::ZERO, what)?;
    if in_place {
        Ok(a.shallow_clone())
    } else {
        // SAFETY: on success the shim made `out` for this call alone.
        unsafe { super::adopt(out, "SGD's add") }
    }
}

/// ATen's `_amp_foreach_non_finite_check_and_unscale_` over gradients of one device: each multiplied by
/// `inv_scale` in place, and `found_inf` (float32, one element, their device) set to 1 where any is inf or
/// NaN.
pub(crate) fn amp_unscale(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    let mut hg = handles(grads);
    // SAFETY: every handle points to a tensor borrowed for the call; the kernel writes the gradients and
    // the flag in place.
    let code = unsafe { super::tdx_amp_unscale(hg.as_mut_ptr(), hg.len(), handle(found_inf), handle(inv_scale)) };
    check(code, std::time::Duration::ZERO, || format!("unscaling {} gradients", grads.len()))
}
