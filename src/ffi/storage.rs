//! Safe wrappers of the shim's storage calls (tch-dist-sys/csrc/storage.cpp): a tensor's storage read,
//! resized in place, or handed its memory from another's.
use std::time::Duration;

use tch::Tensor;

use super::check;
use super::handle;
use crate::error::Result;

/// Reads one integer of `t`'s storage through `call`.
fn read(t: &Tensor, what: &str, call: unsafe extern "C" fn(super::tdx_tensor, *mut i64) -> libc::c_int) -> Result<i64> {
    let mut out = 0i64;
    // SAFETY: `t` is live for the call and `out` is a valid place for the answer.
    let code = unsafe { call(handle(t), &mut out) };
    check(code, Duration::ZERO, || format!("read a storage's {what}"))?;
    Ok(out)
}

/// The identity of `t`'s storage (shared by every tensor viewing it).
pub(crate) fn storage_id(t: &Tensor) -> Result<i64> {
    read(t, "identity", super::tdx_storage_id)
}

/// Bytes `t`'s storage holds now.
pub(crate) fn storage_nbytes(t: &Tensor) -> Result<i64> {
    read(t, "size", super::tdx_storage_nbytes)
}

/// How many tensors share `t`'s storage.
pub(crate) fn storage_use_count(t: &Tensor) -> Result<i64> {
    read(t, "use count", super::tdx_storage_use_count)
}

/// Gives `t`'s storage `nbytes` of fresh memory (0 frees it), in place: every tensor sharing it sees the
/// new memory.
pub(crate) fn storage_resize(t: &Tensor, nbytes: i64) -> Result<()> {
    // SAFETY: `t` is live for the call; the shim swaps the storage's data pointer under libtorch's own API.
    let code = unsafe { super::tdx_storage_resize(handle(t), nbytes) };
    check(code, Duration::ZERO, || format!("resize the storage of {:?} to {nbytes} bytes", t.size()))
}

/// Moves `src`'s storage memory into `dst`'s, leaving `src`'s freed.
pub(crate) fn storage_move(dst: &Tensor, src: &Tensor) -> Result<()> {
    // SAFETY: both are live for the call; the shim moves the DataPtr between the two StorageImpls.
    let code = unsafe { super::tdx_storage_move(handle(dst), handle(src)) };
    check(code, Duration::ZERO, || "move a storage's memory".into())
}
