//! Reading a Hugging Face checkpoint into a model under any layout: the checkpoint is described as one
//! of ours (each of its tensors a chunk of the variable it maps to, unchecked by CRCs), so the sharded
//! loader reads each rank's part of each chunk and nothing else.
use std::collections::BTreeMap;

use tch::{nn, Kind, Tensor};

use super::{HfCheckpoint, HfSlot};
use crate::checkpoint::format::{self, Metadata, TensorMeta};
use crate::checkpoint::region::Bx;
use crate::checkpoint::{load::load_stored, StateDict};
use crate::error::{Error, Result};
use crate::group::{ProcessGroup, ReduceOp};

/// What [`HfCheckpoint::load`] did on this rank.
#[derive(Clone, Debug)]
pub struct HfLoaded {
    /// The checkpoint's tensors that went into this rank's model.
    pub tensors: usize,
    /// The bytes this rank read from the files (its parts, not the whole model).
    pub bytes_read: u64,
}

const PREFIX: &str = "model";

impl HfCheckpoint {
    /// Loads the checkpoint into `vs`'s variables (in place, in their dtype), whatever the layout:
    /// `map` says where each of the checkpoint's tensors goes ([`HfSlot::same`] when the VarStore's paths
    /// are the checkpoint's names). Collective over `pg`, every rank of the layout: a tensor no rank's
    /// model takes, a variable no tensor fills, a shape or dtype that does not fit fails every rank,
    /// naming the tensor, its file and both shapes, before any variable changes.
    pub fn load(&self, pg: &ProcessGroup, vs: &nn::VarStore, map: impl Fn(&str) -> HfSlot) -> Result<HfLoaded> {
        self.load_stores(pg, &[vs], map)
    }

    /// [`load`](Self::load) into several VarStores of this rank at once: a pipeline rank's chunks
    /// (`PipelineRank::var_stores`), whose paths begin with their layers' names.
    pub fn load_stores(
        &self,
        pg: &ProcessGroup,
        stores: &[&nn::VarStore],
        map: impl Fn(&str) -> HfSlot,
    ) -> Result<HfLoaded> {
        let _call = pg.enter_call("HfCheckpoint::load");
        let mut sd = StateDict::new();
        for vs in stores {
            sd.var_store(PREFIX, vs);
        }
        let planned = pg.meta().outcome("Hugging Face load", self.plan(&sd, &map));
        let (meta, unclaimed, tensors, flipped) = planned?;
        // a tensor is unexpected when no rank's model takes it (a pipeline stage takes only its layers)
        let unclaimed = pg.meta().allreduce("Hugging Face load", &unclaimed, ReduceOp::Min)?;
        let names: Vec<&String> = self.stored().keys().collect();
        let stray: Vec<String> =
            names.iter().zip(&unclaimed).filter(|(_, u)| **u != 0).map(|(n, _)| n.to_string()).collect();
        if let Some(first) = stray.first() {
            let vars: Vec<String> = sd.items.iter().filter_map(|i| i.param.clone()).collect::<Vec<_>>();
            let t = &self.stored()[first];
            return Err(Error::invalid(
                format!("Hugging Face checkpoint file {}", self.file_path(t.file).display()),
                format!(
                    "{} of its tensors go to no variable of the model: {first} (mapped to {:?}; the model's closest: \
                     {}){}",
                    stray.len(),
                    map(first),
                    crate::names::closest(first, &vars).join(", "),
                    if stray.len() > 1 { format!(", and {}", stray[1..].join(", ")) } else { String::new() }
                ),
            ));
        }
        // the transposed tensors' variables are filled apart: our description has no chunk for them
        let is_flipped =
            |i: &crate::checkpoint::state::Item| flipped.iter().any(|(_, v)| i.param.as_deref() == Some(v));
        let (flip_items, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut sd.items).into_iter().partition(is_flipped);
        sd.items = rest;
        // the transposed tensors first (each read whole once, transposed, each item's part kept), so that
        // a failed read leaves every variable as it was
        let _g = tch::no_grad_guard();
        let flips = (|| -> Result<(u64, Vec<(Tensor, Tensor)>)> {
            let (mut bytes, mut copies) = (0, Vec::new());
            for (name, var) in &flipped {
                let full = self.read(name)?;
                bytes += (full.numel() * full.kind().elt_size_in_bytes()) as u64;
                let full = full.f_tr()?;
                for item in flip_items.iter().filter(|i| i.param.as_deref() == Some(var.as_str())) {
                    for (bx, dst) in item.pieces()? {
                        let mut src = full.shallow_clone();
                        for d in 0..bx.offsets.len() {
                            src = src.f_narrow(d as i64, bx.offsets[d], bx.lengths[d])?;
                        }
                        let kept = src.f_to_kind(dst.kind())?.f_contiguous()?;
                        copies.push((dst, kept));
                    }
                }
            }
            Ok((bytes, copies))
        })();
        let loaded = flips.and_then(|(flipped_bytes, copies)| {
            let info = load_stored(self.dir(), &meta, &mut sd)?;
            for (dst, src) in copies {
                dst.shallow_clone().f_copy_(&src)?;
            }
            Ok(info.bytes_read + flipped_bytes)
        });
        let bytes_read = pg.meta().outcome("Hugging Face load", loaded)?;
        Ok(HfLoaded { tensors, bytes_read })
    }

    /// The checkpoint described as ours for this rank's variables; for each of the checkpoint's tensors,
    /// 1 when this rank's model does not take it; how many it takes; and the transposed ones
    /// (checkpoint name, variable), which the description leaves out.
    #[allow(clippy::type_complexity)]
    fn plan(
        &self,
        sd: &StateDict,
        map: &impl Fn(&str) -> HfSlot,
    ) -> Result<(Metadata, Vec<i64>, usize, Vec<(String, String)>)> {
        sd.check()?;
        // this rank's variables: path -> (global shape, dtype)
        let vars: BTreeMap<String, (Vec<i64>, Kind)> =
            sd.items.iter().filter_map(|i| i.param.clone().map(|p| (p, (i.global.clone(), i.local.kind())))).collect();
        let mut tensors: BTreeMap<String, TensorMeta> = BTreeMap::new();
        // the checkpoint's tensors each variable takes, and those no variable here takes
        let mut sources: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut untaken: Vec<&String> = Vec::new();
        let mut flipped: Vec<(String, String)> = Vec::new();
        let mut unclaimed = Vec::new();
        let mut taken = 0;
        for (name, t) in self.stored() {
            let file = self.file_path(t.file);
            let what = || format!("Hugging Face checkpoint file {}", file.display());
            let (var, start, transposed) = match map(name) {
                HfSlot::Skip => {
                    unclaimed.push(0);
                    untaken.push(name);
                    continue;
                }
                HfSlot::Var(v) => (v, None, false),
                HfSlot::Rows { var, start } => (var, Some(start), false),
                HfSlot::Transposed(v) => (v, None, true),
            };
            let Some((global, kind)) = vars.get(&var) else {
                unclaimed.push(1);
                untaken.push(name);
                continue;
            };
            unclaimed.push(0);
            taken += 1;
            let stored_kind = format::dtype_kind(&t.dtype)
                .map_err(|_| Error::invalid(what(), format!("{name}: dtype {} cannot be read", t.dtype)))?;
            if is_float(stored_kind) != is_float(*kind) {
                return Err(Error::mismatch(
                    what(),
                    format!("{name} is {}, the model's {var} is {kind:?}: one is a float, the other not", t.dtype),
                ));
            }
            if transposed {
                let reversed: Vec<i64> = t.shape.iter().rev().copied().collect();
                if t.shape.len() != 2 || reversed != *global {
                    return Err(Error::mismatch(
                        what(),
                        format!(
                            "{name} has shape {:?}: transposed, it does not fit the model's {var} of shape {global:?}",
                            t.shape
                        ),
                    ));
                }
                flipped.push((name.clone(), var.clone()));
                continue;
            }
            let offsets = match start {
                None if t.shape == *global => vec![0; global.len()],
                None => {
                    // under FSDP a variable is empty between uses: its place is known after finish
                    let hint = if global.contains(&0) {
                        " (an empty variable: load after plan.finish, or FsdpBuilder::finish, which places the shards)"
                    } else {
                        ""
                    };
                    return Err(Error::mismatch(
                        what(),
                        format!("{name} has shape {:?}, the model's {var} has {global:?}{hint}", t.shape),
                    ));
                }
                Some(s) => {
                    let bx = Bx {
                        offsets: [vec![s], vec![0; global.len().saturating_sub(1)]].concat(),
                        lengths: t.shape.clone(),
                    };
                    if !bx.fits(global) || t.shape.len() != global.len() {
                        return Err(Error::mismatch(
                            what(),
                            format!(
                                "{name} has shape {:?}: rows {s}.. of the model's {var}, of shape {global:?}, cannot \
                                 hold it",
                                t.shape
                            ),
                        ));
                    }
                    bx.offsets
                }
            };
            let entry = tensors.entry(format!("{PREFIX}.{var}")).or_insert_with(|| TensorMeta {
                shape: global.clone(),
                dtype: t.dtype.clone(),
                chunks: Vec::new(),
            });
            if entry.dtype != t.dtype {
                return Err(Error::mismatch(
                    what(),
                    format!("{name} is {}, other parts of the model's {var} are {}", t.dtype, entry.dtype),
                ));
            }
            entry.chunks.push(self.chunk(name, t, offsets));
            sources.entry(var).or_default().push(name.clone());
        }
        // every variable filled exactly: no part missing, none twice
        for (var, (global, _)) in &vars {
            let key = format!("{PREFIX}.{var}");
            let dir = format!("Hugging Face checkpoint {}", self.dir().display());
            let from_flipped: Vec<&str> = flipped.iter().filter(|(_, v)| v == var).map(|(n, _)| n.as_str()).collect();
            if let Some(first) = from_flipped.first() {
                // a transposed tensor fills the whole variable: nothing else may
                let other =
                    from_flipped.get(1).copied().or(sources.get(var).and_then(|s| s.first()).map(String::as_str));
                if let Some(other) = other {
                    return Err(Error::invalid(
                        dir,
                        format!("{first} (transposed) and {other} both fill the model's {var}"),
                    ));
                }
                continue;
            }
            let Some(t) = tensors.get(&key) else {
                // the likely culprits first: tensors no variable here takes, of this shape
                let fits: Vec<&str> =
                    untaken.iter().filter(|n| self.stored()[**n].shape == *global).map(|n| n.as_str()).collect();
                let names: Vec<String> = self.stored().keys().cloned().collect();
                let hint = if fits.is_empty() {
                    format!("the checkpoint's closest names: {}", crate::names::closest(var, &names).join(", "))
                } else {
                    format!("tensors of that shape no variable takes: {}", fits.join(", "))
                };
                return Err(Error::invalid(
                    dir,
                    format!("no tensor goes to the model's {var} (shape {global:?}; {hint})"),
                ));
            };
            let boxes: Vec<Bx> = t.chunks.iter().map(|c| c.bx()).collect();
            let names = &sources[var];
            let rows = |b: &Bx| match b.offsets.first().zip(b.lengths.first()) {
                Some((o, l)) => format!("rows {o}..{}", o + l),
                None => "its one element".to_string(),
            };
            for (i, a) in boxes.iter().enumerate() {
                if let Some(j) = (i + 1..boxes.len()).find(|&j| a.intersect(&boxes[j]).is_some()) {
                    return Err(Error::invalid(
                        dir,
                        format!(
                            "{} ({}) and {} ({}) fill the same part of the model's {var}",
                            names[i],
                            rows(a),
                            names[j],
                            rows(&boxes[j])
                        ),
                    ));
                }
            }
            let filled: i64 = boxes.iter().map(Bx::volume).sum();
            if filled != global.iter().product::<i64>() {
                return Err(Error::invalid(
                    dir,
                    format!(
                        "its tensors fill {filled} of the {} elements of the model's {var} (shape {global:?})",
                        global.iter().product::<i64>()
                    ),
                ));
            }
        }
        let files = self
            .files()
            .iter()
            .map(|name| format::FileMeta { name: name.clone(), rank: 0, bytes: 0, crc32: 0 })
            .collect();
        let meta = Metadata {
            format: format::FORMAT.into(),
            version: format::VERSION,
            step: 0,
            layout: BTreeMap::new(),
            files,
            tensors,
        };
        Ok((meta, unclaimed, taken, flipped))
    }
}

fn is_float(k: Kind) -> bool {
    matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}
