//! CUDA streams and events, which tch does not expose: PyTorch's `torch.cuda.Stream`, `torch.cuda.Event`,
//! `with torch.cuda.stream(s)`, `Tensor.record_stream`, `copy_(non_blocking=True)` and pinned memory,
//! through the shim (tch-dist-sys/csrc/stream.cpp). FSDP runs its gathers and reduce-scatters on streams of their own
//! with them, as FSDP2 does.
//!
//! ```no_run
//! use tch::{Device, Kind, Tensor};
//! use tch_dist::stream::{Event, Stream, StreamGuard};
//! let dev = Device::Cuda(0);
//! let (compute, side) = (Stream::current(dev)?, Stream::new(dev)?);
//! let x = Tensor::randn([4096, 4096], (Kind::Float, dev));
//! let y = x.matmul(&x); // on the compute stream
//! side.wait_stream(&compute)?; // the side stream's work comes after it
//! let z = {
//!     let _on = StreamGuard::new(&side)?;
//!     y.sum(Kind::Float)
//! };
//! Event::record(&side)?.block(&compute)?; // and the compute stream's next work after that
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Work on different streams runs in any order unless an event orders it; the caching allocator hands a
//! freed block to the next allocation on the stream it was allocated on, so memory that another stream
//! still uses must be recorded on that stream ([`record_stream`]). Every call is an error off CUDA.
use tch::{Device, Kind, Tensor};

use super::check;
use crate::error::{Error, Result};
use crate::ffi;

/// A CUDA stream of one device (c10's packed form: id, device index, device type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream([i64; 3]);

fn ok(code: libc::c_int, what: impl FnOnce() -> String) -> Result<()> {
    check(code, std::time::Duration::ZERO, what)
}

fn cuda_index(device: Device) -> Result<i32> {
    match device {
        Device::Cuda(i) => Ok(i as i32),
        other => Err(Error::invalid("CUDA stream", format!("{other:?} has no streams: streams are CUDA's"))),
    }
}

impl Stream {
    /// A stream from the device's pool (`torch.cuda.Stream(device)`).
    pub fn new(device: Device) -> Result<Stream> {
        Stream::pool(device, 0)
    }

    /// A high-priority stream from the device's pool: its kernels go before queued ones of normal
    /// priority (FSDP2's for communication, so that copies and collectives do not wait behind compute).
    pub fn high_priority(device: Device) -> Result<Stream> {
        Stream::pool(device, 1)
    }

    fn pool(device: Device, high: libc::c_int) -> Result<Stream> {
        let i = cuda_index(device)?;
        let mut s = [0i64; 3];
        // SAFETY: `s` has the three slots the shim writes.
        ok(unsafe { ffi::tdx_stream_pool(i, high, s.as_mut_ptr()) }, || format!("a stream of {device:?}"))?;
        Ok(Stream(s))
    }

    /// The calling thread's current stream on `device` (`torch.cuda.current_stream`).
    pub fn current(device: Device) -> Result<Stream> {
        let i = cuda_index(device)?;
        let mut s = [0i64; 3];
        // SAFETY: as in `pool`.
        ok(unsafe { ffi::tdx_stream_current(i, s.as_mut_ptr()) }, || format!("the current stream of {device:?}"))?;
        Ok(Stream(s))
    }

    /// The current stream of `device` on CUDA, none elsewhere (where work runs in order anyway).
    pub(crate) fn current_if_cuda(device: Device) -> Result<Option<Stream>> {
        if device.is_cuda() {
            Stream::current(device).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Makes this stream wait (on the GPU) for what `other` has queued so far.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        if other == self {
            return Ok(());
        }
        Event::record(other)?.block(self)
    }

    fn as_ptr(&self) -> *const i64 {
        self.0.as_ptr()
    }
}

/// Makes a stream current on its device for the calling thread until dropped (`torch.cuda.stream(s)`);
/// kernels launched meanwhile, and collectives posted, queue on it.
pub struct StreamGuard {
    previous: Stream,
    /// The current stream is the thread's: the guard must be dropped on the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl StreamGuard {
    pub fn new(s: &Stream) -> Result<StreamGuard> {
        let mut previous = [0i64; 3];
        // SAFETY: both arrays have three slots.
        ok(unsafe { ffi::tdx_stream_exchange(s.as_ptr(), previous.as_mut_ptr()) }, || "make a stream current".into())?;
        Ok(StreamGuard { previous: Stream(previous), _not_send: std::marker::PhantomData })
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut ignored = [0i64; 3];
        // SAFETY: as in `new`. It cannot fail for a stream that was current a moment ago.
        let _ = unsafe { ffi::tdx_stream_exchange(self.previous.as_ptr(), ignored.as_mut_ptr()) };
    }
}

/// A point in a stream's queue: other streams, or the host, can wait for it (`torch.cuda.Event`).
pub struct Event(std::ptr::NonNull<ffi::tdx_event>);

// SAFETY: a CUDA event may be recorded, waited on and destroyed from any thread; the handle is owned here
// and freed once, in Drop.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// An event recorded now on `s`: it completes once what `s` has queued so far is done.
    pub fn record(s: &Stream) -> Result<Event> {
        let mut p = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid for the call.
        ok(unsafe { ffi::tdx_event_new(&mut p) }, || "create a CUDA event".into())?;
        let e = Event(std::ptr::NonNull::new(p).ok_or_else(|| Error::invalid("CUDA event", "shim returned none"))?);
        // SAFETY: the handle is live and owned; the stream array has three slots.
        ok(unsafe { ffi::tdx_event_record(e.0.as_ptr(), s.as_ptr()) }, || "record a CUDA event".into())?;
        Ok(e)
    }

    /// Makes `s` wait on the GPU for this event; the host goes on.
    pub fn block(&self, s: &Stream) -> Result<()> {
        // SAFETY: as in `record`.
        ok(unsafe { ffi::tdx_event_block(self.0.as_ptr(), s.as_ptr()) }, || "make a stream wait on an event".into())
    }

    /// Makes the host wait for this event.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the handle is live.
        ok(unsafe { ffi::tdx_event_synchronize(self.0.as_ptr()) }, || "wait for a CUDA event".into())
    }

    /// Whether the work before the event is done, without waiting.
    pub fn query(&self) -> Result<bool> {
        let mut done = 0;
        // SAFETY: the handle is live; the out-pointer is valid.
        ok(unsafe { ffi::tdx_event_query(self.0.as_ptr(), &mut done) }, || "query a CUDA event".into())?;
        Ok(done != 0)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: owned, freed once.
        unsafe { ffi::tdx_event_free(self.0.as_ptr()) }
    }
}

/// `t.record_stream(s)`: `t`'s memory, once freed, is not reused before `s` has done what it has queued
/// now. For memory allocated on one stream and used on another.
pub fn record_stream(t: &Tensor, s: &Stream) -> Result<()> {
    // SAFETY: t is live for the call; the stream array has three slots.
    ok(unsafe { ffi::tdx_record_stream(t.as_ptr() as ffi::tdx_tensor, s.as_ptr()) }, || {
        format!("record a stream on {:?}{:?}", t.kind(), t.size())
    })
}

/// `dst.copy_(src, non_blocking=True)`: a copy between pinned host memory and a GPU returns before it
/// ends (the source must stay unchanged, and the destination unread on the host, until an event says so).
pub fn copy_non_blocking(dst: &Tensor, src: &Tensor) -> Result<()> {
    // SAFETY: both tensors are live for the call.
    ok(unsafe { ffi::tdx_copy_non_blocking(dst.as_ptr() as ffi::tdx_tensor, src.as_ptr() as ffi::tdx_tensor) }, || {
        format!("copy {:?}{:?} to {:?} without blocking", src.kind(), src.size(), dst.device())
    })
}

/// An uninitialised tensor in pinned (page-locked) host memory, which copies to and from a GPU can
/// overlap.
pub fn empty_pinned(size: &[i64], kind: Kind) -> Result<Tensor> {
    let dtype = crate::dtype::code(kind).ok_or_else(|| Error::invalid("pinned tensor", format!("dtype {kind:?}")))?;
    let mut out: ffi::tdx_tensor = std::ptr::null_mut();
    // SAFETY: `size` is valid for the call; `out` receives a new tensor.
    let code = unsafe { ffi::tdx_empty_pinned(size.as_ptr(), size.len(), dtype, &mut out) };
    ok(code, || format!("a pinned {kind:?}{size:?}"))?;
    // SAFETY: `out` is the tensor the shim just made for this call.
    unsafe { ffi::adopt(out, "pinned tensor") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_cuda_there_is_no_stream_and_without_a_gpu_asking_for_one_is_an_error() {
        let e = Stream::new(Device::Cpu).expect_err("a stream of the CPU");
        assert!(e.to_string().contains("streams are CUDA's"), "{e}");
        assert_eq!(Stream::current_if_cuda(Device::Cpu).unwrap(), None);
        if tch::Cuda::is_available() {
            return; // the GPU kit checks streams where there is a GPU
        }
        let e = Stream::high_priority(Device::Cuda(0)).expect_err("a CUDA stream without a GPU");
        assert!(e.to_string().contains("a stream of Cuda(0)"), "{e}");
        let e = empty_pinned(&[4], Kind::Float).expect_err("pinned memory without a GPU");
        assert!(e.to_string().contains("pinned"), "{e}");
    }
}
