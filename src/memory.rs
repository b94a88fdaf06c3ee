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
    if ffi::cpu_counter_install() {
        return Ok(());
    }
    Err(Error::Backend {
        op: "install CPU memory counter".into(),
        msg: "another CPU allocator with higher priority is installed".into(),
    })
}

/// Whether the CPU counter is installed.
pub fn cpu_counter_installed() -> bool {
    ffi::cpu_counter_installed()
}

fn cuda_stats(index: usize) -> Result<(i64, i64)> {
    ffi::cuda_memory(index).ok_or_else(|| unavailable(index))
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
            Ok(ffi::cpu_allocated())
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
            Ok(ffi::cpu_peak())
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
            ffi::cpu_reset_peak();
            Ok(())
        }
        Device::Cuda(i) if ffi::cuda_reset_peak(i) => Ok(()),
        Device::Cuda(i) => Err(unavailable(i)),
        d => Err(unsupported(d)),
    }
}

/// The caching allocator's highest reserved bytes on `cuda:index` since the last [`reset_peak`]
/// (`torch.cuda.max_memory_reserved`): what the process holds from the driver, cached blocks included.
pub fn cuda_peak_reserved(index: usize) -> Result<i64> {
    ffi::cuda_peak_reserved(index).ok_or_else(|| unavailable(index))
}

/// The name of `cuda:index` as CUDA reports it (`torch.cuda.get_device_name`), if CUDA is usable.
pub fn cuda_device_name(index: usize) -> Option<String> {
    ffi::cuda_device_name(index)
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
    ffi::cuda_device_count()
}

/// The calling thread's current CUDA device (`torch.cuda.current_device`), if CUDA is usable.
pub fn current_cuda_device() -> Option<usize> {
    ffi::cuda_current_device()
}

/// Makes `cuda:index` the current CUDA device of the calling thread (`torch.cuda.set_device`): where the
/// caching allocator puts what is allocated without a device of its own.
pub fn set_cuda_device(index: usize) -> Result<()> {
    if ffi::cuda_set_device(index) {
        return Ok(());
    }
    Err(Error::Unavailable {
        what: format!("cuda:{index}"),
        msg: format!("cannot make it the current device ({} CUDA device(s) usable)", cuda_device_count()),
    })
}

/// Path of `libtch_dist_memory.so`, the CPU ruler for Python processes (ctypes), as built with this crate.
pub fn ruler_library_path() -> &'static str {
    crate::ffi::MEMORY_RULER_LIB
}
