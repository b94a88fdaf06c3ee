//! The training-loop check of DDP and FSDP: at the start of each forward and each backward, every rank
//! says how many of each it has done. A rank that runs a forward or backward the others do not (a
//! forward on rank 0 only, to sample; uneven inputs) would pair its collectives with the wrong ones of
//! the others, and hang or trip the engine; this small fixed-size exchange names it first.
use super::ProcessGroup;
use crate::error::Result;

/// Where in the loop a rank is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoopPhase {
    Forward,
    Backward,
}

impl LoopPhase {
    fn code(self) -> i64 {
        match self {
            LoopPhase::Forward => 1,
            LoopPhase::Backward => 2,
        }
    }
    fn name(code: i64) -> &'static str {
        if code == 1 {
            "forward"
        } else {
            "backward"
        }
    }
    /// The check's kind (see [`ProcessGroup::checks_now`]) for DDP or FSDP (`fsdp`); fixed names, so
    /// that the hot path allocates nothing.
    pub(crate) fn kind(self, fsdp: bool) -> &'static str {
        match (fsdp, self) {
            (false, LoopPhase::Forward) => "DDP loop at forward",
            (false, LoopPhase::Backward) => "DDP loop at backward",
            (true, LoopPhase::Forward) => "FSDP loop at forward",
            (true, LoopPhase::Backward) => "FSDP loop at backward",
        }
    }
}

/// The exchange itself: an error naming each rank's counts when they differ. `hint` ends the message
/// (what the wrapper offers for uneven inputs).
pub(crate) fn agree_on_loop(
    pg: &ProcessGroup,
    who: &str,
    phase: LoopPhase,
    forwards: i64,
    backwards: i64,
    hint: &str,
) -> Result<()> {
    let what = format!("{who} {}", LoopPhase::name(phase.code()));
    pg.meta().agree(&what, &[phase.code(), forwards, backwards], |rows| {
        let listing: Vec<String> = rows
            .iter()
            .enumerate()
            .map(|(r, v)| {
                format!(
                    "rank {r} is starting {who} {} with {} forwards and {} backwards done",
                    LoopPhase::name(v[0]),
                    v[1],
                    v[2]
                )
            })
            .collect();
        format!(
            "ranks disagree on the training loop ({}); every rank must run the same forwards and backwards{hint}",
            listing.join("; ")
        )
    })?;
    Ok(())
}
