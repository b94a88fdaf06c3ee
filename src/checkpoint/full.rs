//! The whole model in one safetensors file from any layout (PyTorch's `get_model_state_dict` with
//! `full_state_dict=True`, saved by rank 0): the variables a layout splits (FSDP's flat shards, tensor-
//! parallel slices, pipeline stages on other ranks) are written whole, under their plain names. tch's own
//! `vs.save` writes only what this rank holds, which under FSDP is its shards.
//!
//! How: every rank writes its share as a sharded checkpoint beside the file (each chunk once), rank 0
//! reads it back whole and writes the file atomically, then removes the parts. Rank 0 holds the whole
//! model on the CPU meanwhile, as a full state dict does.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::nn;

use super::{read_full, step_dir, write_atomic, Checkpointer, StateDict};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// Writes every variable of `vs`, whole, to the safetensors file `path` (names as in the VarStore; the
/// step as [`save`](super::save) records it), whatever the layout: one process, DDP, ZeRO, FSDP, HSDP,
/// tensor parallel, pipeline stages. Collective over `pg` (every rank of the layout); [`load_var_store`]
/// reads it back into a whole model, `safetensors.torch.load_file` into PyTorch.
///
/// [`load_var_store`]: super::load_var_store
pub fn save_full(pg: &Arc<ProcessGroup>, path: impl AsRef<Path>, step: u64, vs: &nn::VarStore) -> Result<()> {
    let path = path.as_ref();
    let _call = pg.enter_call("checkpoint::save_full");
    let parts = parts_dir(path);
    let saved = Checkpointer::new(pg.clone(), &parts).and_then(|mut ck| {
        ck.save(step, StateDict::new().var_store(PREFIX, vs))?;
        let local = if pg.rank() == 0 { assemble(&step_dir(&parts, step), path, step) } else { Ok(()) };
        pg.meta().outcome("checkpoint save_full", local)
    });
    // the parts go whatever happened (a failed save leaves the previous file as it was)
    if pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&parts);
    }
    saved
}

const PREFIX: &str = "model";

/// Where the parts of `path` are written: beside it, named after it.
fn parts_dir(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".parts");
    path.with_file_name(name)
}

fn assemble(dir: &Path, path: &Path, step: u64) -> Result<()> {
    let (_, all) = read_full(dir)?;
    let whole: Vec<_> = all
        .into_iter()
        .filter_map(|(name, t)| name.strip_prefix(&format!("{PREFIX}.")).map(|n| (n.to_string(), t)))
        .collect();
    if whole.is_empty() {
        return Err(Error::invalid(format!("checkpoint {}", path.display()), "the model has no variables"));
    }
    write_atomic(path, step, &whole)
}
