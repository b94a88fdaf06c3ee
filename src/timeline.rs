//! A timeline of each rank's step (Chrome's trace-event JSON, which ui.perfetto.dev and chrome://tracing
//! open): forward, backward and optimizer spans from the wrappers, every collective from the flight
//! recorder (enqueued to ended, with its label: `DDP bucket 3`), pipeline actions. On when
//! `TCH_DIST_TIMELINE_DIR` is set (tchrun's `--trace-out FILE` sets it for its workers and merges the
//! ranks' files into FILE when they end): each process writes `timeline-rank<RANK>.json` there at exit.
//!
//! Off, a span costs one load of a once-initialised flag. On, events go to one capped list
//! (`TCH_DIST_TIMELINE_EVENTS`, 100000 by default; later events are counted, not kept).
//!
//! Tracks: one process per rank (`pid` = rank); spans on the thread that ran them, collectives on rows of
//! their own per process group (they overlap compute, and each other when several are in flight).
//! Collectives show while the flight recorder records (the default).
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One complete event (Chrome's `"ph": "X"`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TraceEvent {
    pub name: String,
    pub cat: String,
    pub ph: String,
    /// The rank.
    pub pid: u64,
    /// The thread, or a collective row (from 1000: 16 per process group, in the order groups first
    /// record).
    pub tid: u64,
    /// Microseconds since the Unix epoch (one clock per host).
    pub ts: f64,
    pub dur: f64,
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub args: HashMap<String, String>,
}

struct Timeline {
    dir: PathBuf,
    rank: u64,
    cap: usize,
    events: Mutex<State>,
}

#[derive(Default)]
struct State {
    events: Vec<TraceEvent>,
    dropped: u64,
    /// Collective lanes by group name: the group's number, and when each of its rows is free again
    /// (collectives in flight together overlap, and a track shows nested spans only).
    lanes: HashMap<String, (u64, Vec<f64>)>,
    threads: HashMap<std::thread::ThreadId, u64>,
}

fn timeline() -> Option<&'static Timeline> {
    static T: OnceLock<Option<Timeline>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = crate::settings::timeline_dir()?;
        let rank = crate::settings::launch_rank().unwrap_or(0) as u64;
        let cap = crate::settings::timeline_events();
        crate::ffi::at_exit(write_at_exit);
        Some(Timeline { dir, rank, cap, events: Mutex::new(State::default()) })
    })
    .as_ref()
}

extern "C" fn write_at_exit() {
    if let Err(e) = write() {
        eprintln!("tch-dist: timeline: {e}");
    }
}

/// Whether the timeline records.
pub fn enabled() -> bool {
    timeline().is_some()
}

/// Rows per group's collectives.
const ROWS: usize = 16;

fn lock(t: &Timeline) -> std::sync::MutexGuard<'_, State> {
    t.events.lock().unwrap_or_else(|p| p.into_inner())
}

fn push(t: &Timeline, mut e: TraceEvent, lane: Option<&str>) {
    let mut s = lock(t);
    if s.events.len() >= t.cap {
        s.dropped += 1;
        return;
    }
    e.tid = match lane {
        Some(group) => {
            let n = s.lanes.len() as u64;
            let (g, rows) = s.lanes.entry(group.to_string()).or_insert((n, Vec::new()));
            let row = match rows.iter().position(|&free| free <= e.ts) {
                Some(r) => r,
                None if rows.len() < ROWS => {
                    rows.push(0.0);
                    rows.len() - 1
                }
                None => ROWS - 1,
            };
            rows[row] = e.ts + e.dur;
            1000 + *g * ROWS as u64 + row as u64
        }
        None => {
            let n = s.threads.len() as u64;
            *s.threads.entry(std::thread::current().id()).or_insert(n)
        }
    };
    s.events.push(e);
}

/// A span on this thread's track, recorded when dropped (nothing when the timeline is off).
#[must_use = "the span ends when the guard drops"]
pub struct SpanGuard {
    open: Option<(String, &'static str, f64)>,
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        if let Some((name, cat, start)) = self.open.take() {
            completed(cat, || name, start, crate::flight::now());
        }
    }
}

/// Opens a span named `name()` (called only when the timeline is on) in category `cat` (`forward`,
/// `backward`, `optimizer`, `pipeline`...).
pub fn span(cat: &'static str, name: impl FnOnce() -> String) -> SpanGuard {
    if timeline().is_none() {
        return SpanGuard { open: None };
    }
    SpanGuard { open: Some((name(), cat, crate::flight::now())) }
}

/// Events recorded so far by this process (0 when off), those past the cap included.
pub fn recorded() -> u64 {
    timeline().map_or(0, |t| {
        let s = lock(t);
        s.events.len() as u64 + s.dropped
    })
}

/// Seconds one span costs the thread that records it (open and close), over `n` spans (for benchmarks;
/// with the timeline on, they land in it).
#[doc(hidden)]
pub fn probe(n: usize) -> f64 {
    let start = std::time::Instant::now();
    for i in 0..n {
        let _s = span("probe", || format!("timeline probe {i}"));
    }
    start.elapsed().as_secs_f64() / n.max(1) as f64
}

/// A span already ended (`start`, `end`: seconds since the Unix epoch) on this thread's track.
pub(crate) fn completed(cat: &'static str, name: impl FnOnce() -> String, start: f64, end: f64) {
    let Some(t) = timeline() else { return };
    push(t, event(t, name(), cat, start, end, HashMap::new()), None);
}

/// A complete event of this rank from `start` to `end` (seconds since the Unix epoch); its track is set
/// by `push`.
fn event(t: &Timeline, name: String, cat: &str, start: f64, end: f64, args: HashMap<String, String>) -> TraceEvent {
    TraceEvent {
        name,
        cat: cat.to_string(),
        ph: "X".into(),
        pid: t.rank,
        tid: 0,
        ts: start * 1e6,
        dur: (end - start).max(0.0) * 1e6,
        args,
    }
}

/// A collective, from the flight recorder's entry: on its group's lane, enqueued to ended.
pub(crate) fn collective(group: &str, op: &str, label: &str, enqueued: f64, ended: f64, failed: bool) {
    let Some(t) = timeline() else { return };
    let mut args = HashMap::from([("group".to_string(), group.to_string())]);
    if failed {
        args.insert("failed".into(), "true".into());
    }
    let name = if label.is_empty() { op.to_string() } else { format!("{label}: {op}") };
    push(t, event(t, name, "collective", enqueued, ended, args), Some(group));
}

/// The file one rank writes in `dir`.
pub fn rank_file(dir: &Path, rank: u64) -> PathBuf {
    dir.join(format!("timeline-rank{rank}.json"))
}

/// A trace file's JSON: the events, with names for the process and its tracks.
#[derive(Serialize, Deserialize, Default)]
pub struct Trace {
    #[serde(rename = "traceEvents")]
    pub events: Vec<serde_json::Value>,
    #[serde(rename = "displayTimeUnit", default)]
    pub unit: String,
}

/// Writes this process's timeline now (also done at exit); the file written, or None when off.
pub fn write() -> Result<Option<PathBuf>> {
    let Some(t) = timeline() else { return Ok(None) };
    let (events, lanes, threads, dropped) = {
        let s = lock(t);
        (s.events.clone(), s.lanes.clone(), s.threads.len(), s.dropped)
    };
    let mut out: Vec<serde_json::Value> = Vec::with_capacity(events.len() + lanes.len() + threads + 1);
    let meta = |name: &str, tid: u64, value: String| serde_json::json!({"name": name, "ph": "M", "pid": t.rank, "tid": tid, "args": {"name": value}});
    let dropped = if dropped > 0 { format!(" ({dropped} events past the cap not kept)") } else { String::new() };
    out.push(meta("process_name", 0, format!("rank {}{dropped}", t.rank)));
    out.push(
        serde_json::json!({"name": "process_sort_index", "ph": "M", "pid": t.rank, "args": {"sort_index": t.rank}}),
    );
    for i in 0..threads as u64 {
        out.push(meta("thread_name", i, if i == 0 { "main".into() } else { format!("thread {i}") }));
    }
    for (group, (n, rows)) in &lanes {
        for r in 0..rows.len() {
            let tid = 1000 + n * ROWS as u64 + r as u64;
            out.push(meta("thread_name", tid, format!("collectives: {group} ({})", r + 1)));
        }
    }
    for e in events {
        out.push(serde_json::to_value(e).map_err(|e| Error::invalid("timeline", e.to_string()))?);
    }
    let path = rank_file(&t.dir, t.rank);
    let io = |e: std::io::Error| Error::invalid(format!("timeline {}", path.display()), e.to_string());
    std::fs::create_dir_all(&t.dir).map_err(io)?;
    let body = serde_json::to_vec(&Trace { events: out, unit: "ms".into() })
        .map_err(|e| Error::invalid("timeline", e.to_string()))?;
    let mut f = std::fs::File::create(&path).map_err(io)?;
    f.write_all(&body).map_err(io)?;
    Ok(Some(path))
}

/// Merges every rank's file in `dir` into one trace at `out` (tchrun's `--trace-out`): each rank its own
/// process track, times shifted so that the earliest event starts at 0. Ranks on one host share its
/// clock; across hosts, each host's clock as it is. Returns the ranks merged.
pub fn merge(dir: &Path, out: &Path) -> Result<Vec<u64>> {
    let io = |p: &Path, e: std::io::Error| Error::invalid(format!("timeline {}", p.display()), e.to_string());
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let r = p.file_name()?.to_str()?.strip_prefix("timeline-rank")?.strip_suffix(".json")?.parse().ok()?;
            Some((r, p))
        })
        .collect();
    files.sort();
    let mut events = Vec::new();
    for (_, p) in &files {
        let text = std::fs::read(p).map_err(|e| io(p, e))?;
        let t: Trace = serde_json::from_slice(&text)
            .map_err(|e| Error::invalid(format!("timeline {}", p.display()), e.to_string()))?;
        events.extend(t.events);
    }
    let t0 = events.iter().filter_map(|e| e.get("ts").and_then(|t| t.as_f64())).fold(f64::INFINITY, f64::min);
    for e in events.iter_mut() {
        if let Some(ts) = e.get("ts").and_then(|t| t.as_f64()) {
            e["ts"] = serde_json::json!(ts - t0);
        }
    }
    let body = serde_json::to_vec(&Trace { events, unit: "ms".into() })
        .map_err(|e| Error::invalid("timeline", e.to_string()))?;
    std::fs::write(out, body).map_err(|e| io(out, e))?;
    Ok(files.into_iter().map(|(r, _)| r).collect())
}

/// Short names of `tracks` for the picture, from the trace's metadata: `r0 main`, `r0 coll default (1)`.
#[cfg(feature = "plot")]
fn track_labels(events: &[serde_json::Value], tracks: &[(u64, u64)]) -> Vec<String> {
    let name = |kind: &str, pid: u64, tid: Option<u64>| {
        events
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == kind && e["pid"] == pid && tid.is_none_or(|t| e["tid"] == t))
            .and_then(|e| e["args"]["name"].as_str().map(String::from))
    };
    tracks
        .iter()
        .map(|&(pid, tid)| {
            let process = name("process_name", pid, None).unwrap_or_else(|| format!("rank {pid}"));
            let process = process.split_whitespace().take(2).collect::<Vec<_>>().join(" ").replacen("rank ", "r", 1);
            let thread = name("thread_name", pid, Some(tid)).unwrap_or_else(|| format!("thread {tid}"));
            format!("{process} {}", thread.replacen("collectives: ", "coll ", 1))
        })
        .collect()
}

/// Draws a trace [`merge`] wrote (or one rank's file) as a PNG: a row per track, named at its left (each
/// rank's threads, then its collective rows), forward in blue, backward in green, optimizer steps in
/// orange, collectives in purple, fault tolerance in red, others (a pipeline stage's waits) grey; a span
/// inside another is drawn over it. Returns the number of rows. With the `plot` feature.
#[cfg(feature = "plot")]
pub fn write_png(trace: &Path, png: &Path) -> Result<usize> {
    let text =
        std::fs::read(trace).map_err(|e| Error::invalid(format!("timeline {}", trace.display()), e.to_string()))?;
    let t: Trace = serde_json::from_slice(&text)
        .map_err(|e| Error::invalid(format!("timeline {}", trace.display()), e.to_string()))?;
    let spans: Vec<TraceEvent> =
        t.events.iter().filter(|e| e["ph"] == "X").filter_map(|e| serde_json::from_value(e.clone()).ok()).collect();
    let mut tracks: Vec<(u64, u64)> = spans.iter().map(|e| (e.pid, e.tid)).collect();
    tracks.sort();
    tracks.dedup();
    if tracks.is_empty() {
        return Err(Error::invalid(format!("timeline {}", trace.display()), "holds no spans"));
    }
    // longest first: a span inside another (a wait inside a forward) is drawn over it, not under
    let mut spans = spans;
    spans.sort_by(|a, b| b.dur.partial_cmp(&a.dur).unwrap_or(std::cmp::Ordering::Equal));
    let bars: Vec<crate::plot::Bar> = spans
        .iter()
        .map(|e| crate::plot::Bar {
            row: tracks.binary_search(&(e.pid, e.tid)).unwrap_or(0),
            start: e.ts,
            end: e.ts + e.dur,
            color: match e.cat.as_str() {
                "forward" => (60, 110, 220),
                "backward" => (40, 170, 80),
                "optimizer" => (230, 150, 30),
                "collective" => (150, 90, 200),
                "fault tolerance" => (210, 50, 50),
                _ => (140, 140, 140),
            },
        })
        .collect();
    crate::plot::draw(png, &track_labels(&t.events, &tracks), 24, &bars)?;
    Ok(tracks.len())
}
