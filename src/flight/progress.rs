//! Each rank's progress in each group, published through the group's store: the last collective it
//! entered, and a heartbeat. When a collective fails, the ranks that never arrived are named from it.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::record::{current_label, dump_with, enabled, is_p2p, now, Recording, Seq};
use crate::error::Error;
use crate::store::Store;

/// How often each process publishes its progress at least (its heartbeat)...
const PUBLISH_EVERY: Duration = Duration::from_millis(1000);
/// ...and at most, when ranks enter collectives quickly.
const PUBLISH_GAP: Duration = Duration::from_millis(20);
/// A heartbeat older than this means the process is stopped, dead, or cannot reach the store.
const STALE_AFTER: f64 = 3.0;
/// How long a failing rank waits for the store to tell the others' progress.
const READ_DEADLINE: Duration = Duration::from_secs(2);
/// The store key through which a failing rank asks the others for their dumps, and how long it waits
/// for them.
const DUMP_KEY: &str = "dump";
const DUMP_WAIT: Duration = Duration::from_secs(2);
/// How often a long wait looks at the other ranks' heartbeats (see [`GroupTrace::frozen_peer`]).
pub(crate) const HEARTBEAT_CHECK_EVERY: Duration = Duration::from_secs(1);

/// What a rank publishes once it has left its group.
const LEFT: &str = "left";

/// What one rank last published about itself in a group.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PeerProgress {
    pub rank: usize,
    /// Sequence number of the last collective it entered in the group (0: none).
    pub seq: u64,
    pub op: String,
    pub label: String,
    /// When it entered that collective, and when it last published (seconds since the epoch).
    pub entered: f64,
    pub heartbeat: f64,
    /// Whether anything was published at all.
    pub seen: bool,
    /// It left the group for good (a fault-tolerant replica moving on to a new quorum).
    #[serde(default)]
    pub left: bool,
    /// Its last collective's number among the group's collectives (point-to-point not counted), and
    /// the collective call of the API it was made inside: the calls entered so far, and the name of the
    /// one it is inside (empty outside one). Ranks whose collective of one number was made in different
    /// calls pair up different operations (see [`GroupTrace::enter_call`]).
    #[serde(default)]
    pub coll: u64,
    #[serde(default)]
    pub calls: u64,
    #[serde(default)]
    pub call: String,
    /// The same of the call it is in now (its next collectives are made there or later).
    #[serde(default)]
    pub now_calls: u64,
    #[serde(default)]
    pub now_call: String,
}

/// Which collective call of the API a collective was made inside: how many had been entered, and the
/// name of the one it is inside (empty outside one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct CallContext {
    calls: u64,
    name: String,
}

impl CallContext {
    fn describe(&self) -> String {
        describe_call(self.calls, &self.name)
    }
}

/// Where a collective was made: inside call `name` (the `calls`-th entered), or outside any.
pub(crate) fn describe_call(calls: u64, name: &str) -> String {
    if name.is_empty() {
        format!("outside any collective call of the API ({calls} made before)")
    } else {
        format!("inside {name} (collective call #{calls})")
    }
}

/// Of two ranks whose collectives of one number were made in different calls: which one made a call
/// alone (the one that has made more, or is inside one the other is not), and the sentence naming it.
pub(crate) fn odd_one_out(a: (usize, u64, &str), b: (usize, u64, &str)) -> String {
    if (a.1, !a.2.is_empty()) == (b.1, !b.2.is_empty()) {
        // as many calls, inside different ones: neither is the odd one out
        return format!(
            "rank {} is inside {} where rank {} is inside {} (a collective call of the API must be made on \
             every rank of the group, in the same order)",
            a.0, a.2, b.0, b.2
        );
    }
    let (alone, call) = if (a.1, !a.2.is_empty()) > (b.1, !b.2.is_empty()) { (a.0, a.2) } else { (b.0, b.2) };
    let call = if call.is_empty() { "a collective call" } else { call };
    format!(
        "the odd one out: rank {alone}, which called {call} alone (a collective call of the API, e.g. state_dict \
         or a checkpoint's save, must be made on every rank of the group, in the same order)"
    )
}

/// This rank's call contexts by collective number: each change, from the collective it first applies to.
/// The last [`CONTEXT_HISTORY`] changes are kept (a peer far behind is not judged).
#[derive(Default)]
struct Contexts {
    changes: std::collections::VecDeque<(u64, CallContext)>,
    now: CallContext,
}

const CONTEXT_HISTORY: usize = 64;

impl Contexts {
    fn change(&mut self, from_coll: u64, to: CallContext) {
        self.now = to.clone();
        self.changes.push_back((from_coll, to));
        while self.changes.len() > CONTEXT_HISTORY {
            self.changes.pop_front();
        }
    }

    /// The context of collective `coll`, if still known.
    fn at(&self, coll: u64) -> Option<&CallContext> {
        match self.changes.iter().rev().find(|(from, _)| *from <= coll) {
            Some((_, c)) => Some(c),
            None if self.changes.len() < CONTEXT_HISTORY => Some(&DEFAULT_CONTEXT),
            None => None,
        }
    }
}

static DEFAULT_CONTEXT: CallContext = CallContext { calls: 0, name: String::new() };

impl PeerProgress {
    fn encode(&self) -> String {
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            self.seq,
            self.entered,
            now(),
            self.coll,
            self.calls,
            self.call.replace('\t', " "),
            self.now_calls,
            self.now_call.replace('\t', " "),
            self.op.replace('\t', " "),
            self.label.replace('\t', " ")
        )
    }

    fn decode(rank: usize, text: &str) -> PeerProgress {
        if text == LEFT {
            return PeerProgress { rank, op: LEFT.into(), seen: true, left: true, ..PeerProgress::default() };
        }
        let f: Vec<&str> = text.splitn(10, '\t').collect();
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
        let int = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        PeerProgress {
            rank,
            seq: int(0),
            entered: num(1),
            heartbeat: num(2),
            coll: int(3),
            calls: int(4),
            call: f.get(5).unwrap_or(&"").to_string(),
            now_calls: int(6),
            now_call: f.get(7).unwrap_or(&"").to_string(),
            op: f.get(8).unwrap_or(&"").to_string(),
            label: f.get(9).unwrap_or(&"").to_string(),
            seen: true,
            left: false,
        }
    }
}

/// A group's side of the recorder: its name, its sequence numbers, and its progress key in the store.
pub(crate) struct GroupTrace {
    pub name: String,
    rank: usize,
    size: usize,
    /// A subgroup's members' world ranks (`None`: the ranks are the world's).
    world: Option<std::sync::Arc<[usize]>>,
    seq: AtomicU64,
    /// PyTorch's counts: collectives, and point-to-point operations.
    collectives: AtomicU64,
    p2p: AtomicU64,
    last: Mutex<PeerProgress>,
    /// `flight/` under the group's store.
    store: Store,
    /// A peer whose heartbeat stands still this long while this rank waits on it ends the wait.
    heartbeat_timeout: Option<Duration>,
    /// A wait of this group ended that way, with its collective still running in the engine.
    abandoned: std::sync::atomic::AtomicBool,
    /// An operation of this group failed: what it left queued may never be matched.
    failed: std::sync::atomic::AtomicBool,
    /// Another rank's request for dumps was answered.
    answered: std::sync::atomic::AtomicBool,
    /// This rank left the group: its heartbeat says so for good.
    left: std::sync::atomic::AtomicBool,
    /// Its failures are handled by the caller: no dumps, no requests for the others' dumps.
    survivable: std::sync::atomic::AtomicBool,
    /// Held while publishing or leaving.
    publishing: Mutex<()>,
    /// NCCL operations whose host wait returned (their stream waits on them) but whose end event may
    /// not have completed: recorded as complete only once it has.
    unfinished: Mutex<Vec<(Recording, EngineProbe)>>,
    /// The collective calls of the API this rank made on the group, by collective number.
    contexts: Mutex<Contexts>,
}

/// Inside a collective call of the API on a group (see [`GroupTrace::enter_call`]); leaves it when
/// dropped.
pub(crate) struct CallGuard(Option<(Arc<GroupTrace>, String)>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        if let Some((t, outer)) = self.0.take() {
            // back in the call this one was made inside, if any
            t.set_call(outer, false);
        }
    }
}

/// A second handle on an engine's work, to ask whether it finished (its end event, on NCCL).
pub(crate) struct EngineProbe(crate::ffi::c10d::WorkHandle);

impl EngineProbe {
    pub(crate) fn of(w: &crate::ffi::c10d::WorkHandle) -> Option<EngineProbe> {
        w.probe().map(EngineProbe)
    }

    fn done(&self) -> bool {
        let (code, done) = self.0.is_completed();
        code != crate::ffi::TDX_OK || done
    }
}

/// What one long wait has seen of the other ranks' heartbeats: each one's last value, and when it
/// changed, on this rank's clock (so that clocks of other hosts never matter).
#[derive(Default)]
pub(crate) struct HeartbeatWatch {
    last: std::collections::HashMap<usize, (f64, std::time::Instant)>,
    /// The read of the others' progress still under way (one at a time: a store that does not answer
    /// must not collect a thread per second).
    reading: Option<std::sync::mpsc::Receiver<Vec<PeerProgress>>>,
}

impl GroupTrace {
    /// `world`: a subgroup's members' world ranks, which its errors name beside their ranks here.
    pub(crate) fn new(
        name: &str,
        (rank, size): (usize, usize),
        world: Option<std::sync::Arc<[usize]>>,
        store: &Store,
        heartbeat_timeout: Option<Duration>,
    ) -> Arc<GroupTrace> {
        // the shared connection: the heartbeat must not wait behind this rank's blocking store calls
        // (a rendezvous waiting for a late rank), or a live rank would look frozen
        let store = store.prefixed("flight/").unwrap_or_else(|_| store.clone());
        let store = store.shared_connection().unwrap_or(store);
        let t = Arc::new(GroupTrace {
            name: name.to_string(),
            rank,
            size,
            world,
            seq: AtomicU64::new(0),
            collectives: AtomicU64::new(0),
            p2p: AtomicU64::new(0),
            last: Mutex::new(PeerProgress { rank, ..PeerProgress::default() }),
            store,
            heartbeat_timeout,
            abandoned: std::sync::atomic::AtomicBool::new(false),
            failed: std::sync::atomic::AtomicBool::new(false),
            answered: std::sync::atomic::AtomicBool::new(false),
            left: std::sync::atomic::AtomicBool::new(false),
            survivable: std::sync::atomic::AtomicBool::new(false),
            publishing: Mutex::new(()),
            unfinished: Mutex::new(Vec::new()),
            contexts: Mutex::new(Contexts::default()),
        });
        if enabled() && size > 1 {
            register(&t);
        }
        t
    }

    /// A collective starts on this rank: the next sequence number, and its recording.
    /// Records `r` as complete once `probe`'s work has finished (checked at this group's next operation
    /// and at every heartbeat).
    pub(crate) fn end_when_done(&self, r: Recording, probe: EngineProbe) {
        if probe.done() {
            r.end(None);
            return;
        }
        self.unfinished.lock().unwrap_or_else(|e| e.into_inner()).push((r, probe));
    }

    /// The call this rank is in now: how many it has entered, and the name of the one it is in (empty
    /// outside one).
    pub(crate) fn call_now(&self) -> (u64, String) {
        let c = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        (c.now.calls, c.now.name.clone())
    }

    /// This rank enters a collective call of the API on this group (`state_dict`, a checkpoint's save or
    /// load): the collectives it makes until the guard drops carry the call's name and number in the
    /// published progress. A peer whose collective of the same number was made in another call (or
    /// outside one) pairs up a different operation: a wait in this group then ends within a heartbeat
    /// check, on both ranks, naming the call made on one side only.
    pub(crate) fn enter_call(self: &Arc<Self>, name: &str) -> CallGuard {
        // tracked whether recording is on or not: the strict mode's stamps carry it on every rank alike
        if self.size == 1 {
            return CallGuard(None);
        }
        let outer = self.set_call(name.to_string(), true);
        CallGuard(Some((self.clone(), outer)))
    }

    /// The context from the next collective on: inside `name` (empty: outside any call), a new call when
    /// `new`. Returns the name it replaces.
    fn set_call(&self, name: String, new: bool) -> String {
        let next = self.collectives.load(Ordering::Relaxed) + 1;
        let mut c = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        let calls = c.now.calls + u64::from(new);
        let outer = c.now.name.clone();
        c.change(next, CallContext { calls, name: name.clone() });
        // one lock at a time: `enter` takes `last`, then `contexts`
        drop(c);
        if let Ok(mut last) = self.last.lock() {
            last.now_calls = calls;
            last.now_call = name;
        }
        // the peers learn it at once: a rank waiting on this one may be waiting for nothing now
        wake_publisher();
        outer
    }

    /// A peer whose collective of a number this rank has reached was made in another call context: the
    /// error naming both (the rank that made a call the other did not is the odd one out).
    fn call_mismatch(&self, peers: &[PeerProgress], op: &str) -> Option<Error> {
        let mine = self.collectives.load(Ordering::Relaxed);
        let contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        for p in peers.iter().filter(|p| p.seen && !p.left) {
            let theirs_then = CallContext { calls: p.calls, name: p.call.clone() };
            let theirs_now = CallContext { calls: p.now_calls, name: p.now_call.clone() };
            // the first collective number at which the two ranks' contexts certainly differ, with each
            // side's context there (a rank's later collectives are made in its current call or later)
            let differ = if p.coll > 0 && p.coll <= mine {
                // both made it: compare; else the peer's next one, which this rank made already
                match contexts.at(p.coll) {
                    Some(me) if *me != theirs_then => Some((p.coll, me.clone(), theirs_then)),
                    _ => match contexts.at(p.coll + 1).filter(|_| p.coll < mine) {
                        Some(me) if theirs_now.calls > me.calls => Some((p.coll + 1, me.clone(), theirs_now)),
                        _ => None,
                    },
                }
            } else if p.coll > mine && theirs_then.calls < contexts.now.calls {
                // the peer made this rank's next collective in fewer calls than this rank has made now
                Some((mine + 1, contexts.now.clone(), theirs_then))
            } else {
                None
            };
            let Some((coll, me, theirs)) = differ else { continue };
            let odd = odd_one_out((self.rank, me.calls, &me.name), (p.rank, theirs.calls, &theirs.name));
            return Some(Error::Mismatch {
                op: op.to_string(),
                msg: format!(
                    "collective #{coll} of group {} is made {} on rank {} but {} on rank {} (its last operation: \
                     {}): they would pair up different operations; {odd}",
                    self.name,
                    me.describe(),
                    self.rank,
                    theirs.describe(),
                    p.rank,
                    p.op,
                ),
            });
        }
        None
    }

    /// Ends the recordings of operations that finished since.
    fn reap(&self) {
        let mut u = self.unfinished.lock().unwrap_or_else(|e| e.into_inner());
        if u.is_empty() {
            return;
        }
        u.retain(|(r, probe)| {
            let done = probe.done();
            if done {
                r.end(None);
            }
            !done
        });
    }

    pub(crate) fn enter(&self, op: &str, backend: &str) -> (u64, Option<Recording>) {
        self.reap();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        if !enabled() {
            return (seq, None);
        }
        let numbers = if is_p2p(op) {
            Seq {
                all: seq,
                collective: self.collectives.load(Ordering::Relaxed),
                p2p: self.p2p.fetch_add(1, Ordering::Relaxed) + 1,
            }
        } else {
            Seq { all: seq, collective: self.collectives.fetch_add(1, Ordering::Relaxed) + 1, p2p: 0 }
        };
        if let Ok(mut last) = self.last.lock() {
            last.seq = seq;
            last.op = op.to_string();
            last.label = current_label();
            last.entered = now();
            if numbers.p2p == 0 {
                let ctx = self.contexts.lock().unwrap_or_else(|e| e.into_inner()).now.clone();
                last.coll = numbers.collective;
                last.calls = ctx.calls;
                last.call = ctx.name;
            }
        }
        wake_publisher();
        (seq, Recording::start(&self.name, self.rank, self.size, numbers, op, backend))
    }

    fn publish(&self) {
        // with leave(): a heartbeat checked before the rank left must not overwrite its mark
        let _one = self.publishing.lock();
        if self.left.load(Ordering::SeqCst) {
            return;
        }
        let text = match self.last.lock() {
            Ok(l) => l.encode(),
            Err(_) => return,
        };
        let _ = self.store.set(&self.rank.to_string(), text.as_bytes());
    }

    /// The other ranks' progress, as published; bounded by [`READ_DEADLINE`] (the store may be gone).
    fn peers(self: &Arc<Self>) -> Option<Vec<PeerProgress>> {
        self.read_peers().recv_timeout(READ_DEADLINE).ok()
    }

    /// The read of the other ranks' progress, on a thread of its own (a store call can block).
    fn read_peers(self: &Arc<Self>) -> std::sync::mpsc::Receiver<Vec<PeerProgress>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let me = self.clone();
        std::thread::spawn(move || {
            let peers: Vec<PeerProgress> = (0..me.size)
                .filter(|&r| r != me.rank)
                .map(|r| match me.store.check(&r.to_string()) {
                    Ok(true) => me
                        .store
                        .get(&r.to_string())
                        .map(|v| PeerProgress::decode(r, &String::from_utf8_lossy(&v)))
                        .unwrap_or(PeerProgress { rank: r, ..PeerProgress::default() }),
                    _ => PeerProgress { rank: r, ..PeerProgress::default() },
                })
                .collect();
            let _ = tx.send(peers);
        });
        rx
    }

    /// This rank leaves the group for good: the others' waits on it end at their next heartbeat check,
    /// without waiting for the heartbeat timeout.
    pub(crate) fn leave(&self) {
        let _one = self.publishing.lock();
        self.left.store(true, Ordering::SeqCst);
        let _ = self.store.set(&self.rank.to_string(), LEFT.as_bytes());
    }

    /// A failure of this group is survived by the caller (a fault-tolerant replicate group): it is
    /// reported without dumping the flight recorder or waiting for the others' dumps.
    /// Its failures are handled by the caller (see [`set_survivable`](Self::set_survivable)).
    pub(crate) fn is_survivable(&self) -> bool {
        self.survivable.load(Ordering::SeqCst)
    }

    pub(crate) fn set_survivable(&self) {
        self.survivable.store(true, Ordering::SeqCst);
    }

    pub(crate) fn heartbeat_timeout(&self) -> Option<Duration> {
        self.heartbeat_timeout
    }

    /// Whether an operation of this group failed.
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Whether a wait gave up on a collective that still runs (see [`GroupTrace::frozen_peer`]).
    pub(crate) fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::SeqCst)
    }

    /// Whether waits in this group watch the other ranks' heartbeats: recording on (heartbeats are
    /// published), more than one rank, and a heartbeat timeout set.
    pub(crate) fn watches_heartbeats(&self) -> bool {
        self.heartbeat_timeout.is_some() && enabled() && self.size > 1
    }

    /// During a long wait: the first other rank whose heartbeat has not changed for the heartbeat timeout,
    /// as the error that ends the wait. A rank that is slow but alive keeps publishing its heartbeat (a
    /// thread of its own does it, whatever the rank computes) and is never named; one that never
    /// published (recording off there) is not judged.
    pub(crate) fn frozen_peer(self: &Arc<Self>, watch: &mut HeartbeatWatch, op: &str) -> Option<Error> {
        self.frozen_peer_among(watch, op, None)
    }

    /// [`frozen_peer`](Self::frozen_peer) of the ranks in `among` only (all of them when `None`).
    pub(crate) fn frozen_peer_among(
        self: &Arc<Self>,
        watch: &mut HeartbeatWatch,
        op: &str,
        among: Option<&[usize]>,
    ) -> Option<Error> {
        let limit = self.heartbeat_timeout?;
        let reading = watch.reading.take().unwrap_or_else(|| self.read_peers());
        let peers = match reading.recv_timeout(Duration::from_millis(200)) {
            Ok(p) => p,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                // still reading: looked at again at the next check
                watch.reading = Some(reading);
                return None;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
        };
        let peers: Vec<PeerProgress> =
            peers.into_iter().filter(|p| among.is_none_or(|a| a.contains(&p.rank))).collect();
        let at = std::time::Instant::now();
        if let Some(e) = self.call_mismatch(&peers, op) {
            self.abandoned.store(true, Ordering::SeqCst);
            return Some(e);
        }
        if let Some(p) = peers.iter().find(|p| p.left) {
            self.abandoned.store(true, Ordering::SeqCst);
            return Some(Error::PeerGone {
                op: op.to_string(),
                msg: format!("{} left group {} while this rank waited for it", self.who(p.rank), self.name),
            });
        }
        for p in peers.iter().filter(|p| p.seen) {
            let (beat, since) = watch.last.entry(p.rank).or_insert((p.heartbeat, at));
            if *beat != p.heartbeat {
                *beat = p.heartbeat;
                *since = at;
            } else if at.duration_since(*since) >= limit {
                self.abandoned.store(true, Ordering::SeqCst);
                return Some(Error::PeerGone {
                    op: op.to_string(),
                    msg: format!(
                        "{} of group {} has published no heartbeat for {:.1}s while this rank waited for it \
                         (the heartbeat timeout, TCH_DIST_HEARTBEAT_TIMEOUT_SECS): its process is stopped, \
                         dead, or cut off from the store",
                        self.who(p.rank),
                        self.name,
                        at.duration_since(*since).as_secs_f64()
                    ),
                });
            }
        }
        None
    }

    /// A collective of this group failed: name the ranks that never arrived in the error (from their
    /// published progress), and dump the ring (when `TCH_DIST_TRACE_DIR` is set).
    /// `p2p`: a send or recv, whose sequence numbers do not pair up across ranks (only liveness is told).
    pub(crate) fn on_failure(self: &Arc<Self>, seq: u64, p2p: bool, err: Error) -> Error {
        self.failed.store(true, Ordering::SeqCst);
        if !enabled() || !matches!(err, Error::Timeout { .. } | Error::PeerGone { .. } | Error::Mismatch { .. }) {
            return err;
        }
        let peers = if self.size > 1 { self.peers() } else { Some(Vec::new()) };
        let note = match &peers {
            Some(p) => self.blame(if p2p { None } else { Some(seq) }, p),
            None => format!("the other ranks' progress could not be read from the store within {READ_DEADLINE:?}"),
        };
        let err = if note.is_empty() { err } else { err.with_note(&note) };
        if self.survivable.load(Ordering::SeqCst) {
            // handled by the caller (a fault-tolerant replica moves on): not the job's failure to dump
            return err;
        }
        let peers = peers.unwrap_or_default();
        dump_with(&err.to_string(), peers.clone(), Some(self.rank));
        self.request_dumps(&err.to_string(), &peers);
        err
    }

    /// Asks the other ranks of the group to dump their rings too (as PyTorch's dump on timeout does), so
    /// that the merge sees a rank that is alive but elsewhere; waits a moment for those whose heartbeat is
    /// fresh (a stopped or dead one cannot answer).
    fn request_dumps(&self, reason: &str, peers: &[PeerProgress]) {
        if crate::settings::trace_dir().is_none() {
            return;
        }
        // on a thread, bounded: the store's host may be the rank that is stopped
        let (tx, rx) = std::sync::mpsc::channel();
        let (store, reason) = (self.store.clone(), reason.to_string());
        std::thread::spawn(move || {
            let _ = tx.send(store.set(DUMP_KEY, reason.as_bytes()).is_ok());
        });
        if rx.recv_timeout(READ_DEADLINE) != Ok(true) {
            return;
        }
        let t = now();
        let alive: Vec<usize> =
            peers.iter().filter(|p| p.seen && t - p.heartbeat < STALE_AFTER).map(|p| p.rank).collect();
        let deadline = std::time::Instant::now() + DUMP_WAIT;
        while std::time::Instant::now() < deadline {
            if alive.iter().all(|r| self.store.check(&format!("{DUMP_KEY}ed/{r}")).unwrap_or(true)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The publisher's side of [`GroupTrace::request_dumps`]: a request seen in this group's store is
    /// answered with this process's dump (once per process) and an acknowledgment.
    fn answer_dump_request(&self) {
        if self.answered.load(Ordering::Relaxed) || !self.store.check(DUMP_KEY).unwrap_or(false) {
            return;
        }
        self.answered.store(true, Ordering::Relaxed);
        if !super::record::has_dumped() {
            let why = self.store.get(DUMP_KEY).map(|v| String::from_utf8_lossy(&v).to_string()).unwrap_or_default();
            dump_with(&format!("another rank of group {} failed: {why}", self.name), Vec::new(), Some(self.rank));
        }
        let _ = self.store.set(&format!("{DUMP_KEY}ed/{}", self.rank), b"1");
    }

    /// Rank `r` of this group as errors name it: "rank 1", or "rank 1 (world rank 3)" in a subgroup.
    pub(crate) fn who(&self, r: usize) -> String {
        match self.world.as_ref().and_then(|w| w.get(r)) {
            Some(&w) if w != r => format!("rank {r} (world rank {w})"),
            _ => format!("rank {r}"),
        }
    }

    /// "rank 1 never entered it: ..." for each rank behind collective `seq`, or with a stale heartbeat (only
    /// the latter for point-to-point messages, `seq` None).
    fn blame(&self, seq: Option<u64>, peers: &[PeerProgress]) -> String {
        let group = &self.name;
        let t = now();
        let mut notes = Vec::new();
        for p in peers {
            let stale = p.seen && t - p.heartbeat > STALE_AFTER;
            let life = if !p.seen {
                "it never published its progress (not started, or not built with the flight recorder)".to_string()
            } else if stale {
                format!("its process has shown no sign of life for {:.1}s (stopped, dead, or cut off)", t - p.heartbeat)
            } else {
                // a heartbeat is a claim about the past: a process killed a moment ago still looks fresh
                format!("its process showed signs of life {:.1}s ago", t - p.heartbeat)
            };
            if let Some(seq) = seq.filter(|&s| p.seq < s) {
                let last = if p.seq == 0 {
                    "no collective yet".to_string()
                } else {
                    let label = if p.label.is_empty() { String::new() } else { format!(", {}", p.label) };
                    format!("its last was #{} ({}{label}) {:.1}s ago", p.seq, p.op, t - p.entered)
                };
                notes.push(format!(
                    "{} never entered collective #{seq} of group {group}: {last}; {life}",
                    self.who(p.rank)
                ));
            } else if stale {
                notes.push(format!("{} entered #{} but {life}", self.who(p.rank), p.seq));
            }
        }
        notes.join("; ")
    }
}

/// Groups whose progress the publisher thread keeps up to date.
fn registry() -> &'static Mutex<Vec<Weak<GroupTrace>>> {
    static GROUPS: OnceLock<Mutex<Vec<Weak<GroupTrace>>>> = OnceLock::new();
    GROUPS.get_or_init(|| Mutex::new(Vec::new()))
}

/// The publisher: wakes when a rank enters a collective (at most every [`PUBLISH_GAP`]) and at least
/// every [`PUBLISH_EVERY`] (the heartbeat), and publishes every live group's progress. Off the hot path:
/// entering a collective only unparks it.
fn publisher() -> Option<&'static std::thread::Thread> {
    static PUBLISHER: OnceLock<Option<std::thread::Thread>> = OnceLock::new();
    PUBLISHER
        .get_or_init(|| {
            std::thread::Builder::new()
                .name("tch-dist-flight".into())
                .spawn(|| loop {
                    std::thread::park_timeout(PUBLISH_EVERY);
                    let live: Vec<Arc<GroupTrace>> = match registry().lock() {
                        Ok(mut g) => {
                            g.retain(|w| w.strong_count() > 0);
                            g.iter().filter_map(Weak::upgrade).collect()
                        }
                        Err(_) => return,
                    };
                    // no lock held while the store is talked to; every group's heartbeat, changed or not
                    for t in live {
                        t.reap();
                        t.publish();
                        t.answer_dump_request();
                    }
                    std::thread::sleep(PUBLISH_GAP);
                })
                .ok()
                .map(|h| h.thread().clone())
        })
        .as_ref()
}

fn wake_publisher() {
    if let Some(t) = publisher() {
        t.unpark();
    }
}

/// The world ranks of the members of each live group of this process, by the group's name.
pub(crate) fn members() -> std::collections::BTreeMap<String, Vec<usize>> {
    let groups = registry().lock().map(|g| g.iter().filter_map(Weak::upgrade).collect::<Vec<_>>()).unwrap_or_default();
    // the world group and its subgroups: another root's ranks (a fault-tolerant replica group's) are not
    // world ranks, and a survivable group's failures are not the job's
    groups
        .iter()
        .filter(|t| (t.world.is_some() || t.name == "default") && !t.survivable.load(Ordering::SeqCst))
        .map(|t| (t.name.clone(), t.world.as_ref().map_or_else(|| (0..t.size).collect(), |w| w.to_vec())))
        .collect()
}

fn register(t: &Arc<GroupTrace>) {
    t.publish();
    if let Ok(mut g) = registry().lock() {
        g.push(Arc::downgrade(t));
    }
    wake_publisher();
}
