//! When agreement checks run. On Gloo, before every collective (Gloo aborts the process on a size
//! mismatch, so the check is what turns that into an error). Before NCCL's work, which takes
//! microseconds, each check is a host round trip, so by default each distinct check (its label and what it
//! compares: operation, dtype, shape) runs the first time only, as PyTorch's DDP verifies once at
//! construction; a disagreement after that shows as NCCL's timeout, which the flight recorder and tchrun
//! name. The decision is a function of the calls so far, the same on every rank while the ranks agree.
use std::collections::HashSet;
use std::sync::Mutex;

use tch::Device;

use super::{Backend, ProcessGroup};

/// Checks remembered at most; past it a group stops checking NCCL's tensors (on every rank at once: the
/// set grows the same everywhere).
const REMEMBERED: usize = 4096;

/// The checks before NCCL work a group has run.
#[derive(Default)]
pub(crate) struct Checked(Mutex<HashSet<(String, Vec<i64>)>>);

impl Checked {
    /// Whether `(label, key)` is new (and now remembered).
    fn first(&self, label: &str, key: &[i64]) -> bool {
        let mut seen = match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        seen.len() < REMEMBERED && seen.insert((label.to_string(), key.to_vec()))
    }
}

impl ProcessGroup {
    /// Whether the agreement check `label` on `key`, before work on tensors of `device`, runs now (see
    /// the module docs and
    /// [`GroupOptions::verify_cuda_every_time`](super::GroupOptions::verify_cuda_every_time)). Decided by
    /// the engine that takes such tensors, which is the same on every rank.
    pub(crate) fn checks_now(&self, label: &str, key: &[i64], device: Device) -> bool {
        if !self.verify || self.size == 1 {
            return false;
        }
        let nccl = self.backend_for(device) == Some(Backend::Nccl);
        !nccl || self.verify_cuda_every_time || self.checked.first(label, key)
    }
}

#[cfg(test)]
mod tests {
    use super::Checked;

    #[test]
    fn each_check_runs_once() {
        let c = Checked::default();
        assert!(c.first("allreduce", &[1, 2]));
        assert!(!c.first("allreduce", &[1, 2]));
        assert!(c.first("allreduce", &[1, 3]), "another shape is another check");
        assert!(c.first("broadcast", &[1, 2]), "another label is another check");
    }
}
