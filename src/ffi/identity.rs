//! Safe wrappers of the shim's tensor identities (tch-dist-sys/csrc/identity.cpp): what tells one
//! TensorImpl from another, and a weak reference that says when it is gone.
use tch::Tensor;

use super::check;
use crate::error::Result;

/// A weak reference to a tensor, from the shim.
pub(crate) struct WeakRef(*mut super::tdx_weak);

// SAFETY: the weak reference is c10's weak_intrusive_ptr, whose counts are atomic; it is only read
// (expired) and freed, never dereferenced to the tensor.
unsafe impl Send for WeakRef {}

impl WeakRef {
    pub(crate) fn expired(&self) -> bool {
        // SAFETY: self.0 is a live handle from tdx_tensor_identity, freed only in drop.
        unsafe { super::tdx_weak_expired(self.0) != 0 }
    }
}

impl Drop for WeakRef {
    fn drop(&mut self) {
        // SAFETY: self.0 came from tdx_tensor_identity and is freed once, here.
        unsafe { super::tdx_weak_free(self.0) }
    }
}

/// `t`'s identity, and with `weak` a weak reference to it.
pub(crate) fn tensor_identity(t: &Tensor, weak: bool) -> Result<(i64, Option<WeakRef>)> {
    let (mut id, mut w): (i64, *mut super::tdx_weak) = (0, std::ptr::null_mut());
    let out = if weak { &mut w as *mut *mut super::tdx_weak } else { std::ptr::null_mut() };
    // SAFETY: t is live for the call; out is null or a slot for the new weak handle the shim hands over.
    let code = unsafe { super::tdx_tensor_identity(super::handle(t), &mut id, out) };
    check(code, std::time::Duration::ZERO, || "read a tensor's identity".into())?;
    Ok((id, (!w.is_null()).then_some(WeakRef(w))))
}
