//! Safe wrappers of the shim's c10d backends (`ProcessGroupGloo`, `ProcessGroupNCCL`): a backend and a
//! work, each owned and freed when dropped, the collectives and point-to-point operations posted on a
//! backend, the autograd ops whose collectives the shim runs, and c10d's NCCL flight recorder's dump.
//! Each call returns the shim's code, which the caller turns into an error naming the operation.
use std::ffi::CStr;
use std::ptr::NonNull;

use libc::c_int;
use tch::Tensor;

use super::store::Store;
use super::{adopt, handle, tdx_tensor};

/// What posting an operation gives: the shim's code, and on success the operation's work.
pub(crate) type Posted = (c_int, Option<WorkHandle>);

/// What an autograd op gives: the shim's code, and on success its output.
pub(crate) type Made = (c_int, Option<Tensor>);

/// A c10d work, owned.
pub(crate) struct WorkHandle(NonNull<super::tdx_work>);

// SAFETY: c10d::Work is internally synchronised (mutex + condition variable); the handle is freed once,
// in Drop.
unsafe impl Send for WorkHandle {}

impl WorkHandle {
    /// c10d's wait, at most `limit_ms` (-1: its own timeout; on NCCL, the current stream waits).
    pub(crate) fn wait(&self, limit_ms: i64) -> c_int {
        // SAFETY: the handle is owned and live.
        unsafe { super::tdx_work_wait(self.0.as_ptr(), limit_ms) }
    }

    /// Whether it completed (successfully or not), and the shim's code.
    pub(crate) fn is_completed(&self) -> (c_int, bool) {
        let mut out = 0;
        // SAFETY: the handle is owned and live; `out` is valid for the call.
        let code = unsafe { super::tdx_work_is_completed(self.0.as_ptr(), &mut out) };
        (code, out != 0)
    }

    /// A second handle to the same work (to poll from another thread), if the shim gives one.
    pub(crate) fn probe(&self) -> Option<WorkHandle> {
        let mut out = std::ptr::null_mut();
        // SAFETY: the handle is live; the clone the shim makes is owned by the value returned.
        let code = unsafe { super::tdx_work_clone(self.0.as_ptr(), &mut out) };
        (code == super::TDX_OK).then(|| NonNull::new(out).map(WorkHandle)).flatten()
    }
}

impl Drop for WorkHandle {
    fn drop(&mut self) {
        // SAFETY: owned, freed once; the operation itself runs on inside c10d.
        unsafe { super::tdx_work_free(self.0.as_ptr()) }
    }
}

/// A work the shim left in `out` when `code` says it posted one.
///
/// # Safety
/// `out` is what the shim's call returning `code` left in its out-parameter, taken once.
unsafe fn posted(code: c_int, out: *mut super::tdx_work) -> Posted {
    (code, if code == super::TDX_OK { NonNull::new(out).map(WorkHandle) } else { None })
}

/// A tensor the shim left in `out` when `code` says it made one.
///
/// # Safety
/// `out` is what the shim's call returning `code` left in its out-parameter, taken once.
unsafe fn made(code: c_int, out: tdx_tensor, what: &str) -> Made {
    if code != super::TDX_OK {
        return (code, None);
    }
    // SAFETY: on success `out` is null or a new tensor the shim made for this call (the caller's
    // contract), adopted once.
    (code, unsafe { adopt(out, what) }.ok())
}

/// One c10d backend, owned.
pub(crate) struct Pg(NonNull<super::tdx_pg>);

// SAFETY: c10d backends queue work under their own locks (callers still post collectives in one order on
// every rank, as in PyTorch); the handle is freed once, in Drop.
unsafe impl Send for Pg {}
unsafe impl Sync for Pg {}

/// How a Gloo backend is made.
pub(crate) struct GlooArgs<'a> {
    pub rank: usize,
    pub size: usize,
    pub timeout_ms: i64,
    pub hostname: Option<&'a CStr>,
    pub threads: usize,
}

/// How an NCCL backend is made.
pub(crate) struct NcclArgs<'a> {
    pub rank: usize,
    pub size: usize,
    pub timeout_ms: i64,
    /// The bound device, or none.
    pub device: Option<usize>,
    pub name: &'a CStr,
    pub desc: &'a CStr,
    /// Split from this backend's communicator with this color.
    pub split: Option<(&'a Pg, i32)>,
    /// Create the communicator now.
    pub eager: bool,
}

impl Pg {
    /// # Safety
    /// `out` is what the shim's call returning `code` left in its out-parameter, taken once.
    unsafe fn made(code: c_int, out: *mut super::tdx_pg) -> (c_int, Option<Pg>) {
        (code, if code == super::TDX_OK { NonNull::new(out).map(Pg) } else { None })
    }

    /// A Gloo backend on `store`; blocks until every rank joined.
    pub(crate) fn gloo(store: &Store, a: &GlooArgs<'_>) -> (c_int, Option<Pg>) {
        let mut out = std::ptr::null_mut();
        let host = a.hostname.map_or(std::ptr::null(), CStr::as_ptr);
        // SAFETY: the store handle and the string are valid for the call.
        let code = unsafe {
            super::tdx_pg_gloo(
                store.as_ptr(),
                a.rank as c_int,
                a.size as c_int,
                a.timeout_ms,
                host,
                a.threads as c_int,
                &mut out,
            )
        };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { Pg::made(code, out) }
    }

    /// An NCCL backend on `store`.
    pub(crate) fn nccl(store: &Store, a: &NcclArgs<'_>) -> (c_int, Option<Pg>) {
        let mut out = std::ptr::null_mut();
        let (parent, color) = a.split.map_or((std::ptr::null_mut(), -1), |(p, c)| (p.0.as_ptr(), c));
        // SAFETY: the store and parent handles and the strings are valid for the call.
        let code = unsafe {
            super::tdx_pg_nccl(
                store.as_ptr(),
                a.rank as c_int,
                a.size as c_int,
                a.timeout_ms,
                a.device.map_or(-1, |d| d as c_int),
                a.name.as_ptr(),
                a.desc.as_ptr(),
                parent,
                color,
                a.eager as c_int,
                &mut out,
            )
        };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { Pg::made(code, out) }
    }

    /// c10d's `shutdown()` (pending work completes first), or its abort.
    pub(crate) fn shutdown(&self, abort: bool) -> c_int {
        // SAFETY: the handle is live; the shim serialises this with calls in flight.
        unsafe { super::tdx_pg_shutdown(self.0.as_ptr(), abort as c_int) }
    }

    pub(crate) fn set_timeout(&self, timeout_ms: i64) -> c_int {
        // SAFETY: the handle is live.
        unsafe { super::tdx_pg_set_timeout(self.0.as_ptr(), timeout_ms) }
    }

    // The operations: each tensor is borrowed for the call, and c10d's work keeps its own references
    // (and copies of the split and peer arrays) until it completes.

    pub(crate) fn allreduce(&self, t: &Tensor, op: c_int) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: the handle and the tensor are live for the call (see above).
        unsafe { posted(super::tdx_pg_allreduce(self.0.as_ptr(), handle(t), op, &mut out), out) }
    }

    pub(crate) fn broadcast(&self, t: &Tensor, root: usize) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce.
        unsafe { posted(super::tdx_pg_broadcast(self.0.as_ptr(), handle(t), root as c_int, &mut out), out) }
    }

    pub(crate) fn allgather(&self, outputs: &[Tensor], input: &Tensor) -> Posted {
        let mut outs: Vec<tdx_tensor> = outputs.iter().map(handle).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce; `outs` holds outputs.len() handles.
        let code =
            unsafe { super::tdx_pg_allgather(self.0.as_ptr(), outs.as_mut_ptr(), outs.len(), handle(input), &mut out) };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { posted(code, out) }
    }

    pub(crate) fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: c_int) -> Posted {
        let mut ins: Vec<tdx_tensor> = inputs.iter().map(handle).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce; `ins` holds inputs.len() handles.
        let code = unsafe {
            super::tdx_pg_reduce_scatter(self.0.as_ptr(), handle(output), ins.as_mut_ptr(), ins.len(), op, &mut out)
        };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { posted(code, out) }
    }

    pub(crate) fn send(&self, t: &Tensor, dst: usize, tag: i32) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce.
        unsafe { posted(super::tdx_pg_send(self.0.as_ptr(), handle(t), dst as c_int, tag, &mut out), out) }
    }

    pub(crate) fn recv(&self, t: &Tensor, src: usize, tag: i32) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce.
        unsafe { posted(super::tdx_pg_recv(self.0.as_ptr(), handle(t), src as c_int, tag, &mut out), out) }
    }

    pub(crate) fn barrier(&self) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: the handle is live.
        unsafe { posted(super::tdx_pg_barrier(self.0.as_ptr(), &mut out), out) }
    }

    pub(crate) fn allgather_base(&self, output: &Tensor, input: &Tensor) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce.
        unsafe { posted(super::tdx_pg_allgather_base(self.0.as_ptr(), handle(output), handle(input), &mut out), out) }
    }

    pub(crate) fn reduce_scatter_base(&self, output: &Tensor, input: &Tensor, op: c_int) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce.
        let code =
            unsafe { super::tdx_pg_reduce_scatter_base(self.0.as_ptr(), handle(output), handle(input), op, &mut out) };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { posted(code, out) }
    }

    /// `all_to_all_single`; empty split lists mean equal chunks.
    pub(crate) fn alltoall_base(
        &self,
        output: &Tensor,
        input: &Tensor,
        out_splits: &[i64],
        in_splits: &[i64],
    ) -> Posted {
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce; each split array is valid for its length.
        let code = unsafe {
            super::tdx_pg_alltoall_base(
                self.0.as_ptr(),
                handle(output),
                handle(input),
                out_splits.as_ptr(),
                out_splits.len(),
                in_splits.as_ptr(),
                in_splits.len(),
                &mut out,
            )
        };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { posted(code, out) }
    }

    /// `batch_isend_irecv`: `(tensor, peer, send, tag)` for each operation, posted as one batch.
    pub(crate) fn batch_p2p(&self, ops: &[(&Tensor, usize, bool, i32)]) -> Posted {
        let mut ts: Vec<tdx_tensor> = ops.iter().map(|o| handle(o.0)).collect();
        let peers: Vec<c_int> = ops.iter().map(|o| o.1 as c_int).collect();
        let sends: Vec<c_int> = ops.iter().map(|o| o.2 as c_int).collect();
        let tags: Vec<c_int> = ops.iter().map(|o| o.3).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: as in allreduce; the four arrays hold ops.len() entries each.
        let code = unsafe {
            super::tdx_pg_batch_p2p(
                self.0.as_ptr(),
                ts.as_mut_ptr(),
                peers.as_ptr(),
                sends.as_ptr(),
                tags.as_ptr(),
                ops.len(),
                &mut out,
            )
        };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { posted(code, out) }
    }

    // Autograd ops whose collectives the shim runs on this backend (the node keeps its own reference to
    // the backend, and copies what it needs of the arrays).

    /// Tensor parallelism's conjugate operators (`op`: the shim's code).
    pub(crate) fn tp_op(&self, op: c_int, x: &Tensor) -> Made {
        let mut out: tdx_tensor = std::ptr::null_mut();
        // SAFETY: the handle and the tensor are live for the call.
        unsafe { made(super::tdx_tp_op(self.0.as_ptr(), op, handle(x), &mut out), out, "tensor-parallel op") }
    }

    /// `all_to_all_single` inside autograd; empty split lists mean equal chunks.
    pub(crate) fn all_to_all_op(&self, x: &Tensor, out_splits: &[i64], in_splits: &[i64]) -> Made {
        let mut out: tdx_tensor = std::ptr::null_mut();
        // SAFETY: the handle and the tensor are live for the call; each split array is valid for its length.
        let code = unsafe {
            super::tdx_all_to_all_op(
                self.0.as_ptr(),
                handle(x),
                out_splits.as_ptr(),
                out_splits.len(),
                in_splits.as_ptr(),
                in_splits.len(),
                &mut out,
            )
        };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { made(code, out, "all_to_all") }
    }

    /// SyncBatchNorm's forward (its backward in the same node).
    pub(crate) fn sync_batch_norm(&self, x: &Tensor, p: SyncBnTensors<'_>, eps: f64, momentum: f64) -> Made {
        let opt = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), handle);
        let mut out: tdx_tensor = std::ptr::null_mut();
        // SAFETY: the handle and the tensors are live for the call (null where absent).
        let code = unsafe {
            super::tdx_sync_batch_norm(
                self.0.as_ptr(),
                handle(x),
                opt(p.weight),
                opt(p.bias),
                handle(p.running_mean),
                handle(p.running_var),
                eps,
                momentum,
                &mut out,
            )
        };
        // SAFETY: `out` is the call's out-parameter, taken once.
        unsafe { made(code, out, "SyncBatchNorm") }
    }
}

/// SyncBatchNorm's tensors besides its input.
pub(crate) struct SyncBnTensors<'a> {
    pub weight: Option<&'a Tensor>,
    pub bias: Option<&'a Tensor>,
    pub running_mean: &'a Tensor,
    pub running_var: &'a Tensor,
}

impl Drop for Pg {
    fn drop(&mut self) {
        // SAFETY: owned, freed once; collectives in flight hold their own references inside c10d.
        unsafe { super::tdx_pg_free(self.0.as_ptr()) }
    }
}

/// c10d's NCCL flight recorder's JSON dump (an error without the `cuda` feature).
pub(crate) fn nccl_trace_json() -> crate::Result<Vec<u8>> {
    let mut buf = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: out-pointers valid for the call.
    let code = unsafe { super::tdx_nccl_trace_json(&mut buf, &mut len) };
    crate::ffi::check(code, std::time::Duration::ZERO, || "c10d's NCCL flight recorder".to_string())?;
    // SAFETY: on success `buf` is a malloc'ed buffer of `len` bytes, copied and then freed once.
    let v = unsafe { std::slice::from_raw_parts(buf, len).to_vec() };
    // SAFETY: as above.
    unsafe { super::tdx_buf_free(buf) };
    Ok(v)
}
