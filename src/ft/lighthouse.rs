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
    /// The store's address as bound (`store_addr`), and its port (quorums carry the address each
    /// replica reached the lighthouse at, with this port).
    store_addr: String,
    store_port: u16,
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    connections: AtomicU64,
}

struct Waiting {
    step: u64,
    commit_quorum: u64,
    reconfigure: bool,
    conn: u64,
}

#[derive(Default)]
struct State {
    /// Live replicas: when each was last heard from.
    beats: HashMap<String, Instant>,
    /// Each replica's open connections: when the last one closes, its process has ended.
    conns: HashMap<String, std::collections::HashSet<u64>>,
    /// Replicas waiting for the next quorum.
    waiting: BTreeMap<String, Waiting>,
    first_wait: Option<Instant>,
    /// Answers by the connection that asked (a replica that gave up and asked again on a new connection
    /// never gets the answer meant for the old one).
    answers: HashMap<u64, Response>,
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
        let store_port = store.port()?;
        let store_addr = SocketAddr::new(addr.ip(), store_port).to_string();
        let shared = Arc::new(Shared {
            cfg,
            store_addr,
            store_port,
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
    // the address the replica reached us at, which it can reach the store at too (the bind address may
    // be 0.0.0.0)
    let here = stream.local_addr().map(|a| a.ip()).ok();
    let mut reader = BufReader::new(stream);
    let mut replica: Option<String> = None;
    while let Ok(Some(req)) = read_line::<Request>(&mut reader) {
        let answer = match req {
            Request::Heartbeat { replica: r } => {
                lock(&shared).heard(&r, conn);
                shared.changed.notify_all();
                replica = Some(r);
                Response::Ok
            }
            Request::Quorum { replica: r, step, commit_quorum, reconfigure } => {
                replica = Some(r.clone());
                let w = Waiting { step, commit_quorum, reconfigure, conn };
                match quorum(&shared, &writer, r, w) {
                    Response::Quorum(mut q) => {
                        if let Some(ip) = here {
                            q.store = SocketAddr::new(ip, shared.store_port).to_string();
                        }
                        Response::Quorum(q)
                    }
                    other => other,
                }
            }
        };
        if write_line(&mut writer, &answer).is_err() {
            break;
        }
    }
    // the connection ended: a replica with no other connection open is gone (its process ended, or it
    // will reconnect and be live again)
    if let Some(r) = replica {
        lock(&shared).forget(&r, conn);
        shared.changed.notify_all();
    }
}

impl State {
    fn heard(&mut self, replica: &str, conn: u64) {
        self.beats.insert(replica.to_string(), Instant::now());
        self.conns.entry(replica.to_string()).or_default().insert(conn);
    }
    /// Connection `conn` of `replica` closed: with none left, the replica is gone.
    fn forget(&mut self, replica: &str, conn: u64) {
        let last = self.conns.get_mut(replica).is_some_and(|c| {
            c.remove(&conn);
            c.is_empty()
        });
        if last {
            self.conns.remove(replica);
            self.beats.remove(replica);
        }
    }
}

fn live(st: &State, cfg: &LighthouseConfig, now: Instant) -> std::collections::BTreeSet<String> {
    st.beats.iter().filter(|(_, t)| now.duration_since(**t) < cfg.heartbeat_timeout).map(|(r, _)| r.clone()).collect()
}

/// Waits until a quorum including `replica` forms (or the lighthouse stops, or the replica's connection
/// closes: a process that dies while it waits is lost at once, not counted in a quorum).
fn quorum(shared: &Shared, stream: &TcpStream, replica: String, w: Waiting) -> Response {
    let conn = w.conn;
    let mut st = lock(shared);
    st.heard(&replica, conn);
    st.answers.remove(&conn);
    st.waiting.insert(replica.clone(), w);
    st.first_wait.get_or_insert_with(Instant::now);
    loop {
        if let Some(a) = st.answers.remove(&conn) {
            return a;
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Response::Refused("the lighthouse is stopping".into());
        }
        if crate::ffi::peer_closed(stream) {
            if st.waiting.get(&replica).is_some_and(|w| w.conn == conn) {
                st.waiting.remove(&replica);
            }
            st.forget(&replica, conn);
            shared.changed.notify_all();
            return Response::Refused("the connection closed".into());
        }
        try_form(&mut st, shared);
        if let Some(a) = st.answers.remove(&conn) {
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
        if let Some(w) = st.waiting.remove(&r) {
            st.answers.insert(w.conn, Response::Refused(format!("replica {r} was taken as lost (no heartbeat)")));
        }
    }
    if st.waiting.is_empty() {
        st.first_wait = None;
        return;
    }
    let enough = st.waiting.len() >= cfg.min_replicas;
    // every live replica asked; or (torchft's fast quorum) every live member of the last quorum did, so
    // that a replica alive but not asking (starting up, or hung while its heartbeat goes on) never holds
    // up those training; or the join timeout passed
    let all_in = alive.iter().all(|r| st.waiting.contains_key(r));
    let previous = st.last_members.iter().filter(|r| alive.contains(*r)).collect::<Vec<_>>();
    let fast = !previous.is_empty() && previous.iter().all(|r| st.waiting.contains_key(*r));
    let late = st.first_wait.is_some_and(|t| now.duration_since(t) >= cfg.join_timeout);
    if !(enough && (all_in || fast || late)) {
        return;
    }
    let names: Vec<String> = st.waiting.keys().cloned().collect();
    if names != st.last_members || st.waiting.values().any(|w| w.reconfigure) {
        st.id += 1;
    }
    let q = Quorum {
        id: st.id,
        members: st
            .waiting
            .iter()
            .map(|(r, w)| Member { replica: r.clone(), step: w.step, commit_quorum: w.commit_quorum })
            .collect(),
        store: shared.store_addr.clone(),
    };
    let asked: Vec<u64> = st.waiting.values().map(|w| w.conn).collect();
    for conn in asked {
        st.answers.insert(conn, Response::Quorum(q.clone()));
    }
    st.waiting.clear();
    st.first_wait = None;
    st.last_members = names;
    shared.changed.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ft::wire::Connection;

    fn start(min: usize, heartbeat: Duration) -> Lighthouse {
        Lighthouse::start(LighthouseConfig {
            min_replicas: min,
            heartbeat_timeout: heartbeat,
            join_timeout: Duration::from_secs(30),
            ..Default::default()
        })
        .unwrap()
    }

    fn conn(l: &Lighthouse) -> Connection {
        Connection::open(&l.addr(), Duration::from_secs(2)).unwrap()
    }

    fn beat(c: &mut Connection, r: &str) {
        assert!(matches!(c.call(&Request::Heartbeat { replica: r.into() }, Duration::from_secs(2)), Ok(Response::Ok)));
    }

    /// Asks for a quorum on a thread of its own; the answer comes through the handle.
    fn ask(l: &Lighthouse, r: &str, step: u64, reconfigure: bool) -> std::thread::JoinHandle<Response> {
        let mut c = conn(l);
        let r = r.to_string();
        std::thread::spawn(move || {
            c.call(&Request::Quorum { replica: r, step, commit_quorum: 0, reconfigure }, Duration::from_secs(20))
                .unwrap()
        })
    }

    fn quorum(h: std::thread::JoinHandle<Response>) -> Quorum {
        match h.join().unwrap() {
            Response::Quorum(q) => q,
            other => panic!("no quorum: {other:?}"),
        }
    }

    fn names(q: &Quorum) -> Vec<&str> {
        q.members.iter().map(|m| m.replica.as_str()).collect()
    }

    #[test]
    fn a_quorum_forms_once_every_live_replica_asked_and_keeps_its_id_while_members_stay() {
        let l = start(1, Duration::from_secs(5));
        let mut hb = conn(&l);
        for r in ["a", "b", "c"] {
            beat(&mut hb, r);
        }
        let (a, b) = (ask(&l, "a", 3, false), ask(&l, "b", 4, false));
        std::thread::sleep(Duration::from_millis(200));
        assert!(!a.is_finished() && !b.is_finished(), "c is live and has not asked");
        let c = ask(&l, "c", 4, false);
        let (qa, qb, qc) = (quorum(a), quorum(b), quorum(c));
        assert!(qa == qb && qb == qc, "every member gets the same quorum");
        assert_eq!(names(&qa), ["a", "b", "c"]);
        assert_eq!(qa.members[0].step, 3);
        assert_eq!(qa.max_step(), 4);
        let next: Vec<_> = ["a", "b", "c"].iter().map(|r| ask(&l, r, 5, false)).collect();
        let q2: Vec<Quorum> = next.into_iter().map(quorum).collect();
        assert_eq!(q2[0].id, qa.id, "same members, same group");
        let again: Vec<_> = ["a", "b", "c"].iter().map(|r| ask(&l, r, 5, *r == "b")).collect();
        let q3: Vec<Quorum> = again.into_iter().map(quorum).collect();
        assert_eq!(q3[0].id, qa.id + 1, "a member that failed its step asks for a new group");
    }

    #[test]
    fn a_replica_whose_process_ends_is_lost_at_once_and_one_that_stops_beating_after_the_timeout() {
        let l = start(1, Duration::from_millis(800));
        let mut gone = conn(&l);
        beat(&mut gone, "gone");
        let mut silent = conn(&l);
        beat(&mut silent, "silent");
        let mut hb = conn(&l);
        beat(&mut hb, "a");
        assert_eq!(l.live_replicas(), ["a", "gone", "silent"]);
        drop(gone); // its connection closes, as when the process dies
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(l.live_replicas(), ["a", "silent"], "lost at once, not after the heartbeat timeout");
        let t = Instant::now();
        let a = ask(&l, "a", 0, false);
        // "silent" keeps its connection open but sends nothing: taken as lost after the heartbeat timeout
        let q = quorum(a);
        assert_eq!(names(&q), ["a"]);
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(400), "the silent replica was waited for: {waited:?}");
        assert!(l.live_replicas().iter().all(|r| r == "a"), "{:?}", l.live_replicas());
        drop(silent);
    }

    #[test]
    fn once_the_last_quorum_asked_it_forms_without_a_live_replica_that_has_not_asked() {
        let l = start(1, Duration::from_secs(5));
        let mut hb = conn(&l);
        for r in ["a", "b"] {
            beat(&mut hb, r);
        }
        let first: Vec<_> = ["a", "b"].iter().map(|r| ask(&l, r, 0, false)).collect();
        let q1: Vec<Quorum> = first.into_iter().map(quorum).collect();
        assert_eq!(names(&q1[0]), ["a", "b"]);
        beat(&mut hb, "c"); // alive (starting up, or hung) but not asking
        let next: Vec<_> = ["a", "b"].iter().map(|r| ask(&l, r, 1, false)).collect();
        let q2: Vec<Quorum> = next.into_iter().map(quorum).collect();
        assert_eq!(names(&q2[0]), ["a", "b"], "the fast quorum does not wait for c");
        assert_eq!(q2[0].id, q1[0].id);
    }

    #[test]
    fn a_replica_that_dies_while_it_waits_is_not_counted() {
        let l = start(1, Duration::from_secs(5));
        let mut hb = conn(&l);
        for r in ["b", "c"] {
            beat(&mut hb, r);
        }
        // "a" asks on a connection of its own and dies before the answer
        let mut s = std::net::TcpStream::connect(l.addr()).unwrap();
        let req = Request::Quorum { replica: "a".into(), step: 0, commit_quorum: 0, reconfigure: false };
        crate::ft::wire::write_line(&mut s, &req).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(s);
        std::thread::sleep(Duration::from_millis(100));
        let (b, c) = (ask(&l, "b", 0, false), ask(&l, "c", 0, false));
        assert_eq!(names(&quorum(b)), ["b", "c"]);
        assert_eq!(names(&quorum(c)), ["b", "c"]);
    }

    #[test]
    fn no_quorum_forms_below_min_replicas() {
        let l = start(2, Duration::from_secs(5));
        let a = ask(&l, "a", 0, false);
        std::thread::sleep(Duration::from_millis(300));
        assert!(!a.is_finished(), "one replica of at least two");
        let b = ask(&l, "b", 0, false);
        assert_eq!(names(&quorum(a)), ["a", "b"]);
        assert_eq!(names(&quorum(b)), ["a", "b"]);
    }

    #[test]
    fn a_bad_config_is_refused() {
        let e = Lighthouse::start(LighthouseConfig { min_replicas: 0, ..Default::default() }).err().unwrap();
        assert!(e.to_string().contains("min_replicas"), "{e}");
        let e =
            Lighthouse::start(LighthouseConfig { bind: "not an address".into(), ..Default::default() }).err().unwrap();
        assert!(e.to_string().contains("not an address"), "{e}");
    }
}
