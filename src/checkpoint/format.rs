//! The on-disk format of a sharded checkpoint: one safetensors file per writing rank and one JSON
//! metadata file, written last. Each chunk (a box of one tensor) is stored whole under the key
//! `name|offsets`; the metadata says, for every tensor, its global shape and dtype and which file holds
//! which chunk at which bytes, with a CRC-32 per MiB of each chunk (so a partial read is checked) and per
//! file (what `zlib.crc32` of the whole file gives).
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::region::Bx;
use crate::error::{Error, Result};

/// The metadata file's name in a checkpoint directory; its presence commits the checkpoint.
pub const METADATA: &str = "metadata.json";
pub(crate) const FORMAT: &str = "tch-dist-checkpoint";
pub(crate) const VERSION: u32 = 1;
/// Bytes covered by one CRC of a chunk.
pub(crate) const BLOCK: u64 = 1 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Metadata {
    pub format: String,
    pub version: u32,
    pub step: u64,
    /// What it was saved from: `world_size`, and what the state dict described (`zero_stage`, `tp`, ...).
    pub layout: BTreeMap<String, i64>,
    pub files: Vec<FileMeta>,
    pub tensors: BTreeMap<String, TensorMeta>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct FileMeta {
    pub name: String,
    pub rank: usize,
    pub bytes: u64,
    pub crc32: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct TensorMeta {
    pub shape: Vec<i64>,
    pub dtype: String,
    pub chunks: Vec<ChunkMeta>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ChunkMeta {
    pub offsets: Vec<i64>,
    pub lengths: Vec<i64>,
    /// Index into `files`.
    pub file: usize,
    /// Absolute byte range in the file.
    pub begin: u64,
    pub end: u64,
    pub block_crc32: Vec<u32>,
    /// A chunk of a file we did not write (a Hugging Face checkpoint): no CRCs to check it against.
    #[serde(skip)]
    pub unchecked: bool,
    /// The name that file gives the chunk's tensor, where it is not the tensor's own (errors name it).
    #[serde(skip)]
    pub stored_as: Option<String>,
}

impl ChunkMeta {
    pub(super) fn bx(&self) -> Bx {
        Bx { offsets: self.offsets.clone(), lengths: self.lengths.clone() }
    }
}

/// safetensors' names for the dtypes we store.
const DTYPES: &[(Kind, &str)] = &[
    (Kind::Double, "F64"),
    (Kind::Float, "F32"),
    (Kind::Half, "F16"),
    (Kind::BFloat16, "BF16"),
    (Kind::Int64, "I64"),
    (Kind::Int, "I32"),
    (Kind::Int16, "I16"),
    (Kind::Int8, "I8"),
    (Kind::Uint8, "U8"),
    (Kind::Bool, "BOOL"),
];

pub(crate) fn dtype_name(k: Kind) -> Result<&'static str> {
    DTYPES
        .iter()
        .find(|(kk, _)| *kk == k)
        .map(|(_, n)| *n)
        .ok_or_else(|| Error::invalid("checkpoint", format!("dtype {k:?} cannot be stored")))
}

pub(crate) fn dtype_kind(name: &str) -> Result<Kind> {
    DTYPES
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(k, _)| *k)
        .ok_or_else(|| Error::invalid("checkpoint", format!("unknown dtype {name:?}")))
}

/// The bytes of a contiguous CPU tensor.
pub(crate) fn bytes_of(t: &Tensor) -> Result<&[u8]> {
    // writers only read tensors no one writes meanwhile: a synchronous save runs before training
    // resumes, and an asynchronous one reads its own staged copies
    crate::ffi::bytes::bytes(t)
        .ok_or_else(|| Error::invalid("checkpoint", "internal: writing a tensor that is not contiguous on the CPU"))
}

/// One chunk to write: a box of tensor `name`, its data contiguous on the CPU.
pub(crate) struct Piece {
    pub name: String,
    pub bx: Bx,
    pub data: Tensor,
}

/// Where a written piece landed: (name, box, begin, end, per-block CRCs).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Written {
    pub name: String,
    pub bx: Bx,
    pub begin: u64,
    pub end: u64,
    pub block_crc32: Vec<u32>,
}

/// Writes `pieces` as a safetensors file at `path` (a temporary name, fsync, rename, fsync of the
/// directory). Returns the file's size and CRC-32, and where each piece is.
pub(crate) fn write_file(path: &Path, pieces: &[Piece]) -> Result<(u64, u32, Vec<Written>)> {
    let what = || format!("checkpoint file {}", path.display());
    let io = |e: std::io::Error| Error::invalid(what(), e.to_string());
    // widest dtypes first, so every tensor's data stays aligned to its element size
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(pieces[i].data.kind().elt_size_in_bytes()));
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    let mut spans = vec![(0u64, 0u64); pieces.len()];
    for &i in &order {
        let p = &pieces[i];
        let n = (p.data.numel() * p.data.kind().elt_size_in_bytes()) as u64;
        let offsets: Vec<String> = p.bx.offsets.iter().map(|o| o.to_string()).collect();
        header.insert(
            format!("{}|{}", p.name, offsets.join(",")),
            serde_json::json!({"dtype": dtype_name(p.data.kind())?, "shape": p.bx.lengths, "data_offsets": [at, at + n]}),
        );
        spans[i] = (at, at + n);
        at += n;
    }
    let mut head = serde_json::to_vec(&header).map_err(|e| Error::invalid(what(), e.to_string()))?;
    while (8 + head.len()) % 8 != 0 {
        head.push(b' ');
    }
    let base = 8 + head.len() as u64;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("rank");
    let tmp = dir.join(format!(".{name}.tmp"));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io)?;
        let mut file_crc = crc32fast::Hasher::new();
        let len = (head.len() as u64).to_le_bytes();
        for part in [&len[..], &head[..]] {
            f.write_all(part).map_err(io)?;
            file_crc.update(part);
        }
        let mut written = vec![None; pieces.len()];
        for &i in &order {
            let bytes = bytes_of(&pieces[i].data)?;
            f.write_all(bytes).map_err(io)?;
            let mut crcs = Vec::with_capacity(bytes.len().div_ceil(BLOCK as usize));
            for block in bytes.chunks(BLOCK as usize) {
                let mut h = crc32fast::Hasher::new();
                h.update(block);
                file_crc.combine(&h);
                crcs.push(h.finalize());
            }
            written[i] = Some(Written {
                name: pieces[i].name.clone(),
                bx: pieces[i].bx.clone(),
                begin: base + spans[i].0,
                end: base + spans[i].1,
                block_crc32: crcs,
            });
        }
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)?;
        File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        Ok((base + at, file_crc.finalize(), written.into_iter().flatten().collect()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Rows `r0..r1` (along dimension 0; elements for a 1-D chunk, the whole value for a scalar) of a stored
/// chunk, read from `f` and checked against the chunk's CRCs. `file` names the file in errors.
pub(crate) fn read_rows(
    f: &File,
    file: &str,
    name: &str,
    c: &ChunkMeta,
    kind: Kind,
    r0: i64,
    r1: i64,
) -> Result<Tensor> {
    let elt = kind.elt_size_in_bytes() as u64;
    let row_elems: i64 = c.lengths.iter().skip(1).product();
    let row = row_elems as u64 * elt;
    let (want0, want1) = if c.lengths.is_empty() { (0, elt) } else { (r0 as u64 * row, r1 as u64 * row) };
    let size = c.end - c.begin;
    if want1 > size || (c.lengths.is_empty() && size != elt) {
        return Err(Error::mismatch(
            format!("checkpoint file {file}"),
            format!("{name}: the chunk holds {size} bytes, fewer than its shape {:?} needs", c.lengths),
        ));
    }
    // whole CRC blocks around the wanted bytes (just those bytes when there are no CRCs)
    let b0 = want0 / BLOCK;
    let b1 = want1.div_ceil(BLOCK).max(b0);
    let (s0, s1) = if c.unchecked { (want0, want1) } else { (b0 * BLOCK, (b1 * BLOCK).min(size)) };
    // zeroed, not empty: its bytes are handed out as a slice to read into, which must be initialised
    let buf = Tensor::f_zeros([(s1 - s0) as i64], (Kind::Uint8, tch::Device::Cpu))?;
    if s1 > s0 {
        // `buf` is fresh: nothing else references it
        let filled = crate::ffi::bytes::fill(&buf, |dst| -> Result<()> {
            f.read_exact_at(dst, c.begin + s0).map_err(|e| {
                Error::invalid(
                    format!("checkpoint file {file}"),
                    format!("{}: cannot read bytes {}..: {e}", c.stored_as.as_deref().unwrap_or(name), c.begin + s0),
                )
            })?;
            for (k, block) in dst.chunks(BLOCK as usize).enumerate().filter(|_| !c.unchecked) {
                let expected = c.block_crc32.get(b0 as usize + k).copied();
                if expected != Some(crc32fast::hash(block)) {
                    return Err(Error::mismatch(
                        format!("checkpoint file {file}"),
                        format!(
                            "{name}: bytes {}..{} fail their checksum: the file is damaged",
                            c.begin + s0 + k as u64 * BLOCK,
                            c.begin + s0 + k as u64 * BLOCK + block.len() as u64
                        ),
                    ));
                }
            }
            Ok(())
        });
        filled.ok_or_else(|| Error::invalid("checkpoint", "internal: a read buffer not contiguous on the CPU"))??;
    }
    let data = buf.f_narrow(0, (want0 - s0) as i64, (want1 - want0) as i64)?.f_view_dtype(kind)?;
    let mut shape = c.lengths.clone();
    if let Some(first) = shape.first_mut() {
        *first = r1 - r0;
    }
    Ok(data.f_view(shape.as_slice())?)
}

/// Reads a whole stored chunk straight into `dst` and checks it, when `dst` can take its bytes as they
/// are (contiguous on the CPU, of the stored size). Returns false, having done nothing, when not.
pub(crate) fn read_into(f: &File, file: &str, name: &str, c: &ChunkMeta, kind: Kind, dst: &Tensor) -> Result<bool> {
    let n = (dst.numel() * dst.kind().elt_size_in_bytes()) as u64;
    if dst.kind() != kind || n != c.end - c.begin || n == 0 {
        return Ok(false);
    }
    // loading writes the state dict's tensors in place by contract, while no other code uses them
    // (loading is collective and synchronous)
    Ok(crate::ffi::bytes::fill(dst, |bytes| check_read(f, file, name, c, bytes)).transpose()?.is_some())
}

/// Reads chunk `c` of `file` into `bytes` (its size) and checks its blocks' checksums.
fn check_read(f: &File, file: &str, name: &str, c: &ChunkMeta, bytes: &mut [u8]) -> Result<()> {
    let what = || format!("checkpoint file {file}");
    f.read_exact_at(bytes, c.begin).map_err(|e| {
        let name = c.stored_as.as_deref().unwrap_or(name);
        Error::invalid(what(), format!("{name}: cannot read bytes {}..{}: {e}", c.begin, c.end))
    })?;
    for (k, block) in bytes.chunks(BLOCK as usize).enumerate().filter(|_| !c.unchecked) {
        if c.block_crc32.get(k).copied() != Some(crc32fast::hash(block)) {
            let at = c.begin + k as u64 * BLOCK;
            return Err(Error::mismatch(
                what(),
                format!("{name}: bytes {at}..{} fail their checksum: the file is damaged", at + block.len() as u64),
            ));
        }
    }
    Ok(())
}

/// Reads and checks a checkpoint directory's metadata.
pub(crate) fn read_metadata(dir: &Path) -> Result<Metadata> {
    let path = dir.join(METADATA);
    let what = format!("checkpoint {}", path.display());
    let bytes = std::fs::read(&path).map_err(|e| Error::invalid(what.clone(), e.to_string()))?;
    let m: Metadata =
        serde_json::from_slice(&bytes).map_err(|e| Error::invalid(what.clone(), format!("not readable: {e}")))?;
    if m.format != FORMAT || m.version != VERSION {
        return Err(Error::invalid(
            what,
            format!("format {} version {}, expected {FORMAT} version {VERSION}", m.format, m.version),
        ));
    }
    Ok(m)
}
