//! Checkpoints.
//!
//! - **Sharded** ([`Checkpointer`], [`StateDict`]): every rank writes only the chunks it owns (a chunk
//!   held by several ranks is written once, the writing spread over them), one safetensors file per rank
//!   and one JSON metadata file written last, so a crash leaves the previous checkpoint loadable. It loads
//!   onto any layout (world size, ZeRO stage 0-3, tensor-parallel degree, pipeline partition): each rank
//!   reads only the rows it needs. Saving can run in the background ([`Checkpointer::async_save`]).
//!   `scripts/ckpt_to_torch.py` reads it into a PyTorch state dict.
//! - **Single file** ([`save_var_store`], [`load_var_store`]): rank 0 writes everything; for small
//!   models every rank holds whole (a variable a layout splits is refused by name).
//! - **Hugging Face checkpoints** ([`hf`]): a model directory as `transformers` writes it, read into any
//!   layout (each rank reading only its parts) and written back from one.
//! - **The whole model, one file, any layout** ([`save_full`]): FSDP's shards, tensor-parallel slices
//!   and other ranks' pipeline stages written whole, for export or inference (tch's `vs.save` writes
//!   only this rank's part: under FSDP, its shards).
//!
//! ```no_run
//! # let pg = std::sync::Arc::new(tch_dist::ProcessGroup::from_env()?);
//! # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! use tch_dist::checkpoint::{Checkpointer, StateDict};
//! use tch_dist::optim::AdamW;
//! let mut opt = AdamW::new(vs.trainable_variables(), 1e-3);
//! let mut ck = Checkpointer::new(pg, "ckpt")?;
//! let start = ck.load(StateDict::new().var_store("model", &vs).optimizer("optim", &mut opt))?.unwrap_or(0);
//! // ... train; every k steps, with the state as it is then:
//! ck.save(start + 10, StateDict::new().var_store("model", &vs).optimizer("optim", &mut opt))?;
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod file;
pub(crate) mod format;
mod full;
pub mod hf;
mod load;
mod plan;
mod region;
mod save;
pub(crate) mod state;

pub use file::{
    load, load_var_store, read, save, save_var_store, var_store_tensors, write_atomic, CHECKSUM_KEY, STEP_KEY,
};
pub use format::METADATA;
pub use full::save_full;
pub use load::{load_dir, read_full, verify, LoadedInfo};
pub use save::{committed_steps, step_dir, Checkpointer};
pub use state::StateDict;
