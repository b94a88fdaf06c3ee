//! Loading a sharded checkpoint into the layout a [`StateDict`] has now: each rank works out which boxes
//! of which global tensors it needs, reads only the rows of the stored chunks that overlap them (checked
//! against their CRCs), and copies the overlaps into place. Optimizer state is rebuilt in the optimizer's
//! own layout and handed to its `load_state_dict`.
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use tch::{Kind, Tensor};

use super::format::{self, Metadata, TensorMeta};
use super::region::{Bx, Region};
use super::save::{committed_steps, step_dir, Checkpointer};
use super::state::{owners, pieces, state_name, Item, StateDict};
use crate::error::{Error, Result};

/// A local tensor (or a part of one) to fill from the stored tensor `source`.
struct Target {
    source: String,
    /// What the stored tensor's shape must be, when the layout fixes it.
    global: Vec<i64>,
    region: Region,
    local: Tensor,
}

impl Checkpointer {
    /// Loads the newest committed checkpoint under the root into `sd` (in place), whatever layout it was
    /// saved from; returns its step, or `None` when there is none (then nothing changes). Collective; on
    /// an error (a tensor missing or of another shape, a damaged file) every rank fails, naming it.
    pub fn load(&mut self, sd: &mut StateDict) -> Result<Option<u64>> {
        self.wait()?;
        let pg = self.pg_handle();
        let _call = pg.enter_call("Checkpointer::load");
        let latest = if pg.rank() == 0 { committed_steps(self.root()).last().copied() } else { None };
        let head = pg.meta().broadcast("checkpoint load", &[latest.is_some() as i64, latest.unwrap_or(0) as i64], 0)?;
        if head[0] == 0 {
            return Ok(None);
        }
        self.load_step(head[1] as u64, sd).map(Some)
    }

    /// Loads the checkpoint of `step` into `sd`. Collective.
    pub fn load_step(&mut self, step: u64, sd: &mut StateDict) -> Result<u64> {
        self.wait()?;
        let dir = step_dir(self.root(), step);
        let local = load_dir(&dir, sd);
        self.pg_handle().meta().outcome("checkpoint load", local.map(|m| m.step))
    }
}

/// Loads the checkpoint in `dir` into `sd` on this rank alone (no process group): the state dict's
/// layout decides what is read.
pub fn load_dir(dir: &Path, sd: &mut StateDict) -> Result<LoadedInfo> {
    sd.check()?;
    let meta = format::read_metadata(dir)?;
    load_stored(dir, &meta, sd)
}

/// Loads into `sd` what `meta` describes of the files in `dir` (ours, or another format's described as
/// ours).
pub(crate) fn load_stored(dir: &Path, meta: &Metadata, sd: &mut StateDict) -> Result<LoadedInfo> {
    sd.check()?;
    let _g = tch::no_grad_guard();
    let mut reader = Reader { dir, meta, files: HashMap::new(), bytes_read: 0 };
    // the model's tensors: in place (through a contiguous copy where the local tensor is not)
    let mut targets = Vec::new();
    let mut copy_back = Vec::new();
    for item in &sd.items {
        if matches!(item.region, Region::Flat { len: 0, .. }) {
            continue; // an empty shard: nothing to read (it names its optimizer state)
        }
        let local = if item.local.is_contiguous() {
            item.local.shallow_clone()
        } else {
            let c = item.local.f_contiguous()?;
            copy_back.push((item.local.shallow_clone(), c.shallow_clone()));
            c
        };
        targets.push(Target {
            source: item.name.clone(),
            global: item.global.clone(),
            region: item.region.clone(),
            local,
        });
    }
    // the optimizers' state: built in each optimizer's layout, then loaded by it
    let mut states: Vec<Vec<(String, Tensor)>> = Vec::new();
    for (prefix, opt) in &sd.optimizers {
        // elementwise state the optimizer has already is loaded in place
        let live = opt.state_dict();
        let mut state = Vec::new();
        for st in opt.stepped() {
            let pieces = pieces(&st.tensor);
            let Some(anchor) = owners(&pieces).into_iter().next() else { continue };
            let anchor = sd.param_item(prefix, &anchor)?;
            let stem = state_name(prefix, anchor, "");
            let mut fields: Vec<(&str, &TensorMeta)> = meta
                .tensors
                .range(stem.clone()..)
                .take_while(|(n, _)| n.starts_with(&stem))
                .filter_map(|(n, t)| n[stem.len()..].split_once('.').is_none().then_some((&n[stem.len()..], t)))
                .collect();
            let master_fallback = st.master_key.is_some() && !fields.iter().any(|(f, _)| *f == "master");
            let model = meta.tensors.get(&anchor.name);
            if let (true, Some(m)) = (master_fallback, model) {
                fields.push(("master", m)); // master weights from the saved parameters themselves
            }
            for (field, saved) in fields {
                let key = if field == "master" {
                    match &st.master_key {
                        Some(k) => k.clone(),
                        None => continue,
                    }
                } else {
                    format!("{}{field}", st.prefix)
                };
                let is_float = matches!(
                    format::dtype_kind(&saved.dtype)?,
                    Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
                );
                if is_float && saved.shape == anchor.global {
                    // elementwise: the stepped tensor's layout, piece by piece
                    let current = live.iter().find(|(k, _)| *k == key).map(|(_, t)| t);
                    let local = match current {
                        Some(t)
                            if t.size() == st.tensor.size() && t.kind() == st.tensor.kind() && t.is_contiguous() =>
                        {
                            t.shallow_clone()
                        }
                        _ => Tensor::f_zeros(st.tensor.size().as_slice(), (st.tensor.kind(), st.tensor.device()))?,
                    };
                    let flat = local.f_reshape([-1])?;
                    for seg in pieces.iter().filter(|s| s.len > 0) {
                        let item = sd.param_item(prefix, &seg.variable)?;
                        let source = if field == "master" && master_fallback {
                            item.name.clone()
                        } else {
                            state_name(prefix, item, field)
                        };
                        let region = item.region.part(&item.global, seg.start, seg.len).ok_or_else(|| {
                            Error::invalid("checkpoint load", format!("{source}: part of a tensor-parallel slice"))
                        })?;
                        let mut piece = flat.f_narrow(0, seg.at, seg.len)?;
                        if let Region::Box(b) = &region {
                            piece = piece.f_view(b.lengths.as_slice())?;
                        }
                        targets.push(Target { source, global: item.global.clone(), region, local: piece });
                    }
                    state.push((key, local));
                } else if field != "master" {
                    let local =
                        Tensor::f_zeros(saved.shape.as_slice(), (format::dtype_kind(&saved.dtype)?, tch::Device::Cpu))?;
                    let source = state_name(prefix, anchor, field);
                    let region = Region::Box(Bx::whole(&saved.shape));
                    targets.push(Target { source, global: saved.shape.clone(), region, local: local.shallow_clone() });
                    state.push((key, local));
                }
            }
        }
        states.push(state);
    }
    // check everything before changing anything
    for t in &targets {
        let saved = meta.tensors.get(&t.source).ok_or_else(|| {
            let names: Vec<String> = meta.tensors.keys().cloned().collect();
            let near = crate::names::closest(&t.source, &names).join(", ");
            Error::invalid(
                format!("checkpoint {}", dir.display()),
                format!("has no tensor {} (the closest it has: {near}; names are the VarStore's paths)", t.source),
            )
        })?;
        if saved.shape != t.global {
            return Err(Error::mismatch(
                format!("checkpoint {}", dir.display()),
                format!("{}: saved with shape {:?}, here it is {:?}", t.source, saved.shape, t.global),
            ));
        }
    }
    for t in &targets {
        reader.fill(t)?;
    }
    for (dst, src) in copy_back {
        dst.shallow_clone().f_copy_(&src)?;
    }
    for ((_, opt), state) in sd.optimizers.iter_mut().zip(states) {
        opt.load_state_dict(&state)?;
    }
    Ok(LoadedInfo { step: meta.step, layout: meta.layout.clone(), bytes_read: reader.bytes_read })
}

/// What a loaded checkpoint was.
#[derive(Clone, Debug)]
pub struct LoadedInfo {
    pub step: u64,
    /// The layout it was saved from (`world_size`, and what its state dict described).
    pub layout: std::collections::BTreeMap<String, i64>,
    /// The bytes this rank read from the checkpoint's files (its parts, not the whole model).
    pub bytes_read: u64,
}

struct Reader<'m> {
    dir: &'m Path,
    meta: &'m Metadata,
    files: HashMap<usize, File>,
    bytes_read: u64,
}

impl Reader<'_> {
    fn file(&mut self, i: usize) -> Result<(&File, String)> {
        let name = self.meta.files.get(i).map(|f| f.name.clone()).ok_or_else(|| {
            Error::invalid("checkpoint load", format!("metadata names file {i}, which it does not list"))
        })?;
        let path = self.dir.join(&name);
        if let std::collections::hash_map::Entry::Vacant(e) = self.files.entry(i) {
            let f = File::open(&path)
                .map_err(|e| Error::invalid(format!("checkpoint file {}", path.display()), e.to_string()))?;
            e.insert(f);
        }
        Ok((&self.files[&i], path.display().to_string()))
    }

    /// Copies the stored overlaps of every box of `t` into place.
    fn fill(&mut self, t: &Target) -> Result<()> {
        let saved = &self.meta.tensors[&t.source];
        let kind = format::dtype_kind(&saved.dtype)?;
        let pieces = Item {
            name: t.source.clone(),
            param: None,
            global: t.global.clone(),
            region: t.region.clone(),
            local: t.local.shallow_clone(),
        }
        .pieces()?;
        for (bx, dst) in pieces {
            let mut covered = 0;
            for c in &saved.chunks {
                let Some(common) = bx.intersect(&c.bx()) else { continue };
                let rel = |b: &Bx| -> Vec<i64> { common.offsets.iter().zip(&b.offsets).map(|(a, b)| a - b).collect() };
                let (in_chunk, in_dst) = (rel(&c.bx()), rel(&bx));
                let (r0, r1) = match (in_chunk.first(), common.lengths.first()) {
                    (Some(&o), Some(&l)) => (o, o + l),
                    _ => (0, 1),
                };
                let (f, fname) = self.file(c.file)?;
                if common == c.bx() && common == bx && format::read_into(f, &fname, &t.source, c, kind, &dst)? {
                    covered += common.volume();
                    self.bytes_read += c.end - c.begin;
                    continue;
                }
                let mut src = format::read_rows(f, &fname, &t.source, c, kind, r0, r1)?;
                self.bytes_read += (src.numel() * kind.elt_size_in_bytes()) as u64;
                let mut d = dst.shallow_clone();
                for dim in 0..common.lengths.len() {
                    if dim > 0 {
                        src = src.f_narrow(dim as i64, in_chunk[dim], common.lengths[dim])?;
                    }
                    d = d.f_narrow(dim as i64, in_dst[dim], common.lengths[dim])?;
                }
                d.f_copy_(&src)?;
                covered += common.volume();
            }
            if covered != bx.volume() {
                return Err(Error::invalid(
                    format!("checkpoint {}", self.dir.display()),
                    format!("{}: its chunks hold {covered} of the {} elements of {:?}", t.source, bx.volume(), bx),
                ));
            }
        }
        Ok(())
    }
}

/// Every tensor of the checkpoint in `dir`, whole, by name (for tools and tests; no process group).
pub fn read_full(dir: &Path) -> Result<(u64, Vec<(String, Tensor)>)> {
    let meta = format::read_metadata(dir)?;
    let mut out = Vec::new();
    for (name, t) in &meta.tensors {
        out.push((name.clone(), read_box(dir, &meta, name, Bx::whole(&t.shape))?));
    }
    Ok((meta.step, out))
}

/// The box `bx` of the stored tensor `name` (in its stored dtype), read from the files in `dir` that
/// `meta` describes.
pub(crate) fn read_box(dir: &Path, meta: &Metadata, name: &str, bx: Bx) -> Result<Tensor> {
    let t = meta
        .tensors
        .get(name)
        .ok_or_else(|| Error::invalid(format!("checkpoint {}", dir.display()), format!("has no tensor {name}")))?;
    let local = Tensor::f_zeros(bx.lengths.as_slice(), (format::dtype_kind(&t.dtype)?, tch::Device::Cpu))?;
    let target = Target { source: name.to_string(), global: t.shape.clone(), region: Region::Box(bx), local };
    Reader { dir, meta, files: HashMap::new(), bytes_read: 0 }.fill(&target)?;
    Ok(target.local)
}

/// Checks every file of the checkpoint in `dir` against its size and CRC-32 in the metadata.
pub fn verify(dir: &Path) -> Result<()> {
    let meta = format::read_metadata(dir)?;
    for f in &meta.files {
        let path = dir.join(&f.name);
        let what = format!("checkpoint file {}", path.display());
        let bytes = std::fs::read(&path).map_err(|e| Error::invalid(what.clone(), e.to_string()))?;
        if bytes.len() as u64 != f.bytes || crc32fast::hash(&bytes) != f.crc32 {
            return Err(Error::mismatch(what, "its size or checksum differs from the metadata's: the file is damaged"));
        }
    }
    Ok(())
}
