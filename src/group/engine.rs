//! One c10d backend (a `ProcessGroupGloo` or `ProcessGroupNCCL`) behind the shim's handle, and the
//! process's list of them: shut down as PyTorch's `destroy_process_group` does (c10d's `shutdown()`:
//! pending work completes, then the communicators go), newest first so that subgroups go before their
//! parent, by [`shutdown_all`] and at the process's exit. Without it `~ProcessGroupNCCL` aborts the
//! communicators of a group with work still queued, and a group a process never dropped (the default
//! group, in a static) would lose its queued collectives when `main` returns.
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

use super::{Backend, GroupOptions};
use crate::error::{Error, Result};
use crate::ffi;
use crate::ffi::c10d::{GlooArgs, NcclArgs, Pg};
use crate::ffi::check;
use crate::flight::GroupTrace;
use crate::store::{millis, Store};

pub(crate) struct Engine {
    pg: Pg,
    pub backend: Backend,
    /// The group's trace: a wait of it that gave up on a collective while it still ran (a peer stopped
    /// heartbeating) leaves the engine's threads waiting on that peer until the collective timeout, so
    /// such an engine is aborted, never waited for.
    trace: Arc<GroupTrace>,
    /// The group's timeout when it was built: how long a shutdown lets queued work drain.
    timeout: Duration,
    /// Shut down already (its handle stays valid; the shim refuses further work on it).
    shut: AtomicBool,
    /// Work queued above the engine that a shutdown lets reach it first (the strict mode's queues), each
    /// waited for until the deadline.
    drains: Mutex<Vec<Drain>>,
}

/// Lets work queued above an engine reach it, waiting at most until the deadline.
pub(crate) type Drain = Box<dyn Fn(std::time::Instant) + Send + Sync>;

/// How an engine is made, beyond its store and place.
pub(crate) struct Creation<'a> {
    /// c10d's group name and description (NCCL's logs, the flight recorder's dumps).
    pub name: &'a str,
    pub desc: &'a str,
    /// NCCL: split the communicator from this group's (every rank of it forms its own part of the
    /// partition, in the same order) with this color.
    pub split: Option<(&'a Engine, i32)>,
    /// NCCL with a device: create the communicator now, not at the first collective.
    pub eager: bool,
}

/// Every engine of the process, oldest first.
static LIVE: Mutex<Vec<Weak<Engine>>> = Mutex::new(Vec::new());
/// The exit hook, registered at the first engine and again at the first NCCL one: handlers run in
/// reverse order of registration, and this one must run before the CUDA runtime's own teardown, which
/// it registers when CUDA starts (at the latest, with the first NCCL group).
static AT_EXIT: Once = Once::new();
static AT_EXIT_NCCL: Once = Once::new();

/// How long a shutdown lets work queued above the engine reach it.
const DRAIN_WAIT: Duration = Duration::from_secs(5);

/// How long the exit waits for the groups' pending work before it goes without it.
const EXIT_WAIT: Duration = Duration::from_secs(60);

fn register(e: &Arc<Engine>) {
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(e));
    // `exit_hook` never unwinds
    let hook = || ffi::at_exit(exit_hook);
    AT_EXIT.call_once(hook);
    if e.backend == Backend::Nccl {
        AT_EXIT_NCCL.call_once(hook);
    }
}

extern "C" fn exit_hook() {
    // the process is ending: whatever is left is shut down, its pending work first, but a peer that
    // never comes must not hold the exit (a panic must not unwind into libc)
    let _ = std::panic::catch_unwind(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new().name("tdx-exit".into()).spawn(move || {
            let _ = tx.send(shutdown_all());
        });
        if spawned.is_ok() && rx.recv_timeout(EXIT_WAIT).is_err() {
            eprintln!(
                "tch-dist: at exit, the process groups' pending collectives did not complete within {EXIT_WAIT:?}; \
                 exiting without them"
            );
        }
    });
}

/// Shuts every engine of the process down, newest first (subgroups before the groups they came from);
/// later operations on them fail with an error naming the shutdown. The first failure is returned after
/// all were tried.
pub(crate) fn shutdown_all() -> Result<()> {
    let engines: Vec<Arc<Engine>> = {
        let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.iter().rev().filter_map(Weak::upgrade).collect()
    };
    let mut first = None;
    for e in engines {
        if let Err(err) = e.shutdown() {
            first.get_or_insert(err);
        }
    }
    first.map_or(Ok(()), Err)
}

impl Engine {
    /// Builds the engine on `store` (already under its device prefix). Blocks until all ranks joined.
    pub(crate) fn new(
        store: &Store,
        backend: Backend,
        (rank, size): (usize, usize),
        opts: &GroupOptions,
        cuda_device: Option<usize>,
        how: Creation<'_>,
        trace: Arc<GroupTrace>,
    ) -> Result<Arc<Engine>> {
        let what = || format!("{backend} process group (rank {rank} of {size})");
        let c_str = |v: &str| CString::new(v).map_err(|_| Error::invalid(what(), format!("{v:?} contains a NUL byte")));
        let timeout_ms = millis(opts.timeout);
        let (code, pg) = match backend {
            Backend::Gloo => {
                let host = opts.hostname.as_deref().map(c_str).transpose()?;
                let a = GlooArgs { rank, size, timeout_ms, hostname: host.as_deref(), threads: opts.threads };
                Pg::gloo(store, &a)
            }
            Backend::Nccl => {
                let (name, desc) = (c_str(how.name)?, c_str(how.desc)?);
                let split = how.split.filter(|(p, _)| p.backend == Backend::Nccl).map(|(p, c)| (&p.pg, c));
                let a = NcclArgs {
                    rank,
                    size,
                    timeout_ms,
                    device: cuda_device,
                    name: &name,
                    desc: &desc,
                    split,
                    eager: how.eager,
                };
                Pg::nccl(store, &a)
            }
        };
        check(code, opts.timeout, what)?;
        let pg = pg.ok_or_else(|| Error::invalid(what(), "shim returned a null group"))?;
        let e = Arc::new(Engine {
            pg,
            backend,
            trace,
            timeout: opts.timeout,
            shut: AtomicBool::new(false),
            drains: Mutex::new(Vec::new()),
        });
        register(&e);
        Ok(e)
    }

    /// Registers work queued above the engine, which a shutdown lets reach it before the engine goes.
    pub(crate) fn before_shutdown(&self, drain: Drain) {
        self.drains.lock().unwrap_or_else(|p| p.into_inner()).push(drain);
    }

    /// Whether [`shutdown`](Self::shutdown) ran.
    pub(crate) fn is_shut(&self) -> bool {
        self.shut.load(Ordering::SeqCst)
    }

    /// c10d's `shutdown()`: pending work completes, then the backend is destroyed. A group given up on
    /// (a frozen peer) is aborted instead, so that this never waits on that peer. Once only.
    pub(crate) fn shutdown(&self) -> Result<()> {
        if self.shut.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        // NCCL's shutdown flushes what is queued: after a failure that may wait for a peer that never
        // comes, so a failed NCCL group is aborted (Gloo's engine fails its queued work by itself)
        let abort = self.trace.abandoned() || (self.backend == Backend::Nccl && self.trace.failed());
        if !abort {
            // what was posted above the engine reaches it first, as NCCL flushes what it has queued
            // briefly: what a healthy peer takes is milliseconds; an ending process must not linger on one
            // that is gone
            let deadline = std::time::Instant::now() + self.timeout.min(DRAIN_WAIT);
            let drains = std::mem::take(&mut *self.drains.lock().unwrap_or_else(|p| p.into_inner()));
            for d in drains {
                d(deadline);
            }
        }
        let code = self.pg.shutdown(abort);
        check(code, Duration::ZERO, || {
            format!("shutting down the {} process group {:?}", self.backend, self.trace.name)
        })
    }

    /// The c10d backend.
    pub(crate) fn pg(&self) -> &Pg {
        &self.pg
    }

    pub(crate) fn set_timeout(&self, timeout: Duration) -> Result<()> {
        let code = self.pg.set_timeout(millis(timeout));
        check(code, timeout, || format!("set_timeout ({})", self.backend))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // errors of a shutdown nobody waits for have nowhere to go
        // (the backend is freed after this, with the fields)
        let _ = self.shutdown();
    }
}
