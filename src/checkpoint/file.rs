//! Single-file checkpoints: rank 0 writes a safetensors file (readable by PyTorch's
//! `safetensors.torch.load_file`) to a temporary name, syncs it, and renames it over the old one, so a
//! crash mid-write leaves the previous checkpoint intact; a checksum inside it catches a damaged file;
//! every rank learns whether the write succeeded. Loading: rank 0 reads and checks, and broadcasts, so
//! every rank resumes from the same values. For models every rank holds whole; sharded state uses
//! [`super::Checkpointer`].
//!
//! ```no_run
//! # let (pg, vs) = (tch_dist::ProcessGroup::from_env()?, tch::nn::VarStore::new(tch::Device::Cpu));
//! use tch_dist::checkpoint;
//! let path = std::path::Path::new("ckpt.safetensors");
//! let start = checkpoint::load_var_store(&pg, path, &vs)?.unwrap_or(0); // step to resume from
//! // ... train, and every k steps:
//! checkpoint::save_var_store(&pg, path, start + 10, &vs)?;
//! # Ok::<(), tch_dist::Error>(())
//! ```
use std::path::{Path, PathBuf};

use tch::{nn, Device, Tensor};

use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// The key under which the step count is stored.
pub const STEP_KEY: &str = "__step__";

fn io_err(what: String) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::invalid(what.clone(), e.to_string())
}

/// The key of the checksum stored with every checkpoint (FNV-1a over the step and every tensor's name,
/// dtype, shape and bytes, in name order), so a damaged file is refused instead of loaded.
pub const CHECKSUM_KEY: &str = "__checksum__";

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// The checksum of `step` and `tensors` (CPU, contiguous), independent of their order.
fn checksum(step: u64, tensors: &[(String, Tensor)]) -> Result<u64> {
    const PIECE: i64 = 1 << 24;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv(&mut h, &step.to_le_bytes());
    let mut sorted: Vec<&(String, Tensor)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in sorted {
        fnv(&mut h, name.as_bytes());
        fnv(&mut h, format!("{:?}{:?}", t.kind(), t.size()).as_bytes());
        let bytes = t.f_contiguous()?.f_view_dtype(tch::Kind::Uint8)?.f_reshape([-1])?;
        let n = bytes.numel() as i64;
        let mut at = 0;
        while at < n {
            let k = PIECE.min(n - at);
            fnv(&mut h, &Vec::<u8>::try_from(bytes.f_narrow(0, at, k)?)?);
            at += k;
        }
    }
    Ok(h)
}

/// Writes `tensors`, `step` and their checksum to `path` atomically (temporary file, fsync, rename, fsync
/// of the directory). Not collective: see [`save`] for the distributed form.
pub fn write_atomic(path: &Path, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
    let what = format!("checkpoint {}", path.display());
    if let Some((name, _)) = tensors.iter().find(|(n, _)| n == STEP_KEY || n == CHECKSUM_KEY) {
        return Err(Error::invalid(what, format!("a tensor may not be named {name:?}")));
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp: PathBuf = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("checkpoint"),
        std::process::id()
    ));
    let mut all: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?)))
        .collect::<Result<_>>()?;
    let sum = checksum(step, &all)?;
    all.push((STEP_KEY.to_string(), Tensor::from_slice(&[step as i64])));
    all.push((CHECKSUM_KEY.to_string(), Tensor::from_slice(&[sum as i64])));
    let written = Tensor::write_safetensors(&all, &tmp)
        .map_err(|e| Error::invalid(what.clone(), format!("cannot write {}: {e}", tmp.display())))
        .and_then(|()| std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err(what.clone())))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(io_err(what.clone())));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(what))?;
    Ok(())
}

/// Reads a checkpoint written by [`write_atomic`]: (step, tensors). A truncated or damaged file is an
/// error naming it (its checksum no longer matches).
pub fn read(path: &Path) -> Result<(u64, Vec<(String, Tensor)>)> {
    let what = format!("checkpoint {}", path.display());
    let mut all = Tensor::read_safetensors(path)
        .map_err(|e| Error::invalid(what.clone(), format!("unreadable (truncated, or not safetensors): {e}")))?;
    let take =
        |all: &mut Vec<(String, Tensor)>, key: &str| all.iter().position(|(n, _)| n == key).map(|p| all.remove(p).1);
    let step = take(&mut all, STEP_KEY).ok_or_else(|| Error::invalid(what.clone(), format!("no {STEP_KEY} entry")))?;
    let step = step.f_int64_value(&[0])? as u64;
    if let Some(saved) = take(&mut all, CHECKSUM_KEY) {
        let saved = saved.f_int64_value(&[0])? as u64;
        let now = checksum(step, &all)?;
        if saved != now {
            return Err(Error::mismatch(
                what,
                format!("checksum {now:016x} does not match the saved {saved:016x}: the file is damaged"),
            ));
        }
    }
    Ok((step, all))
}

/// Collective save: rank 0 writes, and every rank learns at once whether it did (a failure on rank 0 is
/// an error on every rank naming it and the cause, not a wait for the timeout); none runs ahead of a
/// checkpoint that might be needed to restart it.
pub fn save(pg: &ProcessGroup, path: &Path, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
    let _call = pg.enter_call("checkpoint::save");
    let local = if pg.rank() == 0 { write_atomic(path, step, tensors) } else { Ok(()) };
    pg.meta().outcome("checkpoint save", local)
}

/// Collective load into `targets` (in place, matched by name): rank 0 reads and checks the file against
/// the targets (names, shapes, checksum), every rank learns the outcome, then every tensor is broadcast.
/// Returns the saved step, or `None` (and changes nothing) when rank 0 finds no checkpoint.
pub fn load(pg: &ProcessGroup, path: &Path, targets: &[(String, Tensor)]) -> Result<Option<u64>> {
    let _call = pg.enter_call("checkpoint::load");
    let what = format!("checkpoint {}", path.display());
    let local = if pg.rank() == 0 && path.exists() {
        read(path).and_then(|(step, saved)| {
            let mut ordered = Vec::with_capacity(targets.len());
            for (name, target) in targets {
                let src = saved
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, t)| t)
                    .ok_or_else(|| Error::invalid(what.clone(), format!("has no tensor {name:?}")))?;
                if src.size() != target.size() {
                    return Err(Error::mismatch(
                        what.clone(),
                        format!("{name}: saved {:?}, model has {:?}", src.size(), target.size()),
                    ));
                }
                ordered.push(src.shallow_clone());
            }
            Ok(Some((step, ordered)))
        })
    } else {
        Ok(None)
    };
    let meta = pg.meta();
    let loaded = meta.outcome("checkpoint load", local)?;
    // 1. whether there is one, and its step
    let head =
        meta.broadcast("checkpoint load", &[loaded.is_some() as i64, loaded.as_ref().map_or(0, |l| l.0 as i64)], 0)?;
    if head[0] == 0 {
        return Ok(None);
    }
    // 2. every tensor, in the targets' order, through the device the group's metadata uses (the CPU
    // when it has a CPU backend; an NCCL-only group's GPU otherwise)
    let wire = meta.device();
    let _g = tch::no_grad_guard();
    for (i, (_, target)) in targets.iter().enumerate() {
        let mut buf = match &loaded {
            Some((_, saved)) => saved[i].f_to_kind(target.kind())?.f_to_device(wire)?,
            None => Tensor::f_zeros(target.size().as_slice(), (target.kind(), wire))?,
        };
        pg.broadcast(&mut buf, 0)?;
        target.shallow_clone().f_copy_(&buf)?;
    }
    Ok(Some(head[1] as u64))
}

/// All variables of `vs` (parameters and buffers), by name, sorted.
pub fn var_store_tensors(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    crate::var_store::sorted_variables(vs)
}

/// [`save`] of every variable of `vs`, each held whole on every rank (one process, DDP, ZeRO-1/2): a
/// variable a layout splits (FSDP's shards, a tensor-parallel slice) is refused by name, since the file
/// would hold rank 0's part; [`save_full`](super::save_full) writes those whole.
pub fn save_var_store(pg: &ProcessGroup, path: &Path, step: u64, vs: &nn::VarStore) -> Result<()> {
    // agreed on first: a rank that refused alone would leave the others in the save
    let what = "checkpoint::save_var_store";
    let vars = pg.meta().outcome(what, whole_variables(what, vs))?;
    save(pg, path, step, &vars)
}

/// [`load`] into every variable of `vs`, each held whole (as [`save_var_store`] requires).
pub fn load_var_store(pg: &ProcessGroup, path: &Path, vs: &nn::VarStore) -> Result<Option<u64>> {
    let what = "checkpoint::load_var_store";
    let vars = pg.meta().outcome(what, whole_variables(what, vs))?;
    load(pg, path, &vars)
}

/// The variables of `vs`, refusing one that is only this rank's part of a larger tensor.
fn whole_variables(what: &str, vs: &nn::VarStore) -> Result<Vec<(String, Tensor)>> {
    let all = var_store_tensors(vs);
    for (name, t) in &all {
        if let Some(l) = crate::placement::of(t).filter(|l| l.placements().iter().any(|(_, p)| p.is_partial())) {
            return Err(Error::invalid(
                what,
                format!(
                    "variable {name} is this rank's part of a {:?} tensor ({:?}); a single-file checkpoint holds \
                     whole tensors: checkpoint::save_full writes the whole model in one file from any layout, a \
                     Checkpointer saves and loads it sharded",
                    l.global_shape(),
                    l.placements()
                ),
            ));
        }
    }
    Ok(all)
}
