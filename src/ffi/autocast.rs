//! Safe wrappers of the shim's autocast state (tch-dist-sys/csrc/autocast.cpp): per thread, as in
//! libtorch.

/// Turns autocast on for device type `device` (0 the CPU, 1 CUDA) to the dtype with c10 code `dtype`;
/// returns the thread's state before (enabled, dtype code), for [`autocast_exit`].
pub(crate) fn autocast_enter(device: i32, dtype: i32) -> crate::Result<(i32, i32)> {
    let (mut prev_enabled, mut prev_dtype) = (0, 0);
    // SAFETY: plain ints and out-pointers valid for the call; the shim catches every exception.
    let code = unsafe { super::tdx_autocast_enter(device, 1, dtype, &mut prev_enabled, &mut prev_dtype) };
    crate::ffi::check(code, std::time::Duration::ZERO, || "enter autocast".to_string())?;
    Ok((prev_enabled, prev_dtype))
}

/// Puts back the state [`autocast_enter`] returned. Restoring cannot fail short of a libtorch bug.
pub(crate) fn autocast_exit(device: i32, prev_enabled: i32, prev_dtype: i32) {
    // SAFETY: plain ints; the shim catches every exception.
    let _ = unsafe { super::tdx_autocast_exit(device, prev_enabled, prev_dtype) };
}
