//! The strict NCCL mode: Gloo's point-to-point held to NCCL's rules, so that tests on CPU fail where
//! several GPUs would hang (ProcessGroupNCCL.cpp). Gloo matches messages by tag and runs each one on its
//! own; NCCL does neither:
//! - unbatched sends and receives between two ranks run on one queue per pair (NCCL's two-rank
//!   communicator and its stream), one at a time in posting order; the first one blocks its poster until
//!   the peer makes its first one with this rank too, as creating that communicator does;
//! - a batch ([`batch_isend_irecv`](super::ProcessGroup::batch_isend_irecv)) is one unit on the group's
//!   own queue: its operations run together, after every batch posted before it;
//! - tags are ignored: the k-th send from a to b on a queue meets b's k-th receive from a there;
//! - sizes must agree: each message's dtype and shape go first, and a mismatch is an error naming both
//!   ranks (NCCL would hang or read garbage, Gloo would abort the process);
//! - waiting on one operation drives no other: each queue's worker runs on its own;
//! - a group's collectives and its batches share one queue (NCCL's one communicator and stream per
//!   group), completing in posting order; and every pair of ranks must post them in the same order: each
//!   unit is stamped, per peer, with its place among the units of the two ranks, and a unit whose peer
//!   posted something else in that place is an error naming both ranks' operations (NCCL would hang);
//! - a group whose communicator NCCL would create lazily (no bound device) makes its first unit wait
//!   for every rank's first unit, as `ncclCommInitRank` blocks until all ranks call it.
//!
//! An operation that cannot complete (it waits on a message queued behind another) fails after the
//! group's timeout with what the queue holds; the queue then refuses everything after it, as NCCL's
//! aborted communicator would.
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use super::engine::Engine;
use super::tensor_meta;
use crate::error::{Error, Result};
use crate::ffi::check;
use crate::store::Store;
use crate::work::{Ticket, Work};

/// What a queued unit runs: messages to post, or a collective already posted; and its places in the
/// group's order.
struct Unit {
    ops: Vec<(Op, i32)>,
    posted: Option<Work>,
    stamps: Option<Stamps>,
}

impl Unit {
    fn ops(ops: Vec<(Op, i32)>) -> Unit {
        Unit { ops, posted: None, stamps: None }
    }
}

/// One send or receive of a queued unit.
pub(crate) struct Op {
    pub send: bool,
    pub peer: usize,
    pub tensor: Tensor,
}

struct Item {
    ops: Vec<(Op, i32)>,
    /// A collective already posted on the engine: the unit completes with it.
    posted: Option<Work>,
    /// Its places in the group's order, checked against the peers' before it runs.
    stamps: Option<Stamps>,
    ticket: Arc<Ticket>,
    what: String,
}

/// A unit's places in its group's order: for each peer, how many units the two ranks posted before it.
struct Stamps {
    kind: String,
    /// The collective call of the API it was posted in (see the flight recorder's `enter_call`), and
    /// whether it is compared (a collective's; a batch's only explains a mismatch found otherwise).
    call: (u64, String),
    compared: bool,
    places: Vec<(usize, u64)>,
}

/// The order of a group's units, as each rank posted them, in the store.
struct Order {
    rank: usize,
    size: usize,
    /// The process's shared store connection (stamps are set and polled, never waited for): nothing here
    /// waits behind the group's rendezvous traffic, and no group costs a connection of its own.
    store: Store,
    /// Per peer, the units posted with it so far.
    posted: Mutex<HashMap<usize, u64>>,
    /// The communicator exists (a bound device, or the first unit met every rank).
    connected: AtomicBool,
    /// The group's recorder: the call each unit is posted in.
    trace: Arc<crate::flight::GroupTrace>,
}

/// The kind of a unit, from its description: `allreduce(Sum) of ..` is an `allreduce`.
fn kind_of(what: &str) -> String {
    what.split(['(', ' ']).next().unwrap_or(what).to_string()
}

fn nth(i: u64) -> String {
    let n = i + 1;
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

impl Order {
    fn key(&self, peer: usize, i: u64, of: usize) -> String {
        let (lo, hi) = (self.rank.min(peer), self.rank.max(peer));
        format!("{lo}-{hi}/{i}/{of}")
    }

    /// Stamps a unit with `peers` (every other rank for a collective), publishing its places.
    fn stamp(&self, peers: &[usize], what: &str, collective: bool) -> Result<Stamps> {
        let kind = kind_of(what);
        let places: Vec<(usize, u64)> = {
            let mut posted = self.posted.lock().unwrap_or_else(|e| e.into_inner());
            peers
                .iter()
                .map(|&p| {
                    let n = posted.entry(p).or_insert(0);
                    *n += 1;
                    (p, *n - 1)
                })
                .collect()
        };
        let call = self.trace.call_now();
        let mark = if collective { "" } else { "~" };
        let value = format!("{kind}\u{1}{mark}{}\u{1}{}\u{1}{what}", call.0, call.1.replace('\u{1}', " "));
        for &(p, i) in &places {
            self.store.set(&self.key(p, i, self.rank), value.as_bytes())?;
        }
        Ok(Stamps { kind, call, compared: collective, places })
    }

    /// NCCL without a bound device creates the group's communicator at its first collective or batch, and
    /// `ncclCommInitRank` returns only once every rank of the group called it.
    fn connect(&self, what: &str, timeout: Duration) -> Result<()> {
        if self.connected.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.store.set(&format!("first/{}", self.rank), b"1")?;
        let deadline = Instant::now() + timeout;
        for r in (0..self.size).filter(|&r| r != self.rank) {
            // polled: this connection is shared, never blocked on
            let seen = self.store.poll(&format!("first/{r}"), deadline, || false)?;
            seen.then_some(()).ok_or_else(|| Error::Timeout {
                op: what.to_string(),
                timeout,
                msg: format!(
                    "strict NCCL mode: {}'s first collective or batch on this group creates its NCCL \
                    communicator, which waits for every rank of the group, and {} posted none (bind a \
                    device, as from_env does on a GPU machine, to create communicators when groups are built; \
                    or make every rank use the group first in the same order)",
                    self.trace.who(self.rank),
                    self.trace.who(r),
                ),
            })?;
        }
        self.connected.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Waits for each peer's unit in the same places and compares: a different kind is an error naming
    /// both ranks' operations.
    /// `posted`: the unit's collective, already on the engine: if it ends first (a peer gone), its own
    /// outcome is what the unit reports.
    fn check(&self, stamps: &Stamps, what: &str, queue: &str, deadline: Instant, posted: Option<&Work>) -> Result<()> {
        for &(p, i) in &stamps.places {
            let key = self.key(p, i, p);
            let ordinal = nth(i);
            // a store that fails (its host gone) ends the unit at once: polling it again would only fail again;
            // ended without the peer's stamp: only a failure does (the caller's wait reports it)
            let ended = || posted.is_some_and(|w| w.is_completed().unwrap_or(true));
            let seen = self.store.poll(&key, deadline, ended)?;
            if !seen && ended() {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            (if seen { Ok(()) } else { Err(()) }).map_err(|_| Error::Timeout {
                op: what.to_string(),
                timeout: left,
                msg: format!(
                    "strict NCCL mode: {} posted no {ordinal} collective or batch with rank {} on {queue} \
                    (NCCL runs a group's collectives and batches in posting order on every rank: this one \
                    waits for rank {p}'s)",
                    self.trace.who(p),
                    self.rank
                ),
            })?;
            let theirs = String::from_utf8_lossy(&self.store.get(&key)?).to_string();
            // read once, by this rank alone: the store must not grow with every collective
            self.store.delete(&key)?;
            let f: Vec<&str> = theirs.splitn(4, '\u{1}').collect();
            let (their_kind, their_call, their_compared, their_what) = match f[..] {
                [k, n, c, w] => {
                    let compared = !n.starts_with('~');
                    (k, n.trim_start_matches('~').parse::<u64>().ok().map(|n| (n, c)), compared, w)
                }
                _ => (theirs.as_str(), None, false, theirs.as_str()),
            };
            let (n, c) = (stamps.call.0, stamps.call.1.as_str());
            let other_call = their_call.filter(|&t| t != (n, c));
            let pair = (self.rank.min(p), self.rank.max(p));
            // two collectives made in different calls of the API: the one made alone is the cause
            if let Some((tn, tc)) = other_call.filter(|_| stamps.compared && their_compared) {
                return Err(Error::mismatch(
                    what.to_string(),
                    format!(
                        "strict NCCL mode: the {ordinal} collective between ranks {} and {} on {queue} was posted \
                        {} on rank {} ({what}) but {} on rank {p} ({their_what}): they pair up different operations; \
                        {}",
                        pair.0,
                        pair.1,
                        crate::flight::describe_call(n, c),
                        self.rank,
                        crate::flight::describe_call(tn, tc),
                        crate::flight::odd_one_out((self.rank, n, c), (p, tn, tc)),
                    ),
                ));
            }
            if their_kind != stamps.kind {
                // the calls they were posted in, when they differ, say which rank went its own way
                let why = other_call.map_or(String::new(), |(tn, tc)| {
                    format!(
                        "; it was posted {} on rank {} but {} on rank {p}: {}",
                        crate::flight::describe_call(n, c),
                        self.rank,
                        crate::flight::describe_call(tn, tc),
                        crate::flight::odd_one_out((self.rank, n, c), (p, tn, tc)),
                    )
                });
                return Err(Error::mismatch(
                    what.to_string(),
                    format!(
                        "strict NCCL mode: the {ordinal} collective or batch between ranks {} and {} on {queue} \
                        is {what} on rank {} but {their_what} on rank {p}; NCCL runs a group's collectives and \
                        batched point-to-point on one stream in posting order, so these ranks would hang: post \
                        them in the same order on every rank{why}",
                        pair.0, pair.1, self.rank,
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[derive(Default)]
struct QueueState {
    items: VecDeque<Item>,
    /// The worker is running an item it took.
    busy: bool,
    /// The first failure; everything after it is refused with an error of the same kind.
    failed: Option<Error>,
    closed: bool,
}

/// `e` again, as `op`'s (errors are not Clone: tch's are not).
fn copy_of(e: &Error, op: String) -> Error {
    match e {
        Error::Timeout { timeout, msg, .. } => Error::Timeout { op, timeout: *timeout, msg: msg.clone() },
        Error::PeerGone { msg, .. } => Error::PeerGone { op, msg: msg.clone() },
        Error::Mismatch { msg, .. } => Error::Mismatch { op, msg: msg.clone() },
        other => Error::Backend { op, msg: other.to_string() },
    }
}

/// The error for `op`, refused because `first` ended the queue `name`: of `first`'s kind (a timeout stays
/// a timeout, for the flight recorder's blame).
fn refused(first: &Error, name: &str, op: String) -> Error {
    let msg = format!("{name} failed earlier and takes nothing more: {first}");
    match first {
        Error::Timeout { timeout, .. } => Error::Timeout { op, timeout: *timeout, msg },
        Error::PeerGone { .. } => Error::PeerGone { op, msg },
        Error::Mismatch { .. } => Error::Mismatch { op, msg },
        _ => Error::Backend { op, msg },
    }
}

/// A queue of units run in posting order by a worker thread of its own.
struct Queue {
    name: String,
    state: Mutex<QueueState>,
    cv: Condvar,
}

/// Sequence numbers of one queue, per peer and direction: they replace the tags.
#[derive(Default)]
struct Seqs {
    sent: HashMap<usize, u32>,
    received: HashMap<usize, u32>,
}

impl Seqs {
    fn next(&mut self, send: bool, peer: usize) -> u32 {
        let m = if send { &mut self.sent } else { &mut self.received };
        let n = m.entry(peer).or_insert(0);
        let s = *n;
        *n = n.wrapping_add(1);
        s
    }
}

/// The strict mode of one Gloo engine.
pub(crate) struct Strict {
    engine: Arc<Engine>,
    rank: usize,
    store: Store,
    timeout: Arc<Mutex<Duration>>,
    /// Unbatched point-to-point: a queue per peer, created on first use.
    pairs: Mutex<HashMap<usize, (Arc<Queue>, Seqs)>>,
    /// Batches and collectives.
    group: Mutex<Option<(Arc<Queue>, Seqs)>>,
    order: Arc<Order>,
    /// Every queue started, for the engine's shutdown to drain.
    started: Arc<Mutex<Vec<std::sync::Weak<Queue>>>>,
}

/// Tags of the strict mode's messages: bit 29 tells the group's queue from a pair's, bit 0 a header
/// from its body, the rest is the sequence number. Every point-to-point message of a strict group takes
/// one, so nothing else uses these tags.
fn tag(group: bool, seq: u32, body: bool) -> i32 {
    ((group as i32) << 29) | (((seq & ((1 << 28) - 1)) as i32) << 1) | body as i32
}

impl Strict {
    /// `bound`: the group's device was given, so NCCL would create its communicator when it was built.
    pub(super) fn new(
        engine: Arc<Engine>,
        (rank, size): (usize, usize),
        store: Store,
        timeout: Duration,
        bound: bool,
        trace: Arc<crate::flight::GroupTrace>,
    ) -> Result<Strict> {
        let order_store = store.prefixed("order/")?;
        let order = Arc::new(Order {
            rank,
            size,
            store: order_store.shared_connection()?,
            trace,
            posted: Mutex::new(HashMap::new()),
            connected: AtomicBool::new(bound || size == 1),
        });
        let started: Arc<Mutex<Vec<std::sync::Weak<Queue>>>> = Arc::default();
        let queues = started.clone();
        // a shutdown (the group's drop, destroy_process_group, the process's exit) lets what was posted
        // reach the engine first: a rank that posts its last batches and returns loses none of them
        engine.before_shutdown(Box::new(move |deadline| {
            let live: Vec<Arc<Queue>> =
                queues.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(|w| w.upgrade()).collect();
            for q in live {
                q.wait_idle(deadline);
            }
        }));
        Ok(Strict {
            engine,
            rank,
            store,
            timeout: Arc::new(Mutex::new(timeout)),
            pairs: Mutex::new(HashMap::new()),
            group: Mutex::new(None),
            order,
            started,
        })
    }

    pub(super) fn set_timeout(&self, t: Duration) {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner()) = t;
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues an unbatched send or receive on its pair's queue.
    pub(super) fn post_single(&self, op: Op, what: String) -> Result<Arc<Ticket>> {
        let peer = op.peer;
        let known = self.pairs.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&peer);
        if !known {
            // outside the lock: this blocks until the peer comes
            self.create_pair(peer, &what)?;
        }
        let mut pairs = self.pairs.lock().unwrap_or_else(|e| e.into_inner());
        let (lo, hi) = (self.rank.min(peer), self.rank.max(peer));
        let (queue, seqs) = pairs
            .entry(peer)
            .or_insert_with(|| (self.start_queue(format!("the pair stream of ranks {lo} and {hi}")), Seqs::default()));
        let seq = seqs.next(op.send, peer);
        Ok(self.enqueue(queue, Unit::ops(vec![(op, tag(false, seq, false))]), what))
    }

    /// Queues a batch as one unit on the group's queue.
    pub(super) fn post_batch(&self, ops: Vec<Op>, what: String) -> Result<Arc<Ticket>> {
        let mut peers: Vec<usize> = ops.iter().map(|o| o.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        self.order.connect(&what, self.timeout())?;
        let mut g = self.group.lock().unwrap_or_else(|e| e.into_inner());
        // a batch's two sides may lie either side of a call that makes no collective here: not compared
        let stamps = self.order.stamp(&peers, &what, false)?;
        let (queue, seqs) = g.get_or_insert_with(|| self.group_queue());
        let ops = ops
            .into_iter()
            .map(|op| {
                let seq = seqs.next(op.send, op.peer);
                (op, tag(true, seq, false))
            })
            .collect();
        Ok(self.enqueue(queue, Unit { ops, posted: None, stamps: Some(stamps) }, what))
    }

    /// Queues a collective that `post` puts on the engine, as one unit on the group's queue: it completes
    /// after everything posted on the group before it, once every peer posted the same kind in its place.
    pub(super) fn post_collective(&self, what: String, post: impl FnOnce() -> Result<Work>) -> Result<Arc<Ticket>> {
        self.order.connect(&what, self.timeout())?;
        let peers: Vec<usize> = (0..self.order.size).filter(|&r| r != self.rank).collect();
        // stamped and posted under the queue's lock, so that the stamps follow the posting order
        let mut g = self.group.lock().unwrap_or_else(|e| e.into_inner());
        // a post that fails leaves no stamp behind (its place would shift every later unit's)
        let work = post()?;
        let stamps = self.order.stamp(&peers, &what, true)?;
        let (queue, _) = g.get_or_insert_with(|| self.group_queue());
        Ok(self.enqueue(queue, Unit { ops: Vec::new(), posted: Some(work), stamps: Some(stamps) }, what))
    }

    fn group_queue(&self) -> (Arc<Queue>, Seqs) {
        (self.start_queue(format!("the group stream of rank {}", self.rank)), Seqs::default())
    }

    fn enqueue(&self, queue: &Arc<Queue>, unit: Unit, what: String) -> Arc<Ticket> {
        let ticket = Arc::new(Ticket::default());
        let mut st = queue.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = &st.failed {
            ticket.complete(Err(refused(f, &queue.name, what)));
        } else {
            let Unit { ops, posted, stamps } = unit;
            st.items.push_back(Item { ops, posted, stamps, ticket: ticket.clone(), what });
            queue.cv.notify_all();
        }
        ticket
    }

    /// NCCL creates a pair's communicator at its first operation, in the poster's thread, and both ranks
    /// must take part: a rank whose first operation is with another peer leaves this one waiting.
    fn create_pair(&self, peer: usize, what: &str) -> Result<()> {
        let (lo, hi) = (self.rank.min(peer), self.rank.max(peer));
        let key = |r: usize| format!("tdx-strict/pair/{lo}-{hi}/{r}");
        self.store.set(&key(self.rank), b"1")?;
        let t = self.timeout();
        self.store.wait(&key(peer), t).map_err(|_| Error::Timeout {
            op: what.to_string(),
            timeout: t,
            msg: format!(
                "strict NCCL mode: the first point-to-point operation between ranks {lo} and {hi} creates their \
                 two-rank NCCL communicator, which blocks rank {} until rank {peer} joins it, and rank {peer} did \
                 not (with three or more ranks, a ring of unbatched sends and receives waits in a circle here): \
                 post the operations of a step together with batch_isend_irecv",
                self.rank
            ),
        })
    }

    fn start_queue(&self, name: String) -> Arc<Queue> {
        let q = Arc::new(Queue { name, state: Mutex::new(QueueState::default()), cv: Condvar::new() });
        self.started.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&q));
        let (worker, engine, rank) = (q.clone(), self.engine.clone(), self.rank);
        let (timeout, order) = (self.timeout.clone(), self.order.clone());
        std::thread::Builder::new()
            .name("tdx-strict".into())
            .spawn(move || worker.run(&engine, rank, timeout, &order))
            .map(|_| ())
            .unwrap_or_else(|e| {
                let mut st = q.state.lock().unwrap_or_else(|p| p.into_inner());
                st.failed =
                    Some(Error::Backend { op: "strict NCCL mode".into(), msg: format!("no worker thread: {e}") });
            });
        q
    }
}

impl Drop for Strict {
    fn drop(&mut self) {
        let pairs = self.pairs.get_mut().unwrap_or_else(|e| e.into_inner());
        let group = self.group.get_mut().unwrap_or_else(|e| e.into_inner());
        for (q, _) in pairs.values().chain(group.iter()) {
            q.state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            q.cv.notify_all();
        }
    }
}

impl Queue {
    /// Waits until the queue has nothing left to run (or failed), at most until `deadline`.
    fn wait_idle(&self, deadline: Instant) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while (st.busy || !st.items.is_empty()) && st.failed.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            st = self.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn run(&self, engine: &Engine, rank: usize, timeout: Arc<Mutex<Duration>>, order: &Order) {
        loop {
            let mut item = {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(i) = st.items.pop_front() {
                        st.busy = true;
                        break i;
                    }
                    if st.closed {
                        return;
                    }
                    st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            };
            let t = *timeout.lock().unwrap_or_else(|e| e.into_inner());
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.run_item(engine, rank, &mut item, t, order)
            }))
            .unwrap_or_else(|_| {
                Err(Error::Backend { op: item.what.clone(), msg: "strict NCCL mode: its worker panicked".into() })
            });
            let Item { ops, posted, ticket, what, .. } = item;
            drop(posted);
            // the tensors go before the waiter wakes: it may free or reuse their memory then
            drop(ops);
            {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(e) = &r {
                    for later in st.items.drain(..) {
                        later.ticket.complete(Err(refused(e, &self.name, later.what)));
                    }
                    st.failed = Some(copy_of(e, what));
                }
                st.busy = false;
                self.cv.notify_all();
            }
            ticket.complete(r);
        }
    }

    /// Posts a unit's messages at once and waits for all of them: sends with their headers, receives
    /// after checking the header.
    fn run_item(&self, engine: &Engine, rank: usize, item: &mut Item, timeout: Duration, order: &Order) -> Result<()> {
        let deadline = Instant::now() + timeout;
        if let Some(stamps) = &item.stamps {
            order.check(stamps, &item.what, &self.name, deadline, item.posted.as_ref())?;
        }
        if let Some(w) = item.posted.take() {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            return w.wait_timeout(left);
        }
        let item = &*item;
        let mut works = Vec::new();
        let mut heads = Vec::new();
        for (op, t) in &item.ops {
            let t = *t;
            if op.send {
                let h = Tensor::from_slice(&tensor_meta::encode(&op.tensor));
                works.push((post(engine, &h, op, t, true)?, op));
                works.push((post(engine, &op.tensor, op, t | 1, true)?, op));
            } else {
                let h = Tensor::f_zeros([tensor_meta::LEN as i64], (Kind::Int64, Device::Cpu))?;
                heads.push((post(engine, &h, op, t, false)?, h, op, t));
            }
        }
        let mut mismatch = None;
        for (w, h, op, t) in heads {
            self.wait(w, deadline, item, rank, op)?;
            let theirs = Vec::<i64>::try_from(&h)?;
            let mine = tensor_meta::encode(&op.tensor);
            if theirs[..] == mine[..] {
                works.push((post(engine, &op.tensor, op, t | 1, false)?, op));
            } else {
                mismatch.get_or_insert_with(|| {
                    format!(
                        "{} sent {} but {} posted {} (strict NCCL mode: {}; NCCL needs matched sizes)",
                        order.trace.who(op.peer),
                        tensor_meta::render(&theirs),
                        order.trace.who(rank),
                        tensor_meta::render(&mine),
                        item.what
                    )
                });
                // drained, so the sender does not hang
                if let Some(scratch) = tensor_meta::empty(&theirs, Device::Cpu) {
                    works.push((post(engine, &scratch, op, t | 1, false)?, op));
                }
            }
        }
        for (w, op) in works {
            self.wait(w, deadline, item, rank, op)?;
        }
        match mismatch {
            Some(msg) => Err(Error::mismatch(item.what.clone(), msg)),
            None => Ok(()),
        }
    }

    fn wait(&self, w: Work, deadline: Instant, item: &Item, rank: usize, op: &Op) -> Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        w.wait_timeout(left.max(Duration::from_millis(1))).map_err(|e| match e {
            Error::Timeout { timeout, .. } => {
                let behind: Vec<String> = {
                    let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    st.items.iter().take(4).map(|i| i.what.clone()).collect()
                };
                let queued = if behind.is_empty() {
                    String::new()
                } else {
                    format!("; queued behind it on this rank: {}", behind.join("; "))
                };
                Error::Timeout {
                    op: item.what.clone(),
                    timeout,
                    msg: format!(
                        "strict NCCL mode: rank {rank}'s {} with rank {} on {} did not complete; on NCCL this \
                         hangs: operations on a stream run in posting order and a receive waits for the peer's \
                         matching send{queued}",
                        if op.send { "send" } else { "receive" },
                        op.peer,
                        self.name,
                    ),
                }
            }
            other => other,
        })
    }
}

/// One Gloo message of a unit.
fn post(engine: &Engine, t: &Tensor, op: &Op, tag: i32, send: bool) -> Result<Work> {
    let peer = op.peer;
    // c10d's work keeps its own reference to the tensor until it completes
    let (code, work) = if send { engine.pg().send(t, peer, tag) } else { engine.pg().recv(t, peer, tag) };
    let what = move || format!("strict {} rank {peer} (tag {tag})", if send { "send to" } else { "receive from" });
    check(code, Duration::ZERO, what)?;
    let work = work.ok_or_else(|| Error::invalid(what(), "shim returned no work"))?;
    Ok(Work::new(work, Duration::ZERO, Box::new(what), None))
}
