//! Handles to collectives in flight, as `torch.distributed`'s `Work` objects.
use std::ptr::NonNull;
use std::time::Duration;

use std::sync::Arc;

use crate::error::{check, Result};
use crate::ffi;
use crate::flight::{GroupTrace, Recording};
use crate::store::millis;

/// A step run once after a successful wait.
pub(crate) type Finish = Box<dyn FnOnce() -> Result<()> + Send>;

/// An asynchronous collective or point-to-point operation. Wait on it before reading the tensors it writes.
/// Dropping it without waiting is allowed: the operation still runs to completion in the background.
#[must_use = "a collective's result is only valid after wait()"]
pub struct Work {
    ptr: NonNull<ffi::tdx_work>,
    timeout: Duration,
    desc: Box<dyn Fn() -> String + Send>,
    // Runs once after a successful wait (e.g. the division that turns SUM into AVG on Gloo).
    finish: Option<Finish>,
    // Works that must complete before this one counts as done (e.g. a send's header).
    before: Vec<Work>,
    // Where the flight recorder keeps this operation (ended once, when waited for or dropped).
    trace: Option<WorkTrace>,
}

/// A work's entry in the flight recorder, and its group's sequence number.
pub(crate) struct WorkTrace {
    pub group: Arc<GroupTrace>,
    pub seq: u64,
    pub p2p: bool,
    pub recording: Option<Recording>,
}

// SAFETY: c10d::Work is internally synchronised (mutex + condition variable).
unsafe impl Send for Work {}

impl Work {
    pub(crate) fn new(
        ptr: *mut ffi::tdx_work,
        timeout: Duration,
        desc: Box<dyn Fn() -> String + Send>,
        finish: Option<Finish>,
    ) -> Work {
        let ptr = match NonNull::new(ptr) {
            Some(p) => p,
            // The shim only returns TDX_OK with a handle; a null here is a broken invariant, not input.
            None => std::process::abort(),
        };
        Work { ptr, timeout, desc, finish, before: Vec::new(), trace: None }
    }

    pub(crate) fn traced(mut self, t: WorkTrace) -> Work {
        self.trace = Some(t);
        self
    }

    /// Waits for completion, at most the group's timeout.
    pub fn wait(self) -> Result<()> {
        let t = self.timeout;
        self.wait_timeout(t)
    }

    /// Waits at most `timeout`; an operation still running then is an [`Error::Timeout`](crate::Error).
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<()> {
        for w in std::mem::take(&mut self.before) {
            w.wait_timeout(timeout)?;
        }
        // SAFETY: we own the handle.
        let code = unsafe { ffi::tdx_work_wait(self.ptr.as_ptr(), millis(timeout)) };
        let waited = check(code, timeout, || (self.desc)());
        if let Some(t) = self.trace.take() {
            match waited {
                Ok(()) => {
                    if let Some(r) = &t.recording {
                        r.end(None);
                    }
                }
                Err(err) => {
                    if let Some(r) = &t.recording {
                        r.end(Some(&err.to_string()));
                    }
                    return Err(t.group.on_failure(t.seq, t.p2p, err));
                }
            }
        } else {
            waited?;
        }
        match self.finish.take() {
            Some(f) => f(),
            None => Ok(()),
        }
    }

    pub(crate) fn wait_first(&mut self, w: Work) {
        self.before.push(w);
    }

    /// Whether the operation has finished (successfully or not), without blocking.
    pub fn is_completed(&self) -> Result<bool> {
        let mut out = 0;
        // SAFETY: we own the handle.
        let code = unsafe { ffi::tdx_work_is_completed(self.ptr.as_ptr(), &mut out) };
        check(code, self.timeout, || (self.desc)())?;
        Ok(out != 0)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // dropped without waiting: done if the engine says so, else it stays pending in the recorder
        if let Some(r) = self.trace.take().and_then(|t| t.recording) {
            if self.is_completed().unwrap_or(false) {
                r.end(None);
            }
        }
        // SAFETY: we own the handle.
        unsafe { ffi::tdx_work_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work({})", (self.desc)())
    }
}
