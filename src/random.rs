//! Draws from a CPU generator of their own, seeded explicitly (through the shim, tch-dist-sys/csrc/random.cpp): the
//! values PyTorch gives for `torch.Generator().manual_seed(seed)`, while the global generator the user's
//! program draws from is left alone.
use std::sync::{Condvar, Mutex};
use std::thread::ThreadId;

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::ffi;

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))`.
pub(crate) fn randperm(n: i64, seed: u64) -> Result<Vec<i64>> {
    Ok(Vec::<i64>::try_from(&ffi::randperm(n, seed)?)?)
}

/// The default generators' states (the CPU's and every CUDA device's), put back when dropped:
/// `torch.random.fork_rng()`. Seeding inside leaves the program's draws where they were.
///
/// The default generators are one per device for the whole process, so a Fork also holds them against
/// other threads' Forks until it is dropped: two seeded builds at once (ranks or tests run as threads)
/// would otherwise draw from each other's sequences, and each restore would rewind the other's.
/// A thread may nest Forks; the hold is its own until the outermost one is dropped.
/// The hold orders Forks only: a draw outside one on another thread (tch's own `Tensor::randn`, an
/// activation-checkpointing recompute putting the generators' state back) still moves the generator a
/// Fork seeded. Programs that seed must not draw on other threads meanwhile, as in PyTorch.
pub(crate) struct Fork {
    _saved: ffi::SavedRng,
    // dropped after `_saved` has put the states back (fields drop in declaration order)
    _held: Held,
}

impl Fork {
    pub(crate) fn new() -> Result<Fork> {
        let held = Held::take();
        Ok(Fork { _saved: ffi::SavedRng::save()?, _held: held })
    }
}

/// Which thread holds the default generators, and how many of its Forks are open.
static HOLDER: Mutex<(Option<ThreadId>, usize)> = Mutex::new((None, 0));
static RELEASED: Condvar = Condvar::new();

/// The hold a [`Fork`] keeps on the default generators (re-entrant per thread).
struct Held;

impl Held {
    fn take() -> Held {
        let me = std::thread::current().id();
        // the guarded pair is updated in single assignments: a poisoned lock still holds a consistent one
        let mut h = HOLDER.lock().unwrap_or_else(|e| e.into_inner());
        while matches!(h.0, Some(other) if other != me) {
            h = RELEASED.wait(h).unwrap_or_else(|e| e.into_inner());
        }
        *h = (Some(me), h.1 + 1);
        Held
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut h = HOLDER.lock().unwrap_or_else(|e| e.into_inner());
        *h = if h.1 <= 1 { (None, 0) } else { (h.0, h.1 - 1) };
        if h.0.is_none() {
            RELEASED.notify_all();
        }
    }
}

/// `torch.manual_seed(seed)` and then `torch.randn(*shape, dtype=kind)` for each shape in turn.
pub(crate) fn randn_seq(seed: u64, kind: Kind, shapes: &[Vec<i64>]) -> Result<Vec<Tensor>> {
    draw_seq(seed, kind, shapes)
}

fn draw_seq(seed: u64, kind: Kind, shapes: &[Vec<i64>]) -> Result<Vec<Tensor>> {
    let dtype = crate::dtype::code(kind).ok_or_else(|| Error::invalid("random draws", format!("dtype {kind:?}")))?;
    ffi::draw_seq(seed, dtype, shapes)
}
