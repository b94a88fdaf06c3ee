//! Writing a model, from any layout, as a Hugging Face checkpoint: every rank first writes its share as
//! a sharded checkpoint beside the directory (each chunk once), then the Hugging Face files are cut by
//! size and written in parallel, file `k` by rank `k % world`, each reading back only its tensors.
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::{nn, Kind, Tensor};

use super::{HfPart, CONFIG, INDEX, SINGLE};
use crate::checkpoint::format::{self, Metadata};
use crate::checkpoint::load::read_box;
use crate::checkpoint::region::Bx;
use crate::checkpoint::{step_dir, Checkpointer, StateDict};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// How [`save_hf`] writes.
#[derive(Clone, Debug)]
pub struct HfSaveOptions {
    /// The most bytes of tensors in one file (`save_pretrained`'s `max_shard_size`; 5 GB by default);
    /// more than one file gets `model.safetensors.index.json`. A tensor larger than this has a file of
    /// its own.
    pub max_shard_size: u64,
    /// The dtype written (`None`: each variable's own; `Some(Kind::BFloat16)` for the usual release).
    pub dtype: Option<Kind>,
    /// Written as `config.json` (a loaded checkpoint's [`HfCheckpoint::config`], or one made for the
    /// model), once every rank's files are written, with its `dtype` (and `torch_dtype`, if present) set
    /// to the dtype written when the floating tensors share one; `None` writes none.
    ///
    /// [`HfCheckpoint::config`]: super::HfCheckpoint::config
    pub config: Option<serde_json::Value>,
}

impl Default for HfSaveOptions {
    fn default() -> Self {
        HfSaveOptions { max_shard_size: 5_000_000_000, dtype: None, config: None }
    }
}

const PREFIX: &str = "model";

/// One tensor to write: its Hugging Face name, the stored variable and the box of it.
struct Out {
    name: String,
    source: String,
    bx: Bx,
    transposed: bool,
    bytes: u64,
}

/// Writes every variable of `vs`, whole, as a Hugging Face checkpoint in `dir` (created if needed):
/// `names` gives, for each VarStore path and its shape, the tensors it is written as
/// ([`HfPart::same`]: itself, by its path). Collective over `pg` (every rank of the layout); on an error
/// every rank fails naming it. Each file is replaced atomically; once all are written, `model*.safetensors`
/// files of an earlier save that this one did not write (another shard count) are removed.
pub fn save_hf(
    pg: &Arc<ProcessGroup>,
    dir: impl AsRef<Path>,
    vs: &nn::VarStore,
    opts: &HfSaveOptions,
    names: impl Fn(&str, &[i64]) -> Vec<HfPart>,
) -> Result<()> {
    save_hf_stores(pg, dir, &[vs], opts, names)
}

/// [`save_hf`] of several VarStores of this rank at once: a pipeline rank's chunks
/// (`PipelineRank::var_stores`), whose paths begin with their layers' names.
pub fn save_hf_stores(
    pg: &Arc<ProcessGroup>,
    dir: impl AsRef<Path>,
    stores: &[&nn::VarStore],
    opts: &HfSaveOptions,
    names: impl Fn(&str, &[i64]) -> Vec<HfPart>,
) -> Result<()> {
    let dir = dir.as_ref();
    let _call = pg.enter_call("checkpoint::hf::save_hf");
    let parts = parts_dir(dir);
    let saved = Checkpointer::new(pg.clone(), &parts).and_then(|mut ck| {
        let mut sd = StateDict::new();
        for vs in stores {
            sd.var_store(PREFIX, vs);
        }
        ck.save(0, &sd)?;
        let parts = step_dir(&parts, 0);
        let local = format::read_metadata(&parts).and_then(|meta| {
            let files = cut(dir, &meta, opts, &names)?;
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::invalid(format!("Hugging Face checkpoint {}", dir.display()), e.to_string()))?;
            for (k, (file, outs)) in files.iter().enumerate() {
                if k % pg.size() == pg.rank() {
                    write(&parts, &meta, &dir.join(file), outs, opts.dtype)?;
                }
            }
            Ok((files, opts.dtype.or_else(|| float_kind(&meta))))
        });
        let (files, written) = pg.meta().outcome("Hugging Face save", local)?;
        // the index and config once every rank's files are in place: they name those files
        let finished = if pg.rank() == 0 { finish(dir, &files, written, opts) } else { Ok(()) };
        pg.meta().outcome("Hugging Face save", finished)?;
        if pg.rank() == 0 {
            remove_stale(dir, &files);
        }
        Ok(())
    });
    // the parts go whatever happened
    if pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&parts);
    }
    saved
}

/// Where the parts of `dir` are written: beside it, named after it.
fn parts_dir(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".parts");
    dir.with_file_name(name)
}

/// The tensors to write, by file (the same on every rank: it depends on the metadata only).
fn cut(
    dir: &Path,
    meta: &Metadata,
    opts: &HfSaveOptions,
    names: &impl Fn(&str, &[i64]) -> Vec<HfPart>,
) -> Result<Vec<(String, Vec<Out>)>> {
    let what = || format!("Hugging Face checkpoint {}", dir.display());
    let mut outs: Vec<Out> = Vec::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    for (source, t) in &meta.tensors {
        let Some(var) = source.strip_prefix(&format!("{PREFIX}.")) else { continue };
        let elt = match opts.dtype {
            Some(k) => k.elt_size_in_bytes(),
            None => format::dtype_kind(&t.dtype)?.elt_size_in_bytes(),
        } as u64;
        let parts = names(var, &t.shape);
        // every row written exactly once: a map that drops or repeats rows would write a model
        // `transformers` fills with fresh values where they are missing
        let n = t.shape.first().copied().unwrap_or(1);
        // each part's rows inside the variable, before the coverage of them all is judged
        for part in &parts {
            let rows = part.rows.clone().unwrap_or(0..n);
            if !t.shape.is_empty() && (rows.start < 0 || rows.end > n || rows.start >= rows.end) {
                let why = if rows.start >= rows.end { "an empty range" } else { "outside the variable" };
                return Err(Error::invalid(
                    what(),
                    format!(
                        "{}: rows {rows:?} of {var} ({why}), which has shape {:?} (rows 0..{n})",
                        part.name, t.shape
                    ),
                ));
            }
        }
        let mut covered: Vec<std::ops::Range<i64>> = parts.iter().map(|p| p.rows.clone().unwrap_or(0..n)).collect();
        covered.sort_by_key(|r| r.start);
        let mut next = 0;
        for r in &covered {
            if r.start != next {
                let what_rows = if r.start > next { "writes none of" } else { "writes twice" };
                let (a, b) = if r.start > next { (next, r.start) } else { (r.start, next.min(r.end)) };
                return Err(Error::invalid(
                    what(),
                    format!("the name map {what_rows} rows {a}..{b} of {var} (shape {:?}): each row goes to exactly one tensor", t.shape),
                ));
            }
            next = r.end;
        }
        if next != n {
            return Err(Error::invalid(
                what(),
                format!("the name map writes none of rows {next}..{n} of {var} (shape {:?}): each row goes to exactly one tensor", t.shape),
            ));
        }
        for part in parts {
            if part.transposed && (t.shape.len() != 2 || part.rows.is_some()) {
                return Err(Error::invalid(
                    what(),
                    format!(
                        "{}: only a whole 2-D variable is written transposed; {var} has shape {:?}",
                        part.name, t.shape
                    ),
                ));
            }
            let rows = part.rows.clone().unwrap_or(0..n);
            if let Some(other) = seen.insert(part.name.clone(), var.to_string()) {
                return Err(Error::invalid(what(), format!("{} is the name of both {other} and {var}", part.name)));
            }
            let mut bx = Bx::whole(&t.shape);
            if !t.shape.is_empty() {
                bx.offsets[0] = rows.start;
                bx.lengths[0] = rows.end - rows.start;
            }
            let bytes = bx.volume() as u64 * elt;
            outs.push(Out { name: part.name, source: source.clone(), bx, transposed: part.transposed, bytes });
        }
    }
    if outs.is_empty() {
        return Err(Error::invalid(what(), "the model has no variables to write"));
    }
    // save_pretrained's order: by name, cut where a file would pass the limit
    outs.sort_by(|a, b| a.name.cmp(&b.name));
    let mut groups: Vec<Vec<Out>> = vec![Vec::new()];
    let mut size = 0;
    for o in outs {
        let last = groups.len() - 1;
        if !groups[last].is_empty() && size + o.bytes > opts.max_shard_size {
            groups.push(Vec::new());
            size = 0;
        }
        size += o.bytes;
        let last = groups.len() - 1;
        groups[last].push(o);
    }
    let n = groups.len();
    Ok(groups
        .into_iter()
        .enumerate()
        .map(|(k, g)| {
            let file = if n == 1 { SINGLE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
            (file, g)
        })
        .collect())
}

/// A CPU tensor as safetensors' writer takes it.
struct View {
    t: Tensor,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
}

impl safetensors::View for &View {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // the tensors were made contiguous on the CPU below, so this cannot fail
        Cow::Borrowed(format::bytes_of(&self.t).unwrap_or(&[]))
    }
    fn data_len(&self) -> usize {
        self.t.numel() * self.t.kind().elt_size_in_bytes()
    }
}

fn st_dtype(k: Kind) -> Result<safetensors::Dtype> {
    use safetensors::Dtype as D;
    Ok(match k {
        Kind::Double => D::F64,
        Kind::Float => D::F32,
        Kind::Half => D::F16,
        Kind::BFloat16 => D::BF16,
        Kind::Int64 => D::I64,
        Kind::Int => D::I32,
        Kind::Int16 => D::I16,
        Kind::Int8 => D::I8,
        Kind::Uint8 => D::U8,
        Kind::Bool => D::BOOL,
        k => return Err(Error::invalid("Hugging Face save", format!("dtype {k:?} cannot be written"))),
    })
}

/// Writes one file of whole tensors, read back from the parts, atomically (temporary name, rename).
fn write(parts: &Path, meta: &Metadata, path: &Path, outs: &[Out], dtype: Option<Kind>) -> Result<()> {
    let what = || format!("Hugging Face checkpoint file {}", path.display());
    let mut views = Vec::with_capacity(outs.len());
    for o in outs {
        let mut t = read_box(parts, meta, &o.source, o.bx.clone())?;
        if o.transposed {
            t = t.f_tr()?;
        }
        // floats only, as save_pretrained casts (an integer buffer keeps its dtype)
        let float = |k: Kind| matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16);
        if let Some(k) = dtype.filter(|k| *k != t.kind() && float(t.kind())) {
            t = t.f_to_kind(k)?;
        }
        let t = t.f_contiguous()?;
        format::bytes_of(&t)?; // what the writer's `data` reads: checked here, where it can fail
        let shape = t.size().iter().map(|&d| d as usize).collect();
        views.push((o.name.clone(), View { dtype: st_dtype(t.kind())?, shape, t }));
    }
    let tmp = path.with_extension("safetensors.tmp");
    let info: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    // the mode a file created here gets (0666 less the umask, as `save_pretrained`'s): the writer
    // renames a private temporary file (0600) into place
    // (a temporary file a killed save left keeps its mode: made anew)
    let _ = std::fs::remove_file(&tmp);
    let mode = std::fs::File::create(&tmp)
        .and_then(|f| f.metadata())
        .map(|m| m.permissions())
        .map_err(|e| Error::invalid(what(), e.to_string()))?;
    let written = safetensors::serialize_to_file(views.iter().map(|(n, v)| (n.as_str(), v)), Some(info), &tmp)
        .map_err(|e| Error::invalid(what(), format!("{e:?}")))
        .and_then(|()| std::fs::set_permissions(&tmp, mode).map_err(|e| Error::invalid(what(), e.to_string())))
        .and_then(|()| {
            std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| Error::invalid(what(), e.to_string()))
        })
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::invalid(what(), e.to_string())));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// The index (several files) and `config.json`, by rank 0 once every file is written.
/// The one floating dtype of the stored tensors, when they share one: what a save in their own dtypes
/// writes, and its config records.
fn float_kind(meta: &Metadata) -> Option<Kind> {
    let mut kinds = meta
        .tensors
        .values()
        .filter_map(|t| format::dtype_kind(&t.dtype).ok())
        .filter(|k| matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16));
    let first = kinds.next()?;
    kinds.all(|k| k == first).then_some(first)
}

/// Writes the index (when there is more than one file) and the config, with `written` as its dtype.
fn finish(dir: &Path, files: &[(String, Vec<Out>)], written: Option<Kind>, opts: &HfSaveOptions) -> Result<()> {
    let write_json = |name: &str, v: &serde_json::Value| {
        let path = dir.join(name);
        let what = format!("Hugging Face checkpoint file {}", path.display());
        let text = serde_json::to_string_pretty(v).map_err(|e| Error::invalid(what.clone(), e.to_string()))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text + "\n")
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| Error::invalid(what, e.to_string()))
    };
    if files.len() > 1 {
        let total: u64 = files.iter().flat_map(|(_, o)| o).map(|o| o.bytes).sum();
        let map: BTreeMap<&str, &str> =
            files.iter().flat_map(|(f, outs)| outs.iter().map(move |o| (o.name.as_str(), f.as_str()))).collect();
        write_json(INDEX, &serde_json::json!({"metadata": {"total_size": total}, "weight_map": map}))?;
    } else {
        let _ = std::fs::remove_file(dir.join(INDEX));
    }
    if let Some(config) = &opts.config {
        let mut config = config.clone();
        // the dtype written, as save_pretrained records it (transformers loads in it by default)
        if let (Some(k), Some(obj)) = (written, config.as_object_mut()) {
            let name = match k {
                Kind::BFloat16 => "bfloat16",
                Kind::Half => "float16",
                Kind::Double => "float64",
                _ => "float32",
            };
            for key in ["dtype", "torch_dtype"] {
                if obj.contains_key(key) || key == "dtype" {
                    obj.insert(key.to_string(), serde_json::Value::String(name.to_string()));
                }
            }
        }
        write_json(CONFIG, &config)?;
    }
    Ok(())
}

/// Removes `model*.safetensors` files of an earlier save that this one did not write (another shard
/// count), so the directory holds one checkpoint.
fn remove_stale(dir: &Path, files: &[(String, Vec<Out>)]) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with("model") && name.ends_with(".safetensors") && !files.iter().any(|(f, _)| *f == name) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
