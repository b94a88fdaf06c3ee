//! Safe wrappers of the shim's device calls (tch-dist-sys/csrc/memory.cpp, cuda.cpp): the counting CPU
//! allocator, CUDA's memory statistics, devices and sync debug mode, and the thread's last error. Each
//! returns what the shim reports; its callers give the errors their names.
use std::ffi::CStr;

/// Installs the counting CPU allocator (idempotent); false when another allocator of higher priority is.
pub(crate) fn cpu_counter_install() -> bool {
    // SAFETY: no arguments; the shim serialises installation.
    unsafe { super::tdx_cpu_counter_install() == super::TDX_OK }
}

pub(crate) fn cpu_counter_installed() -> bool {
    // SAFETY: reads a flag.
    unsafe { super::tdx_cpu_counter_installed() != 0 }
}

/// The counting allocator's bytes allocated now.
pub(crate) fn cpu_allocated() -> i64 {
    // SAFETY: reads an atomic.
    unsafe { super::tdx_cpu_allocated() }
}

/// The counting allocator's peak.
pub(crate) fn cpu_peak() -> i64 {
    // SAFETY: reads an atomic.
    unsafe { super::tdx_cpu_peak() }
}

pub(crate) fn cpu_reset_peak() {
    // SAFETY: writes an atomic.
    unsafe { super::tdx_cpu_reset_peak() }
}

/// CUDA's (allocated, peak allocated) bytes on `cuda:index`; `None` without such a device or CUDA.
pub(crate) fn cuda_memory(index: usize) -> Option<(i64, i64)> {
    let (mut a, mut p) = (0i64, 0i64);
    // SAFETY: the out-pointers are valid for the call.
    let code = unsafe { super::tdx_cuda_memory(index as i32, &mut a, &mut p) };
    (code == super::TDX_OK).then_some((a, p))
}

/// Resets `cuda:index`'s peaks; false without such a device or CUDA.
pub(crate) fn cuda_reset_peak(index: usize) -> bool {
    // SAFETY: plain call; failure is reported by code.
    unsafe { super::tdx_cuda_reset_peak(index as i32) == super::TDX_OK }
}

/// The caching allocator's peak reserved bytes on `cuda:index`.
pub(crate) fn cuda_peak_reserved(index: usize) -> Option<i64> {
    let mut out = 0;
    // SAFETY: the out-pointer is valid for the call.
    let code = unsafe { super::tdx_cuda_peak_reserved(index as i32, &mut out) };
    (code == super::TDX_OK).then_some(out)
}

/// `cuda:index`'s name as CUDA reports it.
pub(crate) fn cuda_device_name(index: usize) -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; the shim writes a NUL-terminated name within it.
    let code = unsafe { super::tdx_cuda_device_name(index as i32, buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if code != super::TDX_OK {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// CUDA devices this build can use (0 without the `cuda` feature or a GPU).
pub(crate) fn cuda_device_count() -> usize {
    let mut n = 0;
    // SAFETY: the out-pointer is valid for the call.
    unsafe { super::tdx_cuda_device_count(&mut n) };
    n.max(0) as usize
}

/// The calling thread's current CUDA device.
pub(crate) fn cuda_current_device() -> Option<usize> {
    let mut d = -1;
    // SAFETY: the out-pointer is valid for the call.
    let code = unsafe { super::tdx_cuda_current_device(&mut d) };
    (code == super::TDX_OK && d >= 0).then_some(d as usize)
}

/// Makes `cuda:index` the calling thread's current device; false when it cannot be.
pub(crate) fn cuda_set_device(index: usize) -> bool {
    // SAFETY: plain call; failure is reported by code.
    unsafe { super::tdx_cuda_set_device(index as i32) == super::TDX_OK }
}

/// Sets CUDA's sync debug mode (0 off, 1 warn, 2 error); the mode before, `None` without CUDA.
pub(crate) fn cuda_set_sync_debug_mode(mode: i32) -> Option<i32> {
    let mut previous = 0;
    // SAFETY: the out-pointer is valid for the call.
    let code = unsafe { super::tdx_cuda_set_sync_debug_mode(mode, &mut previous) };
    (code == super::TDX_OK).then_some(previous)
}

/// The calling thread's last shim error, as one line ("" when none).
pub(crate) fn last_error() -> String {
    // SAFETY: the shim returns null or a pointer to a thread-local NUL-terminated string that lives until
    // the next failing call on this thread; it is copied at once.
    let msg = unsafe {
        let p = super::tdx_last_error();
        if p.is_null() {
            return String::new();
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    };
    // c10d's messages can span lines; errors read best (and log best) as one line.
    msg.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}
