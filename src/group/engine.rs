//! One c10d backend (a `ProcessGroupGloo` or `ProcessGroupNCCL`) behind the shim's handle.
use std::ffi::CString;
use std::ptr::NonNull;
use std::time::Duration;

use super::{Backend, GroupOptions};
use crate::error::{check, Error, Result};
use crate::ffi;
use crate::store::{millis, Store};

pub(crate) struct Engine {
    ptr: NonNull<ffi::tdx_pg>,
    pub backend: Backend,
    /// A wait gave up on one of its collectives while it still ran (a peer stopped heartbeating): the
    /// engine's threads wait on that peer until the collective timeout, so it is not destroyed.
    pub abandoned: std::sync::atomic::AtomicBool,
}

// SAFETY: c10d backends queue work under their own locks. As in PyTorch, callers must still issue
// collectives in the same order on every rank.
unsafe impl Send for Engine {}
unsafe impl Sync for Engine {}

impl Engine {
    /// Builds the engine on `store` (already under its device prefix). Blocks until all ranks joined.
    pub(crate) fn new(
        store: &Store,
        backend: Backend,
        rank: usize,
        size: usize,
        opts: &GroupOptions,
        cuda_device: Option<usize>,
    ) -> Result<Engine> {
        let mut out = std::ptr::null_mut();
        let what = || format!("{backend} process group (rank {rank} of {size})");
        let code = match backend {
            Backend::Gloo => {
                let host = match &opts.hostname {
                    Some(h) => Some(
                        CString::new(h.as_str())
                            .map_err(|_| Error::invalid("hostname", format!("{h:?} contains a NUL byte")))?,
                    ),
                    None => None,
                };
                let host_ptr = host.as_ref().map_or(std::ptr::null(), |h| h.as_ptr());
                // SAFETY: the store handle and strings are valid for the call.
                unsafe {
                    ffi::tdx_pg_gloo(
                        store.as_ptr(),
                        rank as i32,
                        size as i32,
                        millis(opts.timeout),
                        host_ptr,
                        opts.threads as i32,
                        &mut out,
                    )
                }
            }
            Backend::Nccl => {
                let device = cuda_device.map_or(-1, |d| d as i32);
                // SAFETY: the store handle is valid for the call.
                unsafe {
                    ffi::tdx_pg_nccl(store.as_ptr(), rank as i32, size as i32, millis(opts.timeout), device, &mut out)
                }
            }
        };
        check(code, opts.timeout, what)?;
        let ptr = NonNull::new(out).ok_or_else(|| Error::invalid(what(), "shim returned a null group"))?;
        Ok(Engine { ptr, backend, abandoned: std::sync::atomic::AtomicBool::new(false) })
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::tdx_pg {
        self.ptr.as_ptr()
    }

    pub(crate) fn set_timeout(&self, timeout: Duration) -> Result<()> {
        // SAFETY: the handle is valid.
        let code = unsafe { ffi::tdx_pg_set_timeout(self.ptr.as_ptr(), millis(timeout)) };
        check(code, timeout, || format!("set_timeout ({})", self.backend))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.abandoned.load(std::sync::atomic::Ordering::SeqCst) {
            // c10d's destructor joins the worker threads, which wait on the frozen peer for the whole
            // collective timeout: the process, ending on the error that named the peer, would hang in
            // it. The handle is left to the process's exit instead (its memory only).
            return;
        }
        // SAFETY: we own the handle; collectives in flight hold their own references inside c10d.
        unsafe { ffi::tdx_pg_free(self.ptr.as_ptr()) }
    }
}
