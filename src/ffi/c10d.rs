//! Safe wrappers of the shim's calls into c10d outside a group's collectives.

/// c10d's NCCL flight recorder's JSON dump (an error without the `cuda` feature).
pub(crate) fn nccl_trace_json() -> crate::Result<Vec<u8>> {
    let mut buf = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: out-pointers valid for the call.
    let code = unsafe { super::tdx_nccl_trace_json(&mut buf, &mut len) };
    crate::error::check(code, std::time::Duration::ZERO, || "c10d's NCCL flight recorder".to_string())?;
    // SAFETY: on success `buf` is a malloc'ed buffer of `len` bytes, copied and then freed once.
    let v = unsafe { std::slice::from_raw_parts(buf, len).to_vec() };
    // SAFETY: as above.
    unsafe { super::tdx_buf_free(buf) };
    Ok(v)
}
