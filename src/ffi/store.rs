//! Key-value stores for rendezvous: c10d's `TCPStore` (across processes, wire-compatible with PyTorch),
//! `HashStore` (threads of one process, for tests) and `PrefixStore` (namespaces inside another store).
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::check;
use crate::error::{Error, Result};
use crate::ffi;

/// Timeout of store operations when none is given (PyTorch's TCPStore default, 300 s). Groups have their
/// own (`group::DEFAULT_TIMEOUT`, 600 s), which `init` also gives the store it creates.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A handle to a c10d store. Cloning shares the same store.
///
/// ```no_run
/// use tch_dist::store::{Store, TcpStoreOptions};
/// let s = Store::tcp(&TcpStoreOptions::server("127.0.0.1", 29500, 2))?;
/// s.set("key", b"value")?;
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub struct Store {
    ptr: NonNull<ffi::tdx_store>,
    timeout: Duration,
    desc: String,
    /// A TCPStore's `host:port` and the prefixes over it: what [`Store::shared_connection`] rebuilds.
    origin: Option<(String, Vec<String>)>,
    /// The shared connection this handle is a view of, kept alive while the handle lives.
    _shared: Option<Arc<Store>>,
    /// The first network error of this connection (its server gone), shared by every handle over it:
    /// later calls fail with it at once instead of each failing on the socket again, which c10d reports
    /// with a warning and a C++ stack trace every time.
    broken: Arc<Mutex<Option<String>>>,
}

/// The shared connection of each TCPStore server this process talks to (see
/// [`Store::shared_connection`]); it closes when its last user goes.
static SHARED: Mutex<Vec<(String, Weak<Store>)>> = Mutex::new(Vec::new());

// SAFETY: c10d stores synchronise internally (TCPStore's client holds a mutex, HashStore too).
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

/// Options of a `TCPStore`, as `torch.distributed.TCPStore` takes them.
#[derive(Clone, Debug)]
pub struct TcpStoreOptions {
    pub host: String,
    /// 0 with `is_server` picks a free port; read it back with [`Store::port`].
    pub port: u16,
    pub is_server: bool,
    /// Number of clients the server waits for (`world_size`), if it waits.
    pub num_workers: Option<usize>,
    pub wait_workers: bool,
    pub timeout: Duration,
    /// Several stores may share one host:port (PyTorch's `init_process_group` sets it).
    pub multi_tenant: bool,
    pub use_libuv: bool,
}

impl TcpStoreOptions {
    /// A server (rank 0's side) waiting for `world_size` participants.
    pub fn server(host: &str, port: u16, world_size: usize) -> Self {
        TcpStoreOptions {
            host: host.to_string(),
            port,
            is_server: true,
            num_workers: Some(world_size),
            wait_workers: true,
            timeout: DEFAULT_TIMEOUT,
            multi_tenant: true,
            use_libuv: true,
        }
    }

    /// A client connecting to `host:port`.
    pub fn client(host: &str, port: u16, world_size: usize) -> Self {
        TcpStoreOptions { is_server: false, ..Self::server(host, port, world_size) }
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// A port on `host` that nobody listens on now, for a `TCPStore` whose port the other processes must be
/// told before it starts (`MASTER_PORT`, as `tchrun --standalone` and tests do).
///
/// It is drawn below the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`): the port the
/// OS gives for port 0 comes from the pool that outgoing connections take their local ports from, so
/// between the pick and the server's bind another process's connection (a Gloo pair, a store client) may
/// take it, and the server fails with `EADDRINUSE`. Below that range only listeners compete; successive
/// calls in one process walk the range from a random start, so concurrent callers rarely meet.
pub fn free_port(host: &str) -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    const LOWEST: u32 = 10_000;
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()))
        .unwrap_or(32_768);
    let bind = |port: u32| std::net::TcpListener::bind((host, port as u16)).and_then(|l| l.local_addr());
    if first_ephemeral > LOWEST + 1_000 && first_ephemeral <= 65_536 {
        let span = first_ephemeral - LOWEST;
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
            ^ std::process::id().wrapping_mul(2_654_435_761);
        let _ = NEXT.compare_exchange(u32::MAX, seed % span, Ordering::Relaxed, Ordering::Relaxed);
        for _ in 0..span.min(4_096) {
            let port = LOWEST + NEXT.fetch_add(1, Ordering::Relaxed) % span;
            if bind(port).is_ok() {
                return Ok(port as u16);
            }
        }
    }
    // a kernel whose ephemeral range starts low: the OS's pick, with the race described above
    bind(0).map(|a| a.port()).map_err(|e| Error::invalid("store::free_port", format!("no free port on {host}: {e}")))
}

fn cstr(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(what, format!("{s:?} contains a NUL byte")))
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Store {
    fn wrap(ptr: *mut ffi::tdx_store, timeout: Duration, desc: String) -> Result<Store> {
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::invalid(desc.clone(), "shim returned a null store"))?;
        Ok(Store { ptr, timeout, desc, origin: None, _shared: None, broken: Arc::default() })
    }

    /// Connects to (or, with `is_server`, starts) a TCPStore.
    pub fn tcp(o: &TcpStoreOptions) -> Result<Store> {
        let host = cstr("TCPStore host", &o.host)?;
        let desc = format!("TCPStore {} at {}:{}", if o.is_server { "server" } else { "client" }, o.host, o.port);
        let mut out = std::ptr::null_mut();
        let workers = o.num_workers.map(|n| n as i64).unwrap_or(-1);
        // SAFETY: all pointers are valid for the call; `out` receives an owned handle.
        let code = unsafe {
            ffi::tdx_store_tcp(
                host.as_ptr(),
                o.port,
                o.is_server as i32,
                workers,
                o.wait_workers as i32,
                millis(o.timeout),
                o.multi_tenant as i32,
                o.use_libuv as i32,
                &mut out,
            )
        };
        check(code, o.timeout, || desc.clone())?;
        let mut s = Store::wrap(out, o.timeout, desc)?;
        let port = if o.port == 0 { s.port()? } else { o.port };
        s.origin = Some((format!("{}:{port}", o.host), Vec::new()));
        Ok(s)
    }

    /// An in-process store: ranks that are threads of one process rendezvous through clones of it.
    pub fn hash() -> Result<Store> {
        let mut out = std::ptr::null_mut();
        // SAFETY: `out` receives an owned handle.
        check(unsafe { ffi::tdx_store_hash(&mut out) }, DEFAULT_TIMEOUT, || "HashStore".into())?;
        Store::wrap(out, DEFAULT_TIMEOUT, "HashStore".into())
    }

    /// A view of this store whose keys are prefixed by `prefix` (c10d's `PrefixStore`).
    pub fn prefixed(&self, prefix: &str) -> Result<Store> {
        let p = cstr("PrefixStore prefix", prefix)?;
        let mut out = std::ptr::null_mut();
        // SAFETY: self.ptr is a live handle; `out` receives an owned handle.
        let code = unsafe { ffi::tdx_store_prefix(p.as_ptr(), self.ptr.as_ptr(), &mut out) };
        check(code, self.timeout, || format!("PrefixStore({prefix:?}) over {}", self.desc))?;
        let mut s = Store::wrap(out, self.timeout, format!("{}/{prefix}", self.desc))?;
        s.origin = self.origin.clone().map(|(at, mut prefixes)| {
            prefixes.push(prefix.to_string());
            (at, prefixes)
        });
        s._shared = self._shared.clone();
        s.broken = self.broken.clone();
        Ok(s)
    }

    /// The same store on a connection of its own (c10d's `Store::clone`): a TCPStore client blocked in a
    /// `get` or `wait` holds its connection, so what must never wait behind one (the heartbeat) gets its
    /// own. A HashStore is shared as it is.
    pub(crate) fn connection(&self) -> Result<Store> {
        let mut out = std::ptr::null_mut();
        // SAFETY: self.ptr is a live handle; `out` receives an owned handle.
        let code = unsafe { ffi::tdx_store_clone_connection(self.ptr.as_ptr(), &mut out) };
        check(code, self.timeout, || format!("{}: a connection of its own", self.desc))?;
        let mut s = Store::wrap(out, self.timeout, self.desc.clone())?;
        s.origin = self.origin.clone();
        Ok(s)
    }

    /// The same store on the process's one shared connection to its server, apart from the connections
    /// that rendezvous and user calls block on: for calls that never wait (`set`, `check`, `add`,
    /// `delete`, a `get` of a key known to be set), as the heartbeats and the strict mode's stamps make.
    /// One connection for all of them, not one per group: every new TCPStore connection costs c10d a
    /// reverse lookup of the server's address, which a slow resolver turns into seconds (measured here:
    /// 5 s, one connection in 25). A HashStore is shared as it is.
    pub(crate) fn shared_connection(&self) -> Result<Store> {
        let Some((at, prefixes)) = &self.origin else { return Ok(self.clone()) };
        let live =
            |shared: &[(String, Weak<Store>)]| shared.iter().find(|(a, _)| a == at).and_then(|(_, w)| w.upgrade());
        let found = live(&SHARED.lock().unwrap_or_else(|e| e.into_inner()));
        let root = match found {
            Some(r) => r,
            None => {
                // connected without the lock held: a connection may take seconds
                let (host, port) = at
                    .rsplit_once(':')
                    .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h, p)))
                    .ok_or_else(|| Error::invalid(self.desc.clone(), format!("bad store address {at:?}")))?;
                let opts = TcpStoreOptions {
                    wait_workers: false,
                    num_workers: None,
                    ..TcpStoreOptions::client(host, port, 1)
                };
                let fresh = Arc::new(Store::tcp(&opts.timeout(self.timeout))?);
                let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
                shared.retain(|(a, w)| w.strong_count() > 0 && a != at);
                shared.push((at.clone(), Arc::downgrade(&fresh)));
                fresh
            }
        };
        // a handle over the root shares its connection, and with it the root's broken state
        let mut s = (*root).clone();
        for p in prefixes {
            s = s.prefixed(p)?;
        }
        s.desc = self.desc.clone();
        s._shared = Some(root);
        Ok(s)
    }

    /// Polls until `key` is set, until `deadline` or until `give_up` says so: whether it was set. A
    /// TCPStore wait that times out logs a warning each time; a poll does not, and leaves the connection
    /// free between polls.
    pub(crate) fn poll(&self, key: &str, deadline: Instant, give_up: impl Fn() -> bool) -> Result<bool> {
        let mut pause = Duration::from_micros(200);
        loop {
            if self.check(key)? {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || give_up() {
                return Ok(false);
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Fails at once, naming its first error, when this connection broke before.
    fn usable(&self, op: impl FnOnce() -> String) -> Result<()> {
        match &*self.broken.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(first) => Err(Error::PeerGone {
                op: op(),
                msg: format!("the store's connection broke earlier (its server is gone): {first}"),
            }),
            None => Ok(()),
        }
    }

    /// `check` of a call's code, remembering a network error as this connection's.
    fn outcome(&self, code: libc::c_int, timeout: Duration, op: impl FnOnce() -> String) -> Result<()> {
        let r = check(code, timeout, op);
        if let Err(Error::PeerGone { msg, .. }) = &r {
            self.broken.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(|| msg.clone());
        }
        r
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = cstr("store key", key)?;
        let op = || format!("{}: set {key:?}", self.desc);
        self.usable(op)?;
        // SAFETY: pointers valid for the call.
        let code = unsafe { ffi::tdx_store_set(self.ptr.as_ptr(), k.as_ptr(), value.as_ptr(), value.len()) };
        self.outcome(code, self.timeout, op)
    }

    /// Reads `key`, waiting up to the store's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let k = cstr("store key", key)?;
        let op = || format!("{}: get {key:?}", self.desc);
        self.usable(op)?;
        let mut buf = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: on success `buf` is a malloc'ed buffer of `len` bytes that we copy and free.
        let code = unsafe { ffi::tdx_store_get(self.ptr.as_ptr(), k.as_ptr(), &mut buf, &mut len) };
        self.outcome(code, self.timeout, op)?;
        let v = unsafe { std::slice::from_raw_parts(buf, len).to_vec() };
        unsafe { ffi::tdx_buf_free(buf) };
        Ok(v)
    }

    /// Atomically adds `delta` to the integer at `key` and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = cstr("store key", key)?;
        let op = || format!("{}: add {key:?}", self.desc);
        self.usable(op)?;
        let mut out = 0;
        // SAFETY: pointers valid for the call.
        let code = unsafe { ffi::tdx_store_add(self.ptr.as_ptr(), k.as_ptr(), delta, &mut out) };
        self.outcome(code, self.timeout, op)?;
        Ok(out)
    }

    /// Whether `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool> {
        let k = cstr("store key", key)?;
        let op = || format!("{}: check {key:?}", self.desc);
        self.usable(op)?;
        let mut out = 0;
        // SAFETY: pointers valid for the call.
        let code = unsafe { ffi::tdx_store_check(self.ptr.as_ptr(), k.as_ptr(), &mut out) };
        self.outcome(code, self.timeout, op)?;
        Ok(out != 0)
    }

    /// Removes `key`; whether it was there.
    pub(crate) fn delete(&self, key: &str) -> Result<bool> {
        let k = cstr("store key", key)?;
        let op = || format!("{}: delete {key:?}", self.desc);
        self.usable(op)?;
        let mut out = 0;
        // SAFETY: pointers valid for the call.
        let code = unsafe { ffi::tdx_store_delete(self.ptr.as_ptr(), k.as_ptr(), &mut out) };
        self.outcome(code, self.timeout, op)?;
        Ok(out != 0)
    }

    /// Waits until `key` is set, at most `timeout`.
    pub fn wait(&self, key: &str, timeout: Duration) -> Result<()> {
        let k = cstr("store key", key)?;
        let op = || format!("{}: wait for {key:?}", self.desc);
        self.usable(op)?;
        // SAFETY: pointers valid for the call.
        // at least 1 ms: c10d reads 0 ms as "no timeout", so a deadline nearly reached would wait for ever
        let code = unsafe { ffi::tdx_store_wait(self.ptr.as_ptr(), k.as_ptr(), millis(timeout).max(1)) };
        self.outcome(code, timeout, op)
    }

    /// The port a TCPStore listens on or connects to (useful after asking for port 0).
    pub fn port(&self) -> Result<u16> {
        let mut out = 0u16;
        // SAFETY: pointers valid for the call.
        let code = unsafe { ffi::tdx_store_tcp_port(self.ptr.as_ptr(), &mut out) };
        check(code, self.timeout, || format!("{}: port", self.desc))?;
        Ok(out)
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn as_ptr(&self) -> *const ffi::tdx_store {
        self.ptr.as_ptr()
    }
}

impl Clone for Store {
    fn clone(&self) -> Self {
        let mut out = std::ptr::null_mut();
        // SAFETY: copying an intrusive_ptr cannot fail short of allocation failure, which aborts anyway.
        let code = unsafe { ffi::tdx_store_clone_handle(self.ptr.as_ptr(), &mut out) };
        let ptr = match NonNull::new(out) {
            Some(p) if code == ffi::TDX_OK => p,
            _ => std::process::abort(),
        };
        Store {
            ptr,
            timeout: self.timeout,
            desc: self.desc.clone(),
            origin: self.origin.clone(),
            _shared: self._shared.clone(),
            broken: self.broken.clone(),
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: we own the handle.
        unsafe { ffi::tdx_store_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.desc)
    }
}
