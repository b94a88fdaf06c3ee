//! The ring of recent operations, the caller's labels, and dumps.
use std::cell::RefCell;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::progress::PeerProgress;
use crate::error::{Error, Result};

/// How an operation ended, as far as this rank knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryState {
    /// Enqueued, not waited for yet (or still being waited for).
    Pending,
    Completed,
    Failed,
}

/// One collective or point-to-point operation.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    /// Process-wide order.
    pub id: u64,
    /// The group's name (`default`, or the name and ranks of a subgroup).
    pub group: String,
    pub group_rank: usize,
    pub group_size: usize,
    /// 1, 2, ... in this group: the same collective has the same number on every rank.
    pub seq: u64,
    /// PyTorch's numbering (for its flight-recorder format): collectives and point-to-point operations
    /// counted apart, each from 1; a point-to-point operation keeps the collective number before it.
    #[serde(default)]
    pub collective_seq: u64,
    #[serde(default)]
    pub p2p_seq: u64,
    /// The operation, with dtype, shape and device, e.g. `allreduce(Sum) of Float[1024] on Cpu`.
    pub op: String,
    pub backend: String,
    /// What the caller was doing (`DDP bucket 3`, `ZeRO gather 7`), or empty.
    pub label: String,
    /// Seconds since the Unix epoch.
    pub enqueued: f64,
    pub ended: Option<f64>,
    pub state: EntryState,
    pub error: Option<String>,
}

/// What a rank writes when something fails.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Dump {
    /// `RANK` (the global rank) when set, else the rank in the failing group.
    pub rank: usize,
    pub pid: u32,
    pub host: String,
    pub time: f64,
    /// The error that caused the dump.
    pub reason: String,
    /// What the failing rank read of the other ranks' progress in the failing group.
    pub peers: Vec<PeerProgress>,
    pub entries: Vec<Entry>,
    /// The world ranks of each group's members, by the group's name (for the analysis: who should have
    /// entered a subgroup's collective).
    #[serde(default)]
    pub groups: std::collections::BTreeMap<String, Vec<usize>>,
}

pub(crate) fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

struct Ring {
    capacity: usize,
    entries: Mutex<VecDeque<Entry>>,
    next_id: AtomicU64,
}

fn ring() -> &'static Ring {
    static RING: OnceLock<Ring> = OnceLock::new();
    RING.get_or_init(|| {
        let capacity = crate::settings::trace_entries();
        Ring { capacity, entries: Mutex::new(VecDeque::with_capacity(capacity.min(4096))), next_id: AtomicU64::new(1) }
    })
}

pub(crate) fn enabled() -> bool {
    ring().capacity > 0
}

thread_local! {
    static LABEL: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Restores the previous label when dropped.
#[must_use = "the label holds only while the guard lives"]
pub struct LabelGuard {
    previous: Option<String>,
    // the label belongs to this thread
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for LabelGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        LABEL.with(|l| *l.borrow_mut() = previous);
    }
}

/// Labels the collectives this thread starts while the guard lives (they show in the flight recorder and
/// in errors): `let _l = flight::label("ZeRO gather 7");`.
pub fn label(text: impl Into<String>) -> LabelGuard {
    let previous = LABEL.with(|l| l.borrow_mut().replace(text.into()));
    LabelGuard { previous, _not_send: std::marker::PhantomData }
}

pub(crate) fn current_label() -> String {
    LABEL.with(|l| l.borrow().clone().unwrap_or_default())
}

/// An operation's numbers in its group: among all its operations, and as PyTorch counts.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Seq {
    pub all: u64,
    pub collective: u64,
    pub p2p: u64,
}

/// Whether an operation (as the recorder names it) is point-to-point: such operations pair up by sender
/// and receiver, not by sequence number.
pub(crate) fn is_p2p(op: &str) -> bool {
    op.starts_with("send") || op.starts_with("recv") || op.starts_with("batch")
}

/// An operation being recorded; ends it when told how it ended.
pub(crate) struct Recording {
    id: u64,
}

impl Recording {
    /// Starts recording (None when recording is off).
    pub(crate) fn start(group: &str, rank: usize, size: usize, seq: Seq, op: &str, backend: &str) -> Option<Recording> {
        let r = ring();
        if r.capacity == 0 {
            return None;
        }
        let id = r.next_id.fetch_add(1, Ordering::Relaxed);
        let e = Entry {
            id,
            group: group.to_string(),
            group_rank: rank,
            group_size: size,
            seq: seq.all,
            collective_seq: seq.collective,
            p2p_seq: seq.p2p,
            op: op.to_string(),
            backend: backend.to_string(),
            label: current_label(),
            enqueued: now(),
            ended: None,
            state: EntryState::Pending,
            error: None,
        };
        let mut ring = r.entries.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() == r.capacity {
            ring.pop_front();
        }
        ring.push_back(e);
        Some(Recording { id })
    }

    pub(crate) fn end(&self, error: Option<&str>) {
        let mut ring = ring().entries.lock().unwrap_or_else(|p| p.into_inner());
        let Some(first) = ring.front().map(|e| e.id) else { return };
        // ids are consecutive in the ring; an entry already pushed out is simply gone
        if let Some(e) = self.id.checked_sub(first).and_then(|i| ring.get_mut(i as usize)) {
            let ended = now();
            e.ended = Some(ended);
            e.state = if error.is_some() { EntryState::Failed } else { EntryState::Completed };
            e.error = error.map(str::to_string);
            crate::timeline::collective(&e.group, &e.op, &e.label, e.enqueued, ended, error.is_some());
        }
    }
}

/// Seconds one recorded operation costs the thread that starts it (recording it and ending it), measured
/// over `n` operations of a made-up group (for benchmarks; the entries land in the ring).
#[doc(hidden)]
pub fn probe(n: usize) -> f64 {
    let start = std::time::Instant::now();
    for i in 0..n {
        let _l = label("flight recorder probe");
        let seq = Seq { all: i as u64, collective: i as u64, p2p: 0 };
        if let Some(r) = Recording::start("probe", 0, 1, seq, "allreduce(Sum) of Float[1024] on Cpu", "gloo") {
            r.end(None);
        }
    }
    start.elapsed().as_secs_f64() / n.max(1) as f64
}

/// A copy of the recorded operations, oldest first.
pub fn entries() -> Vec<Entry> {
    ring().entries.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
}

/// Writes this process's ring to `TCH_DIST_TRACE_DIR/rank<R>.json` (nothing when the variable is unset or
/// recording is off); returns the file written.
pub fn dump(reason: &str) -> Option<PathBuf> {
    dump_with(reason, Vec::new(), None)
}

pub(crate) fn dump_with(reason: &str, peers: Vec<PeerProgress>, group_rank: Option<usize>) -> Option<PathBuf> {
    let dir = crate::settings::trace_dir()?;
    if !enabled() {
        return None;
    }
    let rank = crate::settings::launch_rank().or(group_rank).unwrap_or(0);
    let d = Dump {
        rank,
        pid: std::process::id(),
        host: crate::ffi::hostname(),
        time: now(),
        reason: reason.to_string(),
        peers,
        entries: entries(),
        groups: super::progress::members(),
    };
    let text = serde_json::to_string_pretty(&d).ok()?;
    DUMPED.store(true, Ordering::SeqCst);
    std::fs::create_dir_all(&dir).ok()?;
    let path = dump_path(&dir, rank);
    write_whole(&path, text.as_bytes())?;
    // PyTorch's format beside it, in a directory of its own (its analyzer reads every file it finds)
    let torch = dir.join(TORCH_DIR);
    std::fs::create_dir_all(&torch).ok()?;
    let timeout = crate::settings::timeout(&crate::settings::lookup).ok().flatten();
    let timeout_ms = timeout.map_or(600_000, |t| t.as_millis() as i64);
    write_whole(
        &torch.join(format!("{}{rank}", super::torch_format::PREFIX)),
        &super::torch_format::to_pickle(&d, timeout_ms),
    )?;
    Some(path)
}

/// Where in the dump directory the dumps in PyTorch's format go.
pub const TORCH_DIR: &str = "torch";

/// Set once this process has dumped its ring.
static DUMPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) fn has_dumped() -> bool {
    DUMPED.load(Ordering::SeqCst)
}

/// Writes `path` whole or not at all (a reader never sees half a dump).
fn write_whole(path: &std::path::Path, bytes: &[u8]) -> Option<()> {
    let name = path.file_name()?.to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).ok()?;
    std::fs::rename(&tmp, path).ok()
}

fn dump_path(dir: &std::path::Path, rank: usize) -> PathBuf {
    dir.join(format!("rank{rank}.json"))
}

/// Removes the dumps of `ranks` left in `dir` by an earlier job, before this job's workers start: a
/// launcher's default directory is named after its process id, which the system reuses, and a stale
/// dump read as this job's would hide the real culprit (the rank that left none).
pub fn clear_dumps(dir: &std::path::Path, ranks: std::ops::Range<usize>) -> Result<()> {
    for r in ranks {
        for p in [dump_path(dir, r), dir.join(TORCH_DIR).join(format!("{}{r}", super::torch_format::PREFIX))] {
            match std::fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::invalid(format!("stale flight dump {}", p.display()), e.to_string()))
                }
                _ => {}
            }
        }
    }
    Ok(())
}
