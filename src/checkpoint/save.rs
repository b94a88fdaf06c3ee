//! Saving a sharded checkpoint, synchronously or in the background.
//!
//! The ranks coordinate through the group's store rather than collectives, so a background save never
//! competes with training's collectives: each rank posts what it holds, all compute the same plan
//! ([`super::plan`]), each writes and syncs its own file and posts where its chunks landed (or its error),
//! and rank 0 writes the metadata last (temporary name, fsync, rename) and posts the outcome, which every
//! rank waits for. A crash before that rename leaves the directory without metadata, so the previous
//! checkpoint is still the latest loadable one; a failure on any rank fails the save on every rank at once,
//! naming it.
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

use super::format::{self, ChunkMeta, FileMeta, Metadata, Piece, TensorMeta, Written, METADATA};
use super::plan::{assign, Desc};
use super::state::StateDict;
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::store::Store;

/// The directory of the checkpoint of `step` under `root`.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:010}"))
}

/// The committed checkpoints under `root` (those with metadata), by step, oldest first.
pub fn committed_steps(root: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            e.path().join(METADATA).exists().then_some(step)
        })
        .collect();
    v.sort();
    v
}

type Writing = JoinHandle<(Result<()>, Vec<Tensor>)>;

#[derive(Serialize, Deserialize)]
enum Posted<T> {
    Ok(T),
    Failed(String),
}

#[derive(Serialize, Deserialize)]
struct Done {
    file: Option<FileMeta>,
    chunks: Vec<Written>,
}

/// Saves and loads sharded checkpoints under one root directory (`root/step-0000000100/`), one per
/// step, each loadable onto another layout ([`StateDict`]).
///
/// ```no_run
/// # let pg = std::sync::Arc::new(tch_dist::ProcessGroup::from_env()?);
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// use tch_dist::checkpoint::{Checkpointer, StateDict};
/// let mut ck = Checkpointer::new(pg, "ckpt")?.keep_last(2);
/// let mut sd = StateDict::new();
/// sd.var_store("model", &vs);
/// let start = ck.load(&mut sd)?.unwrap_or(0); // the step to resume from
/// // ... train; every k steps:
/// ck.async_save(start + 10, &StateDict::new().var_store("model", &vs))?; // returns once copied
/// ck.wait()?;
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub struct Checkpointer {
    pg: Arc<ProcessGroup>,
    store: Store,
    root: PathBuf,
    seq: u64,
    keep: Option<usize>,
    /// The save in flight: its step, and its writer, which hands back the staging buffers.
    pending: Option<(u64, Writing)>,
    /// Staging buffers of finished asynchronous saves, reused by the next (by dtype and shape).
    pool: HashMap<String, Vec<Tensor>>,
}

impl Checkpointer {
    /// Collective: every rank of `pg` creates its checkpointer together, with the same `root` (a
    /// directory every rank can read and write, shared between nodes).
    pub fn new(pg: Arc<ProcessGroup>, root: impl AsRef<Path>) -> Result<Checkpointer> {
        // keys of this checkpointer's saves, apart from any earlier one's in the same store
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0)
            ^ (std::process::id() as i64) << 40;
        let nonce = pg.meta().broadcast("checkpointer", &[nonce], 0)?[0];
        let store = pg.store().prefixed(&format!("checkpoint/{nonce:x}/"))?;
        Ok(Checkpointer {
            pg,
            store,
            root: root.as_ref().to_path_buf(),
            seq: 0,
            keep: None,
            pending: None,
            pool: HashMap::new(),
        })
    }

    /// After each save, deletes all but the newest `n` committed checkpoints (default: keeps all).
    pub fn keep_last(mut self, n: usize) -> Self {
        self.keep = Some(n.max(1));
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub(crate) fn pg_handle(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// Saves `sd` as the checkpoint of `step`; returns when it is committed on every rank. Collective.
    pub fn save(&mut self, step: u64, sd: &StateDict) -> Result<()> {
        let _call = self.pg.enter_call("Checkpointer::save");
        self.start(step, sd, false)?;
        self.wait().map(|_| ())
    }

    /// Copies this rank's share of `sd` to CPU buffers and returns; a background thread writes it while
    /// training goes on. The next save, load or [`wait`](Self::wait) waits for it first. Collective.
    pub fn async_save(&mut self, step: u64, sd: &StateDict) -> Result<()> {
        self.start(step, sd, true)
    }

    /// Waits for the save in flight, if any, and returns its step once committed on every rank.
    pub fn wait(&mut self) -> Result<Option<u64>> {
        let Some((step, h)) = self.pending.take() else { return Ok(None) };
        let (r, staged) =
            h.join().map_err(|_| Error::invalid("checkpoint save", format!("the writer of step {step} panicked")))?;
        for t in staged {
            self.pool.entry(pool_key(&t)).or_default().push(t);
        }
        r.map(|()| Some(step))
    }

    fn start(&mut self, step: u64, sd: &StateDict, background: bool) -> Result<()> {
        self.wait()?;
        // every rank saves, the same step: a rank that saves alone meets the others' next collective
        // (or its agreement check) here, and every rank fails at once naming both, instead of waiting
        // in the store for parts that never come
        self.pg.meta().agree("checkpoint save", &[SAVE_TAG, step as i64], |rows| {
            let listing = crate::group::meta::by_rank(rows, describe_save, "; ");
            format!("the ranks are not all saving the same step ({listing}): every rank calls save, with one step")
        })?;
        let seq = self.seq;
        self.seq += 1;
        let (rank, world) = (self.pg.rank(), self.pg.size());
        let dir = step_dir(&self.root, step);
        let _l = crate::flight::label(format!("checkpoint save, step {step}"));
        let local = (|| {
            let _g = tch::no_grad_guard();
            sd.check()?;
            let opt_items = sd.optimizer_items()?;
            let mut out = Vec::new();
            for item in sd.items.iter().chain(&opt_items) {
                let dtype = format::dtype_name(item.local.kind())?;
                for (bx, data) in item.pieces()? {
                    let bytes = bx.volume() * item.local.kind().elt_size_in_bytes() as i64;
                    // a model variable nothing trains (batch norm's statistics): ranks may update it apart
                    let buffer = item.param.is_some() && !item.local.requires_grad();
                    let (name, shape) = (item.name.clone(), item.global.clone());
                    let d = Desc { name, shape, dtype: dtype.into(), bx, bytes, buffer };
                    out.push((d, data));
                }
            }
            if rank == 0 {
                // uncommit an older save of this step before anyone overwrites its files
                std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
                match std::fs::remove_file(dir.join(METADATA)) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&dir, e)),
                    _ => {}
                }
            }
            Ok(out)
        })();
        let posted = match &local {
            Ok(v) => Posted::Ok(v.iter().map(|(d, _)| d.clone()).collect::<Vec<_>>()),
            Err(e) => Posted::Failed(e.to_string()),
        };
        self.post(&format!("{seq}/desc/{rank}"), &posted)?;
        let mut all: Vec<Vec<Desc>> = Vec::with_capacity(world);
        let mut failed = None;
        for r in 0..world {
            match fetch::<Vec<Desc>>(&self.store, &format!("{seq}/desc/{r}"), r)? {
                Posted::Ok(v) => all.push(v),
                Posted::Failed(msg) => {
                    failed.get_or_insert((r, msg));
                    all.push(Vec::new());
                }
            }
        }
        let local = local?;
        if let Some((r, msg)) = failed {
            return Err(Error::RankFailed { op: "checkpoint save".into(), rank: r, msg });
        }
        let plan = assign(&all)?;
        // this rank's pieces, copied out when saving in the background
        let pieces: Result<Vec<Piece>> = plan[rank]
            .iter()
            .map(|&i| {
                let (d, data) = &local[i];
                let data = if background { self.stage(data)? } else { on_cpu(data)? };
                Ok(Piece { name: d.name.clone(), bx: d.bx.clone(), data })
            })
            .collect();
        let shapes: BTreeMap<String, (Vec<i64>, String)> = if rank == 0 {
            all.iter().flatten().map(|d| (d.name.clone(), (d.shape.clone(), d.dtype.clone()))).collect()
        } else {
            BTreeMap::new()
        };
        let mut layout = sd.layout.clone();
        layout.insert("world_size".into(), world as i64);
        let job = Writer {
            store: self.store.clone(),
            seq,
            rank,
            world,
            dir,
            step,
            root: self.root.clone(),
            keep: self.keep,
            shapes,
            layout,
        };
        if background {
            let h = std::thread::Builder::new()
                .name(format!("checkpoint-{step}"))
                .spawn(move || {
                    let staged: Vec<Tensor> =
                        pieces.as_ref().map(|p| p.iter().map(|p| p.data.shallow_clone()).collect()).unwrap_or_default();
                    (job.run(pieces), staged)
                })
                .map_err(|e| Error::invalid("checkpoint save", format!("cannot start the writer thread: {e}")))?;
            self.pending = Some((step, h));
            Ok(())
        } else {
            job.run(pieces)
        }
    }

    /// A CPU copy of `t` in a buffer of the pool, or a new one.
    fn stage(&mut self, t: &Tensor) -> Result<Tensor> {
        let buf = match self.pool.get_mut(&pool_key(t)).and_then(|v| v.pop()) {
            Some(b) => b,
            None => {
                let b = Tensor::f_empty(t.size().as_slice(), (t.kind(), Device::Cpu))?;
                if t.device().is_cuda() {
                    b.f_pin_memory(t.device())?
                } else {
                    b
                }
            }
        };
        // `buf` is ours alone (fresh, or back from a finished save); a plain copy where bytes cannot go
        if !crate::ffi::bytes::copy(t, &buf) {
            buf.shallow_clone().f_copy_(t)?;
        }
        Ok(buf)
    }

    fn post<T: Serialize>(&self, key: &str, v: &T) -> Result<()> {
        let bytes = serde_json::to_vec(v).map_err(|e| Error::invalid("checkpoint save", e.to_string()))?;
        self.store.set(key, &bytes)
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // a save in flight finishes (or fails) before its buffers and store go
        let _ = self.wait();
    }
}

/// The first value a save's agreement sends, which another rank's collective does not (an operation
/// code or a shape), so that a save is told from it.
const SAVE_TAG: i64 = 0x5A7E_C4EC;

/// One rank's row in a save's agreement: the step, or what else it was at.
fn describe_save(r: &[i64]) -> String {
    match r {
        [SAVE_TAG, step] => format!("saving step {step}"),
        _ => "in another collective, not saving".to_string(),
    }
}

fn pool_key(t: &Tensor) -> String {
    format!("{:?}{:?}", t.kind(), t.size())
}

fn fetch<T: for<'de> Deserialize<'de>>(store: &Store, key: &str, rank: usize) -> Result<Posted<T>> {
    let bytes = store.get(key).map_err(|e| e.with_note(&format!("rank {rank} did not post its part of the save")))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::invalid("checkpoint save", format!("rank {rank}'s {key}: {e}")))
}

fn io_err(p: &Path, e: std::io::Error) -> Error {
    Error::invalid(format!("checkpoint {}", p.display()), e.to_string())
}

/// `t` contiguous on the CPU (itself when it already is).
fn on_cpu(t: &Tensor) -> Result<Tensor> {
    Ok(t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?)
}

/// The part of a save after planning: what the background thread runs.
struct Writer {
    store: Store,
    seq: u64,
    rank: usize,
    world: usize,
    dir: PathBuf,
    step: u64,
    root: PathBuf,
    keep: Option<usize>,
    /// Rank 0: every tensor's shape and dtype.
    shapes: BTreeMap<String, (Vec<i64>, String)>,
    layout: BTreeMap<String, i64>,
}

impl Writer {
    fn run(&self, pieces: Result<Vec<Piece>>) -> Result<()> {
        let mine = pieces.and_then(|pieces| {
            if pieces.is_empty() {
                return Ok(Done { file: None, chunks: Vec::new() });
            }
            std::fs::create_dir_all(&self.dir).map_err(|e| io_err(&self.dir, e))?;
            let name = format!("rank-{:05}.safetensors", self.rank);
            let (bytes, crc32, chunks) = format::write_file(&self.dir.join(&name), &pieces)?;
            Ok(Done { file: Some(FileMeta { name, rank: self.rank, bytes, crc32 }), chunks })
        });
        let posted = match &mine {
            Ok(d) => Posted::Ok(d),
            Err(e) => Posted::Failed(e.to_string()),
        };
        let bytes = serde_json::to_vec(&posted).map_err(|e| Error::invalid("checkpoint save", e.to_string()))?;
        self.store.set(&format!("{}/done/{}", self.seq, self.rank), &bytes)?;
        let commit_key = format!("{}/commit", self.seq);
        if self.rank == 0 {
            let outcome = match self.commit() {
                Ok(()) => Posted::Ok(()),
                Err(Error::RankFailed { rank, msg, .. }) => Posted::Failed(format!("{rank}\n{msg}")),
                Err(e) => Posted::Failed(format!("0\n{e}")),
            };
            let bytes = serde_json::to_vec(&outcome).map_err(|e| Error::invalid("checkpoint save", e.to_string()))?;
            self.store.set(&commit_key, &bytes)?;
        }
        mine?;
        match fetch::<()>(&self.store, &commit_key, 0)? {
            Posted::Ok(()) => Ok(()),
            Posted::Failed(m) => {
                let (r, msg) = m.split_once('\n').unwrap_or(("0", m.as_str()));
                Err(Error::RankFailed { op: "checkpoint save".into(), rank: r.parse().unwrap_or(0), msg: msg.into() })
            }
        }
    }

    /// Rank 0: gathers where every chunk landed, writes the metadata, drops old checkpoints.
    fn commit(&self) -> Result<()> {
        let mut files = Vec::new();
        let mut tensors: BTreeMap<String, TensorMeta> = self
            .shapes
            .iter()
            .map(|(n, (shape, dtype))| {
                (n.clone(), TensorMeta { shape: shape.clone(), dtype: dtype.clone(), chunks: Vec::new() })
            })
            .collect();
        for r in 0..self.world {
            let done = match fetch::<Done>(&self.store, &format!("{}/done/{r}", self.seq), r)? {
                Posted::Ok(d) => d,
                Posted::Failed(msg) => return Err(Error::RankFailed { op: "checkpoint save".into(), rank: r, msg }),
            };
            let Some(file) = done.file else { continue };
            files.push(file);
            for w in done.chunks {
                let t = tensors.get_mut(&w.name).ok_or_else(|| {
                    Error::invalid("checkpoint save", format!("rank {r} wrote {}, which no rank described", w.name))
                })?;
                t.chunks.push(ChunkMeta {
                    offsets: w.bx.offsets,
                    lengths: w.bx.lengths,
                    file: files.len() - 1,
                    begin: w.begin,
                    end: w.end,
                    block_crc32: w.block_crc32,
                    unchecked: false,
                    stored_as: None,
                });
            }
        }
        let meta = Metadata {
            format: format::FORMAT.into(),
            version: format::VERSION,
            step: self.step,
            layout: self.layout.clone(),
            files,
            tensors,
        };
        let json = serde_json::to_vec(&meta).map_err(|e| Error::invalid("checkpoint save", e.to_string()))?;
        let tmp = self.dir.join(format!(".{METADATA}.tmp"));
        let io = |e| io_err(&self.dir, e);
        std::fs::write(&tmp, &json).map_err(io)?;
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io)?;
        std::fs::rename(&tmp, self.dir.join(METADATA)).map_err(io)?;
        std::fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io)?;
        if let Some(keep) = self.keep {
            let steps = committed_steps(&self.root);
            for &old in steps.iter().take(steps.len().saturating_sub(keep)) {
                let _ = std::fs::remove_dir_all(step_dir(&self.root, old));
            }
        }
        Ok(())
    }
}
