//! Hugging Face checkpoints: a model directory as `transformers`' `save_pretrained` writes it
//! (`config.json`, and `model.safetensors` or `model-0000k-of-0000n.safetensors` with
//! `model.safetensors.index.json`), read into a model under any layout and written back from one.
//!
//! - **Reading** ([`HfCheckpoint::load`]): each rank reads only the bytes of the parts it holds (FSDP's
//!   rows, a tensor-parallel slice, its pipeline stage's layers) straight from the files, converting
//!   the dtype on the way (bf16 in the file, float32 in the model). Names map through a function from
//!   the file's names to the VarStore's paths ([`HfSlot`]); a model written with Hugging Face's names
//!   needs none ([`HfSlot::same`]). A missing, unexpected or mis-shaped tensor is an error on every rank
//!   naming it, its file and both shapes, before anything is overwritten.
//! - **Writing** ([`save_hf`]): whole tensors under Hugging Face's names, in files of at most
//!   `max_shard_size` bytes with an index when there are several, written in parallel by the ranks
//!   (file `k` by rank `k % world`), and `config.json` beside them; `from_pretrained` loads it.
//!
//! ```no_run
//! # fn build(p: tch::nn::Path) -> tch::nn::Linear { tch::nn::linear(p, 2, 2, Default::default()) }
//! use tch_dist::checkpoint::hf::{save_hf, HfCheckpoint, HfPart, HfSaveOptions, HfSlot};
//! let pg = std::sync::Arc::new(tch_dist::ProcessGroup::from_env()?);
//! let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let model = build(vs.root() / "model"); // under a plan: plan.build(&vs, || ...)
//! let hf = HfCheckpoint::open("Llama-3.2-1B")?;
//! hf.load(&pg, &vs, HfSlot::same)?; // the VarStore's paths are Hugging Face's names
//! // ... train ...
//! let opts = HfSaveOptions { config: Some(hf.config()?), ..Default::default() };
//! save_hf(&pg, "tuned", &vs, &opts, HfPart::same)?;
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod load;
mod save;

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tch::Tensor;

use super::format;
use crate::error::{Error, Result};

pub use load::HfLoaded;
pub use save::{save_hf, save_hf_stores, HfSaveOptions};

/// The index of a sharded Hugging Face checkpoint.
pub(crate) const INDEX: &str = "model.safetensors.index.json";
/// The file of an unsharded one.
pub(crate) const SINGLE: &str = "model.safetensors";
pub(crate) const CONFIG: &str = "config.json";

/// Where a tensor of a Hugging Face checkpoint goes in the model (what [`HfCheckpoint::load`]'s map
/// returns for each of the checkpoint's names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HfSlot {
    /// The whole of the variable at this VarStore path (same shape).
    Var(String),
    /// Rows `start..start + n` (along dimension 0; `n` the tensor's first dimension) of the variable at
    /// `var`: a fused projection made of several of the checkpoint's tensors (q, k and v in one).
    Rows { var: String, start: i64 },
    /// The whole of the 2-D variable at `var`, stored transposed (GPT-2's `Conv1D` weights, `[in, out]`,
    /// into a tch `Linear`'s `[out, in]`): read whole once, transposed, and each rank's part copied.
    Transposed(String),
    /// Not part of the model (a buffer the file carries, such as an old `rotary_emb.inv_freq`).
    Skip,
}

impl HfSlot {
    /// The map of a model whose VarStore paths are Hugging Face's names.
    pub fn same(name: &str) -> HfSlot {
        HfSlot::Var(name.to_string())
    }
}

/// One tensor [`save_hf`] writes for a variable: its Hugging Face name, the variable's rows it holds
/// (`None`: the whole variable), and whether it is written transposed (a whole 2-D variable).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfPart {
    pub name: String,
    pub rows: Option<std::ops::Range<i64>>,
    pub transposed: bool,
}

impl HfPart {
    /// The whole variable, as `name`.
    pub fn whole(name: &str) -> HfPart {
        HfPart { name: name.to_string(), rows: None, transposed: false }
    }

    /// Rows `rows` of the variable (a part of a fused projection), as `name`.
    pub fn rows(name: &str, rows: std::ops::Range<i64>) -> HfPart {
        HfPart { name: name.to_string(), rows: Some(rows), transposed: false }
    }

    /// The whole 2-D variable transposed, as `name` ([`HfSlot::Transposed`]'s way back).
    pub fn transposed(name: &str) -> HfPart {
        HfPart { name: name.to_string(), rows: None, transposed: true }
    }

    /// The map of a model whose VarStore paths are Hugging Face's names: each variable whole, by its path.
    pub fn same(var: &str, _shape: &[i64]) -> Vec<HfPart> {
        vec![HfPart::whole(var)]
    }
}

/// One tensor of the checkpoint: its file, dtype (safetensors' name), shape and absolute bytes there.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub file: usize,
    pub dtype: String,
    pub shape: Vec<i64>,
    pub begin: u64,
    pub end: u64,
}

/// A Hugging Face model directory, its tensors listed (nothing read but the files' headers).
#[derive(Clone, Debug)]
pub struct HfCheckpoint {
    dir: PathBuf,
    files: Vec<String>,
    tensors: BTreeMap<String, Stored>,
}

impl HfCheckpoint {
    /// Opens the directory: `model.safetensors.index.json` and the files it names, or
    /// `model.safetensors`. A missing file, a damaged header or a name the index and the files disagree
    /// on is an error naming the file.
    pub fn open(dir: impl AsRef<Path>) -> Result<HfCheckpoint> {
        let dir = dir.as_ref().to_path_buf();
        let what = format!("Hugging Face checkpoint {}", dir.display());
        if dir.is_file() {
            return Err(Error::invalid(what, "is a file: give the directory that holds it"));
        }
        if !dir.exists() {
            return Err(Error::invalid(what, "does not exist"));
        }
        let index = dir.join(INDEX);
        let (files, listed): (Vec<String>, Option<BTreeMap<String, String>>) = if index.exists() {
            let what = format!("Hugging Face index {}", index.display());
            let text = std::fs::read(&index).map_err(|e| Error::invalid(what.clone(), e.to_string()))?;
            let v: serde_json::Value =
                serde_json::from_slice(&text).map_err(|e| Error::invalid(what.clone(), format!("not JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::invalid(what.clone(), "has no \"weight_map\" object (tensor name -> file)"))?;
            let mut listed = BTreeMap::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| Error::invalid(what.clone(), format!("{name}: its file is not a string")))?;
                listed.insert(name.clone(), file.to_string());
            }
            let mut files: Vec<String> = listed.values().cloned().collect();
            files.sort();
            files.dedup();
            (files, Some(listed))
        } else if dir.join(SINGLE).exists() {
            (vec![SINGLE.to_string()], None)
        } else {
            return Err(Error::invalid(what, format!("holds neither {INDEX} nor {SINGLE}")));
        };
        let mut tensors = BTreeMap::new();
        for (i, name) in files.iter().enumerate() {
            for (t, stored) in header(&dir.join(name), i)? {
                if let Some(listed) = &listed {
                    if listed.get(&t) != Some(name) {
                        return Err(Error::invalid(
                            format!("Hugging Face checkpoint file {}", dir.join(name).display()),
                            format!("holds {t}, which {INDEX} places in {:?}", listed.get(&t)),
                        ));
                    }
                }
                tensors.insert(t, stored);
            }
        }
        if let Some(listed) = &listed {
            if let Some((t, f)) = listed.iter().find(|(t, _)| !tensors.contains_key(*t)) {
                return Err(Error::invalid(
                    format!("Hugging Face checkpoint file {}", dir.join(f).display()),
                    format!("does not hold {t}, which {INDEX} places there"),
                ));
            }
        }
        Ok(HfCheckpoint { dir, files, tensors })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tensors' names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.tensors.keys().map(String::as_str).collect()
    }

    /// A tensor's shape, if the checkpoint has it.
    pub fn shape(&self, name: &str) -> Option<&[i64]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// `config.json`, parsed.
    pub fn config(&self) -> Result<serde_json::Value> {
        let path = self.dir.join(CONFIG);
        let what = format!("Hugging Face config {}", path.display());
        let text = std::fs::read(&path).map_err(|e| Error::invalid(what.clone(), e.to_string()))?;
        serde_json::from_slice(&text).map_err(|e| Error::invalid(what, format!("not JSON: {e}")))
    }

    /// One tensor, whole, in its stored dtype (for tools and tests: loading a model reads only parts).
    pub fn read(&self, name: &str) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            let names: Vec<String> = self.tensors.keys().cloned().collect();
            Error::invalid(
                format!("Hugging Face checkpoint {}", self.dir.display()),
                format!("has no tensor {name} (the closest: {})", crate::names::closest(name, &names).join(", ")),
            )
        })?;
        let file = self.file_path(t.file);
        let f = File::open(&file)
            .map_err(|e| Error::invalid(format!("Hugging Face checkpoint file {}", file.display()), e.to_string()))?;
        let chunk = self.chunk(name, t, vec![0; t.shape.len()]);
        let rows = t.shape.first().copied().unwrap_or(1);
        format::read_rows(&f, &file.display().to_string(), name, &chunk, format::dtype_kind(&t.dtype)?, 0, rows)
    }

    pub(crate) fn file_path(&self, i: usize) -> PathBuf {
        self.dir.join(&self.files[i])
    }

    pub(crate) fn files(&self) -> &[String] {
        &self.files
    }

    pub(crate) fn stored(&self) -> &BTreeMap<String, Stored> {
        &self.tensors
    }

    /// The tensor `name` as a chunk of our format's metadata, placed at `offsets` of a global tensor.
    pub(crate) fn chunk(&self, name: &str, t: &Stored, offsets: Vec<i64>) -> format::ChunkMeta {
        format::ChunkMeta {
            offsets,
            lengths: t.shape.clone(),
            file: t.file,
            begin: t.begin,
            end: t.end,
            block_crc32: Vec::new(),
            unchecked: true,
            stored_as: Some(name.to_string()),
        }
    }
}

/// The largest header read (the safetensors format's own limit, 100 MB).
const HEADER_MAX: u64 = 100_000_000;

/// The tensors a safetensors file's header lists, checked by the format's own reader (offsets in
/// order, inside the file, of the size their dtype and shape give).
fn header(path: &Path, file: usize) -> Result<Vec<(String, Stored)>> {
    let what = || format!("Hugging Face checkpoint file {}", path.display());
    let f = File::open(path).map_err(|e| Error::invalid(what(), e.to_string()))?;
    let len = f.metadata().map_err(|e| Error::invalid(what(), e.to_string()))?.len();
    let bad = |why: String| Error::invalid(what(), format!("not a safetensors file: {why}"));
    // the header only, read (a map of the file would end the process with SIGBUS if it were truncated
    // meanwhile); the format's own parser checks the offsets, in order and of the size each dtype and
    // shape give, and the data must end where the file does
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0).map_err(|e| bad(format!("{len} bytes, no header length: {e}")))?;
    let n = u64::from_le_bytes(n);
    if n > HEADER_MAX || 8 + n > len {
        return Err(bad(format!("a header of {n} bytes in a file of {len}")));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact_at(&mut text, 8).map_err(|e| bad(format!("its header: {e}")))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let base = 8 + n;
    if base + meta.data_len() as u64 != len {
        return Err(bad(format!(
            "its header describes {} bytes of data after {base}, the file has {}",
            meta.data_len(),
            len.saturating_sub(base)
        )));
    }
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        out.push((
            name,
            Stored {
                file,
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.iter().map(|&d| d as i64).collect(),
                begin: base + info.data_offsets.0 as u64,
                end: base + info.data_offsets.1 as u64,
            },
        ));
    }
    Ok(out)
}
