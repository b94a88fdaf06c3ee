//! Handles to collectives in flight, as `torch.distributed`'s `Work` objects.
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ffi::c10d::WorkHandle;
use crate::ffi::check;
use crate::flight::{GroupTrace, HeartbeatWatch, Recording, HEARTBEAT_CHECK_EVERY};
use crate::store::millis;

/// A step run once after a successful wait.
pub(crate) type Finish = Box<dyn FnOnce() -> Result<()> + Send>;

/// An asynchronous collective or point-to-point operation. Wait on it before reading the tensors it writes.
/// Dropping it without waiting is allowed: the operation still runs to completion in the background.
#[must_use = "a collective's result is only valid after wait()"]
pub struct Work {
    handle: Handle,
    timeout: Duration,
    desc: Box<dyn Fn() -> String + Send>,
    // Runs once after a successful wait (e.g. the division that turns SUM into AVG on Gloo).
    finish: Option<Finish>,
    // Works that must complete before this one counts as done (e.g. a send's header).
    before: Vec<Work>,
    // Where the flight recorder keeps this operation (ended once, when waited for or dropped).
    trace: Option<WorkTrace>,
    // The storages it uses, kept from being freed until it is waited for.
    in_use: Option<crate::storage::InUse>,
}

/// What a work waits on: c10d's own handle, or a ticket that a queue of ours completes (the strict NCCL
/// mode's point-to-point).
pub(crate) enum Handle {
    Engine { work: WorkHandle, stream_wait: bool },
    Ticket(Arc<Ticket>),
}

/// A completion that another thread reports once.
#[derive(Default)]
pub(crate) struct Ticket {
    done: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl Ticket {
    pub(crate) fn complete(&self, r: Result<()>) {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if d.is_none() {
            *d = Some(r);
        }
        self.cv.notify_all();
    }

    /// The outcome, once, if it comes within `slice` (`None`: no limit); `None` when the slice ends first.
    fn wait_slice(&self, slice: Option<Duration>) -> Option<Result<()>> {
        let deadline = slice.map(|t| Instant::now() + t);
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = d.take() {
                // later waits (there are none: wait consumes the work) would see success
                *d = Some(Ok(()));
                return Some(r);
            }
            match deadline {
                None => d = self.cv.wait(d).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    d = self.cv.wait_timeout(d, left).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
    }

    fn is_done(&self) -> bool {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

/// A work's entry in the flight recorder, and its group's sequence number.
pub(crate) struct WorkTrace {
    pub group: Arc<GroupTrace>,
    pub seq: u64,
    pub p2p: bool,
    pub recording: Option<Recording>,
}

// a Work is waited for on any thread (its handle is c10d's, internally synchronised)
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Work>();
};

impl Work {
    pub(crate) fn new(
        work: WorkHandle,
        timeout: Duration,
        desc: Box<dyn Fn() -> String + Send>,
        finish: Option<Finish>,
    ) -> Work {
        Work::with_handle(Handle::Engine { work, stream_wait: false }, timeout, desc, finish)
    }

    pub(crate) fn with_handle(
        handle: Handle,
        timeout: Duration,
        desc: Box<dyn Fn() -> String + Send>,
        finish: Option<Finish>,
    ) -> Work {
        Work { handle, timeout, desc, finish, before: Vec::new(), trace: None, in_use: None }
    }

    /// Keeps the storages of `u` from being freed until this work is waited for or dropped (dropped
    /// unfinished only on a path that failed already).
    pub(crate) fn holding(mut self, u: crate::storage::InUse) -> Work {
        self.in_use = Some(u);
        self
    }

    /// Adds `f` to the steps run once after a successful wait, after the work's own.
    pub(crate) fn then(mut self, f: Finish) -> Work {
        self.finish = Some(match self.finish.take() {
            None => f,
            Some(first) => Box::new(move || {
                first()?;
                f()
            }),
        });
        self
    }

    pub(crate) fn traced(mut self, t: WorkTrace) -> Work {
        self.trace = Some(t);
        self
    }

    /// Waits for completion, at most the group's timeout. On NCCL this returns at once: the current CUDA
    /// stream waits on the operation (as PyTorch's `work.wait()`), and NCCL's watchdog enforces the
    /// timeout.
    pub fn wait(self) -> Result<()> {
        let t = self.timeout;
        self.wait_for(t, true)
    }

    /// Waits at most `timeout`, on the host; an operation still running then is an
    /// [`Error::Timeout`](crate::Error).
    pub fn wait_timeout(self, timeout: Duration) -> Result<()> {
        self.wait_for(timeout, false)
    }

    fn wait_for(self, timeout: Duration, plain: bool) -> Result<()> {
        self.wait_until(Instant::now() + timeout, timeout, plain)
    }

    /// Waits until `deadline`, for this work and the ones before it; a timeout is reported as `whole`
    /// (the wait's, not what was left of it for the last part).
    fn wait_until(mut self, deadline: Instant, whole: Duration, plain: bool) -> Result<()> {
        let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        for w in std::mem::take(&mut self.before) {
            w.wait_until(deadline, whole, plain)?;
        }
        let timeout = left();
        let waited = match &self.handle {
            Handle::Engine { work, stream_wait } if plain && *stream_wait => self.engine_wait(work, None, whole),
            // waited for whole: c10d's Gloo send and recv fail for good when a wait times out, and
            // NCCL's wait with a timeout counts from the work's start and aborts the communicator
            Handle::Engine { work, stream_wait } if *stream_wait || self.trace.as_ref().is_some_and(|t| t.p2p) => {
                self.engine_wait(work, Some(timeout), whole)
            }
            Handle::Engine { work, .. } => self.watching(Some(timeout), whole, |slice| {
                let slice = slice.unwrap_or(timeout);
                match self.engine_wait(work, Some(slice), slice) {
                    Ok(()) => Some(Ok(())),
                    // still running: the slice ended
                    Err(_) if !self.is_completed().unwrap_or(true) => None,
                    // it ended (perhaps as the slice did): c10d's wait again gives its own outcome
                    Err(_) => Some(self.engine_wait(work, Some(Duration::from_millis(1)), whole)),
                }
            }),
            // the queue's worker holds each operation to the group's timeout (as NCCL's watchdog does)
            // and reports why it failed: a plain wait leaves that to it
            Handle::Ticket(t) if plain => self.watching(None, whole, |slice| t.wait_slice(slice)),
            Handle::Ticket(t) => self.watching(Some(timeout), whole, |slice| t.wait_slice(slice)),
        };
        if waited.is_ok() {
            // on NCCL the stream now waits on the operation: what runs next on it comes after
            drop(self.in_use.take());
        } else if self.trace.as_ref().is_some_and(|t| t.group.abandoned()) {
            // given up on while it runs (a frozen peer): the engine may still write into these; the
            // process is ending on this error, so they are never freed
            std::mem::forget(self.in_use.take());
        }
        if let Some(mut t) = self.trace.take() {
            match waited {
                Ok(()) => {
                    match (&self.handle, t.recording.take()) {
                        // the stream waits; the GPU may still run it: it is complete when its end event
                        // is, which the group's trace polls
                        (Handle::Engine { work, stream_wait: true }, Some(r)) if plain => {
                            match crate::flight::EngineProbe::of(work) {
                                Some(probe) => t.group.end_when_done(r, probe),
                                None => r.end(None),
                            }
                        }
                        (_, Some(r)) => r.end(None),
                        (_, None) => {}
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

    /// c10d's wait on the engine's handle: at most `limit` (`None`: without one, which on NCCL makes the
    /// current stream wait and returns); errors name this work and `timeout`.
    fn engine_wait(&self, work: &WorkHandle, limit: Option<Duration>, timeout: Duration) -> Result<()> {
        let code = work.wait(limit.map_or(-1, millis));
        check(code, timeout, || (self.desc)())
    }

    /// A host wait of at most `timeout` (`None`: the engine's own), in slices of
    /// [`HEARTBEAT_CHECK_EVERY`] when the group watches heartbeats: between slices, a rank whose heartbeat
    /// stood still for the heartbeat timeout ends the wait. `wait` waits at most one slice (`None`: no
    /// limit) and returns the operation's outcome, or `None` when the slice ended first. A timeout is
    /// reported as `whole`.
    fn watching(
        &self,
        timeout: Option<Duration>,
        whole: Duration,
        mut wait: impl FnMut(Option<Duration>) -> Option<Result<()>>,
    ) -> Result<()> {
        let expired =
            || Error::Timeout { op: (self.desc)(), timeout: whole, msg: "the operation did not complete".into() };
        let Some(group) = self.trace.as_ref().map(|t| &t.group).filter(|g| g.watches_heartbeats()) else {
            return wait(timeout).unwrap_or_else(|| Err(expired()));
        };
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut watch = HeartbeatWatch::default();
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
            let last = left.is_some_and(|l| l <= HEARTBEAT_CHECK_EVERY);
            let slice = left.map_or(HEARTBEAT_CHECK_EVERY, |l| l.min(HEARTBEAT_CHECK_EVERY));
            if let Some(outcome) = wait(Some(slice)) {
                return outcome;
            }
            if last {
                return Err(expired());
            }
            if let Some(e) = group.frozen_peer(&mut watch, &(self.desc)()) {
                return Err(e);
            }
        }
    }

    pub(crate) fn wait_first(&mut self, w: Work) {
        self.before.push(w);
    }

    /// Whether the operation has finished (successfully or not), without blocking.
    pub fn is_completed(&self) -> Result<bool> {
        let mine = match &self.handle {
            Handle::Engine { work, .. } => {
                let (code, done) = work.is_completed();
                check(code, self.timeout, || (self.desc)())?;
                done
            }
            Handle::Ticket(t) => t.is_done(),
        };
        for w in &self.before {
            if !w.is_completed()? {
                return Ok(false);
            }
        }
        Ok(mine)
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
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work({})", (self.desc)())
    }
}
