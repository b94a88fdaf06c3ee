//! Memory rulers: bytes allocated now and at peak, per device.
//!
//! On CPU the ruler is a counting allocator layered over libtorch's CPU allocator. It counts only what is
//! allocated after it is installed: install it first thing in `main` ([`install_cpu_counter`]), or let the
//! first call to [`allocated`] / [`peak`] install it. It does not see Gloo's or the TCPStore's own buffers.
//!
//! The same code is built as `libtch_dist_memory.so` ([`ruler_library_path`]); a Python process loads it
//! with ctypes and calls `tdx_cpu_counter_install`, `tdx_cpu_allocated`, `tdx_cpu_peak`, so PyTorch is
//! measured with the very same ruler (see `scripts/memory_ruler.py`).
//!
//! On CUDA the numbers are the caching allocator's (`torch.cuda.memory_allocated` / `max_memory_allocated`).
use tch::Device;

pub mod plan;

use crate::error::{Error, Result};
use crate::ffi;

/// Installs the counting CPU allocator (idempotent). Tensors allocated before are not counted.
pub fn install_cpu_counter() -> Result<()> {
    // SAFETY: no arguments; the shim serialises installation.
    match unsafe { ffi::tdx_cpu_counter_install() } {
        ffi::TDX_OK => Ok(()),
        _ => Err(Error::Backend {
            op: "install CPU memory counter".into(),
            msg: "another CPU allocator with higher priority is installed".into(),
        }),
    }
}

/// Whether the CPU counter is installed.
pub fn cpu_counter_installed() -> bool {
    // SAFETY: reads a flag.
    unsafe { ffi::tdx_cpu_counter_installed() != 0 }
}

fn cuda_stats(index: usize) -> Result<(i64, i64)> {
    let (mut a, mut p) = (0i64, 0i64);
    // SAFETY: out-pointers valid for the call.
    match unsafe { ffi::tdx_cuda_memory(index as i32, &mut a, &mut p) } {
        ffi::TDX_OK => Ok((a, p)),
        _ => Err(unavailable(index)),
    }
}

fn unavailable(index: usize) -> Error {
    Error::Unavailable {
        what: format!("CUDA memory stats for cuda:{index}"),
        msg: if cfg!(feature = "cuda") {
            "no such CUDA device".into()
        } else {
            "tch-dist was built without the `cuda` feature".into()
        },
    }
}

fn unsupported(d: Device) -> Error {
    Error::invalid("memory stats", format!("device {d:?} has no memory ruler (CPU and CUDA only)"))
}

/// Bytes currently allocated on `device`.
pub fn allocated(device: Device) -> Result<i64> {
    match device {
        Device::Cpu => {
            install_cpu_counter()?;
            // SAFETY: reads an atomic.
            Ok(unsafe { ffi::tdx_cpu_allocated() })
        }
        Device::Cuda(i) => Ok(cuda_stats(i)?.0),
        d => Err(unsupported(d)),
    }
}

/// Highest [`allocated`] value since installation or the last [`reset_peak`].
pub fn peak(device: Device) -> Result<i64> {
    match device {
        Device::Cpu => {
            install_cpu_counter()?;
            // SAFETY: reads an atomic.
            Ok(unsafe { ffi::tdx_cpu_peak() })
        }
        Device::Cuda(i) => Ok(cuda_stats(i)?.1),
        d => Err(unsupported(d)),
    }
}

/// Sets the peak to the current allocation.
pub fn reset_peak(device: Device) -> Result<()> {
    match device {
        Device::Cpu => {
            install_cpu_counter()?;
            // SAFETY: writes an atomic.
            unsafe { ffi::tdx_cpu_reset_peak() };
            Ok(())
        }
        // SAFETY: plain call; failure is reported by code.
        Device::Cuda(i) => match unsafe { ffi::tdx_cuda_reset_peak(i as i32) } {
            ffi::TDX_OK => Ok(()),
            _ => Err(unavailable(i)),
        },
        d => Err(unsupported(d)),
    }
}

/// The caching allocator's highest reserved bytes on `cuda:index` since the last [`reset_peak`]
/// (`torch.cuda.max_memory_reserved`): what the process holds from the driver, cached blocks included.
pub fn cuda_peak_reserved(index: usize) -> Result<i64> {
    let mut out = 0;
    // SAFETY: out-pointer valid for the call.
    match unsafe { ffi::tdx_cuda_peak_reserved(index as i32, &mut out) } {
        ffi::TDX_OK => Ok(out),
        _ => Err(unavailable(index)),
    }
}

/// The name of `cuda:index` as CUDA reports it (`torch.cuda.get_device_name`), if CUDA is usable.
pub fn cuda_device_name(index: usize) -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; the shim writes a NUL-terminated name within it.
    let code = unsafe { ffi::tdx_cuda_device_name(index as i32, buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if code != ffi::TDX_OK {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// The highest resident set of this process so far (the kernel's `VmHWM`), in bytes: what the CPU's
/// peak memory is without [`install_cpu_counter`].
pub fn peak_rss() -> Result<i64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| Error::Unavailable { what: "peak RSS".into(), msg: format!("/proc/self/status: {e}") })?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| Error::Unavailable { what: "peak RSS".into(), msg: "no VmHWM in /proc/self/status".into() })
}

/// Number of CUDA devices this build can use (0 without the `cuda` feature or without a GPU).
pub fn cuda_device_count() -> usize {
    let mut n = 0;
    // SAFETY: out-pointer valid for the call.
    unsafe { ffi::tdx_cuda_device_count(&mut n) };
    n.max(0) as usize
}

/// The calling thread's current CUDA device (`torch.cuda.current_device`), if CUDA is usable.
pub fn current_cuda_device() -> Option<usize> {
    let mut d = -1;
    // SAFETY: out-pointer valid for the call.
    let code = unsafe { ffi::tdx_cuda_current_device(&mut d) };
    (code == ffi::TDX_OK && d >= 0).then_some(d as usize)
}

/// Makes `cuda:index` the current CUDA device of the calling thread (`torch.cuda.set_device`): where the
/// caching allocator puts what is allocated without a device of its own.
pub fn set_cuda_device(index: usize) -> Result<()> {
    // SAFETY: plain call.
    match unsafe { ffi::tdx_cuda_set_device(index as i32) } {
        ffi::TDX_OK => Ok(()),
        _ => Err(Error::Unavailable {
            what: format!("cuda:{index}"),
            msg: format!("cannot make it the current device ({} CUDA device(s) usable)", cuda_device_count()),
        }),
    }
}

/// Path of `libtch_dist_memory.so`, the CPU ruler for Python processes (ctypes), as built with this crate.
pub fn ruler_library_path() -> &'static str {
    crate::ffi::MEMORY_RULER_LIB
}
