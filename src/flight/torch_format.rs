//! A dump in PyTorch's own flight-recorder format, beside ours: the pickle that libtorch's recorder
//! writes (`version` "2.10", `pg_config`, `entries`), one file per rank named `fr_rank_<R>`, so that
//! PyTorch's analyzer (`torchfrtrace DIR`, `python -m torch.distributed.flight_recorder.fr_trace`) reads
//! a tch-dist job's dumps.
//!
//! What maps: every collective of ours (all_reduce, broadcast, all_gather, _all_gather_base,
//! reduce_scatter, _reduce_scatter_base, barrier) and send/recv, with PyTorch's numbering (collectives
//! and point-to-point apart, from 1). Batched point-to-point has no counterpart there and is left out.
//! States: completed, or `started` for one still running or failed. A subgroup's ranks are read from its
//! name (`tp [0, 1]`): for a subgroup of a subgroup they are ranks of its parent.
use super::pickle::Py;
use super::record::{Dump, Entry, EntryState};

/// The file name prefix (the analyzer infers it, or takes `--prefix fr_rank_`).
pub(crate) const PREFIX: &str = "fr_rank_";

/// PyTorch's name and description of one of our groups.
fn pg_of(group: &str) -> (String, String) {
    if group == "default" {
        ("0".into(), "default_pg".into())
    } else {
        (group.to_string(), group.to_string())
    }
}

/// The members of a group, as PyTorch writes them: `"[0, 1]"`.
fn members(e: &Entry) -> String {
    let named = e.group.rfind('[').and_then(|i| e.group[i..].strip_suffix(']').map(|r| r[1..].to_string()));
    let ranks = named.unwrap_or_else(|| (0..e.group_size).map(|r| r.to_string()).collect::<Vec<_>>().join(", "));
    format!("[{ranks}]")
}

/// c10's name of a dtype, from tch's (`Int64` -> `Long`).
fn dtype(kind: &str) -> String {
    match kind {
        "Int64" => "Long",
        "Uint8" => "Byte",
        "Int8" => "Char",
        "Int16" => "Short",
        other => other,
    }
    .to_string()
}

/// The first tensor described after `after` in `op` (`Float[2, 64] on Cpu`): its dtype and shape.
fn tensor_after(op: &str, after: &str) -> Option<(String, Vec<i64>)> {
    let rest = &op[op.find(after)? + after.len()..];
    let open = rest.find('[')?;
    let close = rest[open..].find(']')? + open;
    let kind = rest[..open].trim();
    let dims = rest[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().ok())
        .collect::<Option<Vec<i64>>>()?;
    Some((dtype(kind), dims))
}

/// A peer's rank in `op` after `marker` (`to rank 1`).
fn peer_after(op: &str, marker: &str) -> Option<usize> {
    let rest = &op[op.find(marker)? + marker.len()..];
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// PyTorch's op name and the input and output tensors of one of our entries; None for what has no
/// counterpart.
type Shapes = (String, Vec<(String, Vec<i64>)>, Vec<(String, Vec<i64>)>);

fn shapes(e: &Entry) -> Option<Shapes> {
    let op = e.op.as_str();
    let world = e.group_size as i64;
    let one = |t: (String, Vec<i64>)| vec![t];
    let flat = |t: &(String, Vec<i64>), by: i64| (t.0.clone(), vec![t.1.iter().product::<i64>() * by]);
    Some(if op.starts_with("allreduce") {
        let t = tensor_after(op, " of ")?;
        ("all_reduce".into(), one(t.clone()), one(t))
    } else if op.starts_with("broadcast") {
        let t = tensor_after(op, " of ")?;
        ("broadcast".into(), one(t.clone()), one(t))
    } else if op.starts_with("all_gather_into_tensor") {
        ("_all_gather_base".into(), one(tensor_after(op, " of ")?), one(tensor_after(op, " into ")?))
    } else if op.starts_with("all_gather") {
        let t = tensor_after(op, " of ")?;
        ("all_gather".into(), one(t.clone()), one(flat(&t, world)))
    } else if op.starts_with("reduce_scatter_tensor") {
        ("_reduce_scatter_base".into(), one(tensor_after(op, " of ")?), one(tensor_after(op, " into ")?))
    } else if op.starts_with("reduce_scatter") {
        let t = tensor_after(op, " into ")?;
        ("reduce_scatter".into(), one(flat(&t, world)), one(t))
    } else if op.starts_with("barrier") {
        ("barrier".into(), vec![], vec![])
    } else if op.starts_with("send") {
        let t = tensor_after(op, " of ")?;
        (format!("send {}->{}", e.group_rank, peer_after(op, " to rank ")?), one(t.clone()), one(t))
    } else if op.starts_with("recv") {
        let t = tensor_after(op, " of ")?;
        (format!("recv {}<-{}", e.group_rank, peer_after(op, " from rank ")?), one(t.clone()), one(t))
    } else {
        return None;
    })
}

fn ns(secs: f64) -> Py {
    Py::Int((secs * 1e9) as i64)
}

fn sizes(ts: &[(String, Vec<i64>)]) -> Py {
    Py::List(ts.iter().map(|t| Py::List(t.1.iter().map(|&d| Py::Int(d)).collect())).collect())
}

fn dtypes(ts: &[(String, Vec<i64>)]) -> Py {
    Py::List(ts.iter().map(|t| Py::str(t.0.clone())).collect())
}

fn entry(e: &Entry, record_id: i64, timeout_ms: i64) -> Option<Py> {
    let (name, input, output) = shapes(e)?;
    let (pg, desc) = pg_of(&e.group);
    let state = if e.state == EntryState::Completed { "completed" } else { "started" };
    let p2p = super::record::is_p2p(&e.op);
    let mut frames = Vec::new();
    if !e.label.is_empty() {
        frames.push(Py::Dict(vec![
            ("name".into(), Py::str(e.label.clone())),
            ("filename".into(), Py::str("tch-dist label")),
            ("line".into(), Py::Int(0)),
        ]));
    }
    Some(Py::Dict(vec![
        ("record_id".into(), Py::Int(record_id)),
        ("pg_id".into(), Py::Int(0)),
        ("process_group".into(), Py::Tuple2(Box::new(Py::str(pg)), Box::new(Py::str(desc)))),
        ("collective_seq_id".into(), Py::Int(e.collective_seq as i64)),
        ("p2p_seq_id".into(), Py::Int(e.p2p_seq as i64)),
        ("op_id".into(), Py::Int(e.seq as i64)),
        ("profiling_name".into(), Py::str(format!("{}:{name}", e.backend))),
        ("time_created_ns".into(), ns(e.enqueued)),
        ("input_sizes".into(), sizes(&input)),
        ("input_dtypes".into(), dtypes(&input)),
        ("output_sizes".into(), sizes(&output)),
        ("output_dtypes".into(), dtypes(&output)),
        ("state".into(), Py::str(state)),
        ("time_discovered_started_ns".into(), Py::None),
        ("time_discovered_completed_ns".into(), e.ended.map_or(Py::None, ns)),
        ("retired".into(), Py::Bool(e.state != EntryState::Pending)),
        ("timeout_ms".into(), Py::Int(timeout_ms)),
        ("is_p2p".into(), Py::Bool(p2p)),
        ("frames".into(), Py::List(frames)),
    ]))
}

/// The dump as PyTorch's pickle.
pub(crate) fn to_pickle(d: &Dump, timeout_ms: i64) -> Vec<u8> {
    let mut pg_config: Vec<(String, Py)> = Vec::new();
    let mut entries = Vec::new();
    for e in &d.entries {
        let Some(py) = entry(e, entries.len() as i64, timeout_ms) else { continue };
        entries.push(py);
        let (pg, desc) = pg_of(&e.group);
        if !pg_config.iter().any(|(k, _)| *k == pg) {
            let cfg = Py::Dict(vec![
                ("name".into(), Py::str(pg.clone())),
                ("desc".into(), Py::str(desc)),
                ("ranks".into(), Py::str(members(e))),
            ]);
            pg_config.push((pg, cfg));
        }
    }
    Py::Dict(vec![
        ("version".into(), Py::str("2.10")),
        ("comm_lib_version".into(), Py::str("tch-dist")),
        ("pg_config".into(), Py::Dict(pg_config)),
        ("entries".into(), Py::List(entries)),
    ])
    .to_pickle()
}
