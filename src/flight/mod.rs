//! The flight recorder: which collective each rank was in, so that when a job hangs or a peer dies the
//! culprit is named. PyTorch's Flight Recorder (`TORCH_NCCL_TRACE_BUFFER_SIZE`, `TORCH_NCCL_DUMP_ON_TIMEOUT`,
//! the `fr_trace` analyzer) for every backend, pipelines and ZeRO included, with tchrun reading the dumps.
//!
//! - Every collective, public or internal, is an [`Entry`] in a per-process ring of the last N operations
//!   (`TCH_DIST_TRACE_ENTRIES`, default 2,000; 0 turns recording off): its group and sequence number in that
//!   group, the operation with dtype and shape, the caller's [`label`] ("DDP bucket 3"), when it was
//!   enqueued and ended, and how.
//! - Each rank publishes its progress in each group through the group's store (the last collective it
//!   entered, and a heartbeat every second). A rank whose collective times out or loses a peer reads the
//!   others' progress and says in its error which rank never arrived, and whether that rank's process is
//!   alive at all.
//! - On such a failure each rank dumps its ring to `TCH_DIST_TRACE_DIR/rank<R>.json` (tchrun sets the
//!   directory); `tchrun` merges the dumps after a failure, and `tchrun analyze DIR` does it for dumps from
//!   elsewhere ([`analyze`]).
mod analyze;
mod pickle;
mod progress;
mod record;
mod torch_format;

pub use analyze::{analyze, Analysis};
pub use record::{clear_dumps, dump, entries, label, probe, Dump, Entry, EntryState, LabelGuard, TORCH_DIR};

pub(crate) use progress::{
    describe_call, odd_one_out, CallGuard, EngineProbe, GroupTrace, HeartbeatWatch, HEARTBEAT_CHECK_EVERY,
};
pub(crate) use record::{current_label, enabled as recording, is_p2p, now, Recording};

/// c10d's own NCCL flight recorder, as JSON (`torch.distributed` `_dump_nccl_trace_json`): its entries
/// and `pg_config` name every NCCL group by the names tch-dist gives them. c10d records 2,000 entries by
/// default (`TORCH_FR_BUFFER_SIZE`, read before the first NCCL group); an error without the `cuda` feature.
pub fn nccl_trace_json() -> crate::Result<String> {
    Ok(String::from_utf8_lossy(&crate::ffi::nccl_trace_json()?).into_owned())
}
