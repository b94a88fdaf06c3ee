//! Checkpoints that lose nothing: rank 0 writes a safetensors file (readable by PyTorch's
//! `safetensors.torch.load_file`) to a temporary name, syncs it, and renames it over the old one, so a
//! crash mid-write leaves the previous checkpoint intact; a barrier keeps other ranks from running ahead.
//! Loading: rank 0 reads and broadcasts, so every rank resumes from the same values.
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

/// Writes `tensors` and `step` to `path` atomically (temporary file, fsync, rename, fsync of the
/// directory). Not collective: see [`save`] for the distributed form.
pub fn write_atomic(path: &Path, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
    let what = format!("checkpoint {}", path.display());
    if let Some((name, _)) = tensors.iter().find(|(n, _)| n == STEP_KEY) {
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
    all.push((STEP_KEY.to_string(), Tensor::from_slice(&[step as i64])));
    Tensor::write_safetensors(&all, &tmp)?;
    std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err(what.clone()))?;
    std::fs::rename(&tmp, path).map_err(io_err(what.clone()))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(what))?;
    Ok(())
}

/// Reads a checkpoint written by [`write_atomic`]: (step, tensors).
pub fn read(path: &Path) -> Result<(u64, Vec<(String, Tensor)>)> {
    let mut all = Tensor::read_safetensors(path)?;
    let pos = all
        .iter()
        .position(|(n, _)| n == STEP_KEY)
        .ok_or_else(|| Error::invalid(format!("checkpoint {}", path.display()), format!("no {STEP_KEY} entry")))?;
    let (_, step) = all.remove(pos);
    Ok((step.f_int64_value(&[0])? as u64, all))
}

/// Collective save: rank 0 writes, then all ranks meet at a barrier (so none runs ahead of a checkpoint
/// that might be needed to restart it).
pub fn save(pg: &ProcessGroup, path: &Path, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
    if pg.rank() == 0 {
        write_atomic(path, step, tensors)?;
    }
    pg.barrier()
}

/// Collective load into `targets` (in place, matched by name): rank 0 reads, every tensor is broadcast.
/// Returns the saved step, or `None` (and changes nothing) when rank 0 finds no checkpoint.
pub fn load(pg: &ProcessGroup, path: &Path, targets: &[(String, Tensor)]) -> Result<Option<u64>> {
    let what = format!("checkpoint {}", path.display());
    let loaded = if pg.rank() == 0 && path.exists() { Some(read(path)?) } else { None };
    // 1. whether there is one, and its step
    let meta = pg.meta();
    let head =
        meta.broadcast("checkpoint load", &[loaded.is_some() as i64, loaded.as_ref().map_or(0, |l| l.0 as i64)], 0)?;
    if head[0] == 0 {
        return Ok(None);
    }
    // 2. every tensor, in the targets' order, through the device the group's metadata uses (the CPU
    // when it has a CPU backend; an NCCL-only group's GPU otherwise)
    let wire = meta.device();
    let _g = tch::no_grad_guard();
    for (name, target) in targets {
        let mut buf = match &loaded {
            Some((_, saved)) => {
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
                src.f_to_kind(target.kind())?.f_to_device(wire)?
            }
            None => Tensor::f_zeros(target.size().as_slice(), (target.kind(), wire))?,
        };
        pg.broadcast(&mut buf, 0)?;
        target.shallow_clone().f_copy_(&buf)?;
    }
    Ok(Some(head[1] as u64))
}

/// All variables of `vs` (parameters and buffers), by name, sorted.
pub fn var_store_tensors(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// [`save`] of every variable of `vs`.
pub fn save_var_store(pg: &ProcessGroup, path: &Path, step: u64, vs: &nn::VarStore) -> Result<()> {
    save(pg, path, step, &var_store_tensors(vs))
}

/// [`load`] into every variable of `vs`.
pub fn load_var_store(pg: &ProcessGroup, path: &Path, vs: &nn::VarStore) -> Result<Option<u64>> {
    load(pg, path, &var_store_tensors(vs))
}
