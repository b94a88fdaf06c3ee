//! The lighthouse: the one service that decides which replicas take each step together (torchft's
//! Lighthouse). Replicas ask to join the next quorum; a quorum forms once every live replica has asked
//! (and at least `min_replicas`), or when the join timeout has passed since the first asked. It also
//! hosts the TCPStore where each quorum's replicate group meets.
//!
//! A replica is live while its heartbeats arrive. Its process dying closes its connections, which the
//! lighthouse sees at once; a replica cut off by the network is dropped when its heartbeats stop for the
//! heartbeat timeout. Only the lighthouse forms quorums, so a cut-off replica cannot form one of its own.
use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{read_line, write_line, Member, Quorum, Request, Response};
use crate::error::{Error, Result};
use crate::store::{Store, TcpStoreOptions};

/// How the lighthouse forms quorums.
#[derive(Clone, Debug)]
pub struct LighthouseConfig {
    /// `host:port` to listen on; port 0 picks a free one ([`Lighthouse::addr`] tells it).
    pub bind: String,
    /// No quorum forms with fewer replicas than this.
    pub min_replicas: usize,
    /// A replica whose heartbeats stop this long is taken as lost (one whose process ends is lost at once).
    pub heartbeat_timeout: Duration,
    /// Once `min_replicas` have asked, a quorum forms after this long even if live replicas have not asked.
    pub join_timeout: Duration,
}

impl Default for LighthouseConfig {
    fn default() -> Self {
        LighthouseConfig {
            bind: "127.0.0.1:0".into(),
            min_replicas: 1,
            heartbeat_timeout: Duration::from_secs(5),
            join_timeout: Duration::from_secs(60),
        }
    }
}

/// A running lighthouse (threads of this process); it stops when dropped.
pub struct Lighthouse {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
    // the replicate groups' rendezvous store, served while the lighthouse lives
    _store: Store,
}

struct Shared {
    cfg: LighthouseConfig,
    store_addr: String,
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    connections: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Live replicas: the last message's time, and the connection it came on.
    beats: HashMap<String, (Instant, u64)>,
    /// Replicas waiting for the next quorum: their step and whether they asked for a new group.
    waiting: BTreeMap<String, (u64, bool)>,
    first_wait: Option<Instant>,
    answers: HashMap<String, Response>,
    id: u64,
    last_members: Vec<String>,
}

impl Lighthouse {
    /// Binds and starts serving.
    pub fn start(cfg: LighthouseConfig) -> Result<Lighthouse> {
        if cfg.min_replicas == 0 {
            return Err(Error::invalid("LighthouseConfig::min_replicas", "must be at least 1"));
        }
        let io = |e: std::io::Error| Error::invalid("lighthouse", format!("cannot listen on {}: {e}", cfg.bind));
        let listener = TcpListener::bind(cfg.bind.as_str()).map_err(io)?;
        let addr = listener.local_addr().map_err(io)?;
        listener.set_nonblocking(true).map_err(io)?;
        let host = addr.ip().to_string();
        let store = Store::tcp(&TcpStoreOptions {
            wait_workers: false,
            num_workers: None,
            ..TcpStoreOptions::server(&host, 0, 1)
        })?;
        let store_addr = format!("{host}:{}", store.port()?);
        let shared = Arc::new(Shared {
            cfg,
            store_addr,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            connections: AtomicU64::new(0),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("tdx-lighthouse".into())
            .spawn(move || accept(listener, s))
            .map_err(|e| Error::invalid("lighthouse", format!("cannot start its thread: {e}")))?;
        Ok(Lighthouse { addr, shared, acceptor: Some(acceptor), _store: store })
    }

    /// `host:port` replicas reach it at.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// `host:port` of the store replicate groups meet in.
    pub fn store_addr(&self) -> &str {
        &self.shared.store_addr
    }

    /// The replicas it takes as live now.
    pub fn live_replicas(&self) -> Vec<String> {
        let st = match self.shared.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        let mut v: Vec<String> = live(&st, &self.shared.cfg, Instant::now()).into_iter().collect();
        v.sort();
        v
    }
}

impl Drop for Lighthouse {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let s = shared.clone();
                let id = shared.connections.fetch_add(1, Ordering::SeqCst) + 1;
                let _ =
                    std::thread::Builder::new().name("tdx-lighthouse-conn".into()).spawn(move || serve(stream, id, s));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, State> {
    match shared.state.lock() {
        Ok(s) => s,
        Err(p) => p.into_inner(),
    }
}

/// One replica's connection: requests in order, each answered.
fn serve(stream: TcpStream, conn: u64, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_nonblocking(false);
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    let mut replica: Option<String> = None;
    while let Ok(Some(req)) = read_line::<Request>(&mut reader) {
        let answer = match req {
            Request::Heartbeat { replica: r } => {
                lock(&shared).beats.insert(r.clone(), (Instant::now(), conn));
                shared.changed.notify_all();
                replica = Some(r);
                Response::Ok
            }
            Request::Quorum { replica: r, step, reconfigure } => {
                replica = Some(r.clone());
                quorum(&shared, conn, r, step, reconfigure)
            }
        };
        if write_line(&mut writer, &answer).is_err() {
            break;
        }
    }
    // the connection ended: a replica whose latest message came on it is gone (its process ended, or it
    // will reconnect and be live again)
    if let Some(r) = replica {
        let mut st = lock(&shared);
        if st.beats.get(&r).is_some_and(|&(_, c)| c == conn) {
            st.beats.remove(&r);
        }
        drop(st);
        shared.changed.notify_all();
    }
}

fn live(st: &State, cfg: &LighthouseConfig, now: Instant) -> std::collections::BTreeSet<String> {
    st.beats
        .iter()
        .filter(|(_, (t, _))| now.duration_since(*t) < cfg.heartbeat_timeout)
        .map(|(r, _)| r.clone())
        .collect()
}

/// Waits until a quorum including `replica` forms (or the lighthouse stops).
fn quorum(shared: &Shared, conn: u64, replica: String, step: u64, reconfigure: bool) -> Response {
    let mut st = lock(shared);
    st.beats.insert(replica.clone(), (Instant::now(), conn));
    st.answers.remove(&replica);
    st.waiting.insert(replica.clone(), (step, reconfigure));
    st.first_wait.get_or_insert_with(Instant::now);
    loop {
        if let Some(a) = st.answers.remove(&replica) {
            return a;
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Response::Refused("the lighthouse is stopping".into());
        }
        try_form(&mut st, shared);
        if let Some(a) = st.answers.remove(&replica) {
            shared.changed.notify_all();
            return a;
        }
        st = match shared.changed.wait_timeout(st, Duration::from_millis(20)) {
            Ok((s, _)) => s,
            Err(p) => p.into_inner().0,
        };
    }
}

fn try_form(st: &mut State, shared: &Shared) {
    let cfg = &shared.cfg;
    let now = Instant::now();
    let alive = live(st, cfg, now);
    let lost: Vec<String> = st.waiting.keys().filter(|r| !alive.contains(*r)).cloned().collect();
    for r in lost {
        st.waiting.remove(&r);
        st.answers.insert(r.clone(), Response::Refused(format!("replica {r} was taken as lost (no heartbeat)")));
    }
    if st.waiting.is_empty() {
        st.first_wait = None;
        return;
    }
    let all_in = alive.iter().all(|r| st.waiting.contains_key(r));
    let enough = st.waiting.len() >= cfg.min_replicas;
    let late = st.first_wait.is_some_and(|t| now.duration_since(t) >= cfg.join_timeout);
    if !(enough && (all_in || late)) {
        return;
    }
    let names: Vec<String> = st.waiting.keys().cloned().collect();
    if names != st.last_members || st.waiting.values().any(|&(_, re)| re) {
        st.id += 1;
    }
    let q = Quorum {
        id: st.id,
        members: st.waiting.iter().map(|(r, &(step, _))| Member { replica: r.clone(), step }).collect(),
        store: shared.store_addr.clone(),
    };
    for r in &names {
        st.answers.insert(r.clone(), Response::Quorum(q.clone()));
    }
    st.waiting.clear();
    st.first_wait = None;
    st.last_members = names;
    shared.changed.notify_all();
}
