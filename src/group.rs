//! Process groups over c10d's own backends: Gloo (CPU, and CUDA tensors) and NCCL (`cuda` feature).
use std::ffi::CString;
use std::ptr::NonNull;
use std::time::Duration;

use tch::Tensor;

use crate::error::{check, Error, Result};
use crate::ffi;
use crate::store::{millis, Store};
use crate::verify;
use crate::work::{Finish, Work};

/// PyTorch's default collective timeout for Gloo is 30 minutes; a stuck job should fail sooner by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The communication backend of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Gloo,
    Nccl,
}

impl Backend {
    /// Gloo for CPU tensors, NCCL for CUDA ones (as `torch.distributed` picks).
    pub fn for_device(device: tch::Device) -> Backend {
        match device {
            tch::Device::Cuda(_) => Backend::Nccl,
            _ => Backend::Gloo,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }

    /// The device-type prefix PyTorch gives this backend's store keys.
    pub(crate) fn store_prefix(self) -> &'static str {
        match self {
            Backend::Gloo => "cpu/",
            Backend::Nccl => "cuda/",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Backend> {
        match s.to_ascii_lowercase().as_str() {
            "gloo" => Ok(Backend::Gloo),
            "nccl" => Ok(Backend::Nccl),
            other => Err(Error::invalid("backend", format!("unknown backend {other:?} (gloo or nccl)"))),
        }
    }
}

/// Reduction operators, as `torch.distributed.ReduceOp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Product,
    Min,
    Max,
}

impl ReduceOp {
    fn code(self) -> i32 {
        // c10d::ReduceOp::RedOpType order.
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
        }
    }
}

/// Options for building a group on an existing store.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    pub backend: Backend,
    pub timeout: Duration,
    /// Gloo: the address to bind (e.g. "127.0.0.1"); `None` binds like PyTorch (hostname, else loopback).
    pub hostname: Option<String>,
    /// Gloo worker threads; 0 means PyTorch's default (2 per device).
    pub threads: usize,
    /// Before each collective, check that all ranks pass the same operation, dtype and shape (one small
    /// all_gather), and before each recv, that the sender's tensor matches. Gloo aborts the process on a
    /// size mismatch, so this is on by default; turn it off (or set `TCH_DIST_VERIFY=0`) to save the round
    /// trip once a program is known to be consistent. DDP's bucket collectives never pay it: their shapes
    /// are checked once, at construction.
    pub verify: bool,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            backend: Backend::Gloo,
            timeout: DEFAULT_TIMEOUT,
            hostname: None,
            threads: 0,
            verify: verify_default(),
        }
    }
}

/// `TCH_DIST_VERIFY=0` turns agreement checks off by default.
pub fn verify_default() -> bool {
    !matches!(std::env::var("TCH_DIST_VERIFY").as_deref(), Ok("0") | Ok("false") | Ok("off"))
}

/// A group of `size` ranks that run collectives together; this process is `rank`.
///
/// ```no_run
/// use tch_dist::{ProcessGroup, ReduceOp};
/// let pg = ProcessGroup::from_env()?;          // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
/// let mut t = tch::Tensor::ones([4], (tch::Kind::Float, tch::Device::Cpu));
/// pg.allreduce(&mut t, ReduceOp::Sum)?;          // every element is now WORLD_SIZE
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub struct ProcessGroup {
    ptr: NonNull<ffi::tdx_pg>,
    rank: usize,
    size: usize,
    backend: Backend,
    timeout: Duration,
    verify: bool,
    hostname: Option<String>,
    // The group's rendezvous store: kept alive with the group (as Python does), and the parent of
    // subgroups' stores.
    store: Store,
}

// SAFETY: c10d backends queue work under their own locks. As in PyTorch, callers must still issue
// collectives in the same order on every rank.
unsafe impl Send for ProcessGroup {}
unsafe impl Sync for ProcessGroup {}

fn describe(t: &Tensor) -> String {
    format!("{:?}{:?} on {:?}", t.kind(), t.size(), t.device())
}

impl ProcessGroup {
    /// Builds a group on `store`. Blocks until all `size` ranks joined, at most `opts.timeout`.
    pub fn new(store: &Store, rank: usize, size: usize, opts: &GroupOptions) -> Result<ProcessGroup> {
        if size == 0 || rank >= size {
            return Err(Error::invalid(
                "ProcessGroup::new",
                format!("rank {rank} is not in a group of size {size} (need 0 <= rank < size)"),
            ));
        }
        let mut out = std::ptr::null_mut();
        let what = || format!("{} process group (rank {rank} of {size})", opts.backend.name());
        let code = match opts.backend {
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
            // SAFETY: the store handle is valid for the call.
            Backend::Nccl => unsafe {
                ffi::tdx_pg_nccl(store.as_ptr(), rank as i32, size as i32, millis(opts.timeout), &mut out)
            },
        };
        check(code, opts.timeout, what)?;
        let ptr = NonNull::new(out).ok_or_else(|| Error::invalid(what(), "shim returned a null group"))?;
        Ok(ProcessGroup { ptr, rank, size, backend: opts.backend, timeout: opts.timeout, verify: opts.verify, hostname: opts.hostname.clone(), store: store.clone() })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn size(&self) -> usize {
        self.size
    }
    pub fn backend(&self) -> Backend {
        self.backend
    }
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// A group of the given ranks of this one (as `torch.distributed.new_group`). Only the members call
    /// it (others get `None` without talking to anyone); `name` keeps different subgroups of the same
    /// ranks apart. Member `ranks[i]` is rank `i` of the subgroup.
    pub fn new_subgroup(&self, ranks: &[usize], name: &str) -> Result<Option<ProcessGroup>> {
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.size) {
            return Err(Error::invalid("new_subgroup", format!("rank {r} is not in a group of size {}", self.size)));
        }
        let Some(me) = ranks.iter().position(|&r| r == self.rank) else { return Ok(None) };
        let key = format!("subgroup/{name}/{}/", ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(","));
        let opts = GroupOptions {
            backend: self.backend,
            timeout: self.timeout,
            hostname: self.hostname.clone(),
            threads: 0,
            verify: self.verify,
        };
        ProcessGroup::new(&self.store.prefixed(&key)?, me, ranks.len(), &opts).map(Some)
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::tdx_pg {
        self.ptr.as_ptr()
    }

    /// Whether collectives check agreement across ranks first (see [`GroupOptions::verify`]).
    pub fn verifies(&self) -> bool {
        self.verify
    }
    pub fn set_verify(&mut self, on: bool) {
        self.verify = on;
    }

    fn meta_device(&self, t: &Tensor) -> tch::Device {
        match self.backend {
            Backend::Gloo => tch::Device::Cpu,
            Backend::Nccl => t.device(),
        }
    }

    fn agree(&self, what: &str, op: i64, t: &Tensor, extra: i64) -> Result<()> {
        if self.verify {
            verify::agree(self, what, verify::fingerprint(op, t, extra), self.meta_device(t))?;
        }
        Ok(())
    }

    fn ctx(&self) -> String {
        format!("rank {} of {} ({})", self.rank, self.size, self.backend.name())
    }

    /// The engine's op code for `op` on tensor `t`, and what to do after the wait. Gloo has no AVG: it
    /// runs SUM and the finish step divides by the group size.
    fn reduction(&self, desc: &str, op: ReduceOp, t: &Tensor) -> Result<(i32, Option<Finish>)> {
        if op != ReduceOp::Avg {
            return Ok((op.code(), None));
        }
        if !t.is_floating_point() {
            return Err(Error::invalid(desc.to_string(), "ReduceOp::Avg needs a floating-point tensor"));
        }
        if self.backend != Backend::Gloo {
            return Ok((op.code(), None));
        }
        let mut target = t.shallow_clone();
        let n = self.size as f64;
        let finish: Finish = Box::new(move || {
            let _ = target.f_div_scalar_(n)?;
            Ok(())
        });
        Ok((ReduceOp::Sum.code(), Some(finish)))
    }

    /// Starts an operation through `start` and wraps the handle it returns.
    fn launch(
        &self,
        op: String,
        start: impl FnOnce(*mut ffi::tdx_pg, *mut *mut ffi::tdx_work) -> libc::c_int,
        finish: Option<Finish>,
    ) -> Result<Work> {
        let mut out = std::ptr::null_mut();
        let code = start(self.ptr.as_ptr(), &mut out);
        let ctx = self.ctx();
        let desc = move || format!("{op} on {ctx}");
        check(code, self.timeout, &desc)?;
        Ok(Work::new(out, self.timeout, Box::new(desc), finish))
    }

    fn check_peer(&self, what: &str, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::invalid(
                what.to_string(),
                format!("rank {peer} is out of range for a group of size {} ({})", self.size, self.ctx()),
            ));
        }
        Ok(())
    }

    /// Reduces `t` across all ranks in place; every rank gets the result.
    pub fn allreduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.allreduce_async(t, op)?.wait()
    }

    /// Asynchronous [`allreduce`](Self::allreduce). Gloo has no AVG: it runs SUM and divides on `wait`.
    pub fn allreduce_async(&self, t: &mut Tensor, op: ReduceOp) -> Result<Work> {
        let desc = format!("allreduce({op:?}) of {}", describe(t));
        // refuse bad input before talking to other ranks
        let (code, finish) = self.reduction(&desc, op, t)?;
        self.agree("allreduce", 1, t, op.code() as i64)?;
        self.launch_allreduce(t, desc, code, finish)
    }

    /// [`allreduce_async`](Self::allreduce_async) without the agreement check, for callers that
    /// established agreement once (DDP buckets).
    pub(crate) fn allreduce_unverified(&self, t: &mut Tensor, op: ReduceOp) -> Result<Work> {
        let desc = format!("allreduce({op:?}) of {}", describe(t));
        let (code, finish) = self.reduction(&desc, op, t)?;
        self.launch_allreduce(t, desc, code, finish)
    }

    fn launch_allreduce(&self, t: &mut Tensor, desc: String, code: i32, finish: Option<Finish>) -> Result<Work> {
        let tp = t.as_mut_ptr() as ffi::tdx_tensor;
        // SAFETY: the tensor pointer is valid for the call; the shim copies the at::Tensor (shared storage).
        self.launch(desc, |pg, out| unsafe { ffi::tdx_pg_allreduce(pg, tp, code, out) }, finish)
    }

    /// Copies `t` from rank `root` to every rank, in place.
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        self.broadcast_async(t, root)?.wait()
    }

    pub fn broadcast_async(&self, t: &mut Tensor, root: usize) -> Result<Work> {
        self.check_peer("broadcast root", root)?;
        self.agree("broadcast", 2, t, root as i64)?;
        self.broadcast_unverified(t, root)
    }

    pub(crate) fn broadcast_unverified(&self, t: &mut Tensor, root: usize) -> Result<Work> {
        let desc = format!("broadcast from rank {root} of {}", describe(t));
        let tp = t.as_mut_ptr() as ffi::tdx_tensor;
        // SAFETY: as in allreduce_async.
        self.launch(desc, |pg, out| unsafe { ffi::tdx_pg_broadcast(pg, tp, root as i32, out) }, None)
    }

    /// Gathers every rank's `input` into `outputs[r]` (one tensor per rank, same shape as `input`).
    pub fn all_gather(&self, outputs: &mut [Tensor], input: &Tensor) -> Result<()> {
        self.all_gather_async(outputs, input)?.wait()
    }

    pub fn all_gather_async(&self, outputs: &mut [Tensor], input: &Tensor) -> Result<Work> {
        self.agree("all_gather", 3, input, 0)?;
        self.all_gather_unverified(outputs, input)
    }

    pub(crate) fn all_gather_unverified(&self, outputs: &mut [Tensor], input: &Tensor) -> Result<Work> {
        let desc = format!("all_gather of {}", describe(input));
        if outputs.len() != self.size {
            return Err(Error::invalid(desc, format!("{} output tensors for {} ranks", outputs.len(), self.size)));
        }
        check_like(&desc, outputs, input)?;
        let mut outs: Vec<ffi::tdx_tensor> = outputs.iter_mut().map(|t| t.as_mut_ptr() as ffi::tdx_tensor).collect();
        let ip = input.as_ptr() as ffi::tdx_tensor;
        let n = outs.len();
        // SAFETY: the pointer array and tensors are valid for the call.
        self.launch(desc, |pg, out| unsafe { ffi::tdx_pg_allgather(pg, outs.as_mut_ptr(), n, ip, out) }, None)
    }

    /// Reduces `inputs[r]` across ranks and leaves rank r's result in `output` (one input per rank).
    pub fn reduce_scatter(&self, output: &mut Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_async(output, inputs, op)?.wait()
    }

    pub fn reduce_scatter_async(&self, output: &mut Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        let desc = format!("reduce_scatter({op:?}) into {}", describe(output));
        if inputs.len() != self.size {
            return Err(Error::invalid(desc, format!("{} input tensors for {} ranks", inputs.len(), self.size)));
        }
        check_like(&desc, inputs, output)?;
        let (code, finish) = self.reduction(&desc, op, output)?;
        self.agree("reduce_scatter", 4, output, op.code() as i64)?;
        let mut ins: Vec<ffi::tdx_tensor> = inputs.iter().map(|t| t.as_ptr() as ffi::tdx_tensor).collect();
        let op_ = output.as_mut_ptr() as ffi::tdx_tensor;
        let n = ins.len();
        // SAFETY: the pointer array and tensors are valid for the call.
        self.launch(
            desc,
            |pg, out| unsafe { ffi::tdx_pg_reduce_scatter(pg, op_, ins.as_mut_ptr(), n, code, out) },
            finish,
        )
    }

    /// Sends `t` to rank `dst`; `tag` must match the receiver's.
    pub fn send(&self, t: &Tensor, dst: usize, tag: i32) -> Result<()> {
        self.send_async(t, dst, tag)?.wait()
    }

    /// With verification on, a small header (dtype and shape) goes first on tag `tag + 2^30`, so the
    /// receiver can refuse a mismatched tensor cleanly.
    pub fn send_async(&self, t: &Tensor, dst: usize, tag: i32) -> Result<Work> {
        self.check_peer("send destination", dst)?;
        if dst == self.rank {
            return Err(Error::invalid("send", format!("rank {dst} cannot send to itself")));
        }
        let header = if self.verify {
            let mut h = Tensor::from_slice(&verify::fingerprint(5, t, 0)).to_device(self.meta_device(t));
            Some(self.send_raw(&mut h, dst, header_tag(tag))?)
        } else {
            None
        };
        let mut work = self.send_raw(t, dst, tag)?;
        if let Some(h) = header {
            work.wait_first(h);
        }
        Ok(work)
    }

    pub(crate) fn send_raw(&self, t: &Tensor, dst: usize, tag: i32) -> Result<Work> {
        let desc = format!("send of {} to rank {dst} (tag {tag})", describe(t));
        let tp = t.as_ptr() as ffi::tdx_tensor;
        // SAFETY: as in allreduce_async.
        self.launch(desc, |pg, out| unsafe { ffi::tdx_pg_send(pg, tp, dst as i32, tag, out) }, None)
    }

    /// Receives into `t` (which must have the sender's shape and dtype) from rank `src`.
    pub fn recv(&self, t: &mut Tensor, src: usize, tag: i32) -> Result<()> {
        self.recv_async(t, src, tag)?.wait()
    }

    /// With verification on, this first receives the sender's header (blocking), and on a dtype or shape
    /// mismatch drains the message into a scratch tensor and returns [`Error::Mismatch`].
    pub fn recv_async(&self, t: &mut Tensor, src: usize, tag: i32) -> Result<Work> {
        self.check_peer("recv source", src)?;
        if src == self.rank {
            return Err(Error::invalid("recv", format!("rank {src} cannot receive from itself")));
        }
        if self.verify {
            let mine = verify::fingerprint(5, t, 0);
            let mut h = Tensor::zeros([verify::LEN as i64], (tch::Kind::Int64, self.meta_device(t)));
            self.recv_raw(&mut h, src, header_tag(tag))?.wait()?;
            let theirs = Vec::<i64>::try_from(h.to_device(tch::Device::Cpu))?;
            if theirs[..] != mine[..] {
                let msg = format!(
                    "rank {src} sent {} but rank {} posted {}",
                    verify::render(&theirs),
                    self.rank,
                    verify::render(&mine)
                );
                if let Some(mut scratch) = verify::tensor_for(&theirs, t.device()) {
                    self.recv_raw(&mut scratch, src, tag)?.wait()?;
                }
                return Err(Error::mismatch(format!("recv from rank {src} (tag {tag})"), msg));
            }
        }
        self.recv_raw(t, src, tag)
    }

    pub(crate) fn recv_raw(&self, t: &mut Tensor, src: usize, tag: i32) -> Result<Work> {
        let desc = format!("recv of {} from rank {src} (tag {tag})", describe(t));
        let tp = t.as_mut_ptr() as ffi::tdx_tensor;
        // SAFETY: as in allreduce_async.
        self.launch(desc, |pg, out| unsafe { ffi::tdx_pg_recv(pg, tp, src as i32, tag, out) }, None)
    }

    /// Blocks until every rank reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async()?.wait()
    }

    pub fn barrier_async(&self) -> Result<Work> {
        // SAFETY: the group handle is valid.
        self.launch("barrier".to_string(), |pg, out| unsafe { ffi::tdx_pg_barrier(pg, out) }, None)
    }

    /// Sets the timeout of later collectives.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        // SAFETY: the group handle is valid.
        let code = unsafe { ffi::tdx_pg_set_timeout(self.ptr.as_ptr(), millis(timeout)) };
        check(code, timeout, || format!("set_timeout on {}", self.ctx()))?;
        self.timeout = timeout;
        Ok(())
    }
}

fn header_tag(tag: i32) -> i32 {
    tag.wrapping_add(1 << 30)
}

fn check_like(desc: &str, ts: &[Tensor], like: &Tensor) -> Result<()> {
    let (kind, size, device) = (like.kind(), like.size(), like.device());
    for (i, t) in ts.iter().enumerate() {
        if t.kind() != kind || t.size() != size || t.device() != device {
            return Err(Error::mismatch(
                desc.to_string(),
                format!("tensor {i} is {} but must match {}", describe(t), describe(like)),
            ));
        }
    }
    Ok(())
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: we own the handle.
        unsafe { ffi::tdx_pg_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup({})", self.ctx())
    }
}
