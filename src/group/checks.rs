//! When agreement checks run. On Gloo, before every collective (Gloo aborts the process on a size
//! mismatch, so the check is what turns that into an error). Before NCCL's work, which takes
//! microseconds, each check is a host round trip, so by default there each kind of check (an operation,
//! DDP's loop check at forward or at backward, clipping's layout, a pair's send and receive) runs at its
//! first call in the group, as PyTorch's DDP verifies once at construction.
//!
//! What that leaves unchecked on NCCL after the first call: a disagreement in size shows as NCCL's
//! timeout, which the flight recorder and tchrun name; one of the same size (another reduce op or root,
//! an extra backward whose buckets line up) completes with wrong numbers. `TCH_DIST_VERIFY=always`
//! checks every time, for debugging.
//!
//! Whether a call checks must be decided alike on every rank, also when the ranks disagree on what they
//! pass (else one rank's check would meet another's collective): so it depends on the kind of call and
//! how many came before, never on shapes. Collectives count in one scope, point-to-point in one scope per
//! direction and peer (a sender's sends to its destination come as its receiver's receives from it).
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use tch::Device;

use super::policy::CheckPolicy;
use super::{Backend, ProcessGroup};

/// Which calls a check's set follows.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Scope {
    /// Collectives: every rank of the group makes them.
    Collective,
    /// Sends to a peer, and receives from one: the pair makes them.
    SendTo(usize),
    RecvFrom(usize),
}

/// The kinds of check a group has made, per scope.
#[derive(Default)]
pub(crate) struct Checked(Mutex<HashMap<Scope, HashSet<String>>>);

impl Checked {
    /// Whether this is the first call of `kind` in `scope` (now remembered).
    fn first(&self, scope: Scope, kind: &str) -> bool {
        let mut all = match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        // after the first call, every call comes here: no allocation then
        let seen = all.entry(scope).or_default();
        !seen.contains(kind) && seen.insert(kind.to_string())
    }
}

impl ProcessGroup {
    /// Whether the agreement check of `kind` (a fixed name: what is compared is not part of it), before
    /// work on tensors of `device`, runs now (see the module docs and [`CheckPolicy`]). Decided by the
    /// engine that takes such tensors, which is the same on every rank.
    pub(crate) fn checks_now(&self, scope: Scope, kind: &str, device: Device) -> bool {
        // a shut-down group refuses the collective itself, naming the shutdown; a check first would
        // talk to peers that may be gone
        if !self.verify || self.size == 1 || self.slot(device).is_some_and(|e| e.is_shut()) {
            return false;
        }
        let once = match self.checks {
            CheckPolicy::Always => false,
            CheckPolicy::OnceOnNccl => self.backend_for(device) == Some(Backend::Nccl),
            CheckPolicy::Once => true,
        };
        !once || self.checked.first(scope, kind)
    }
}

#[cfg(test)]
mod tests {
    use super::{Checked, Scope};

    #[test]
    fn each_kind_checks_at_its_first_call_in_its_scope() {
        let c = Checked::default();
        assert!(c.first(Scope::Collective, "allreduce"));
        assert!(!c.first(Scope::Collective, "allreduce"));
        assert!(c.first(Scope::Collective, "broadcast"), "another kind is another check");
        assert!(c.first(Scope::SendTo(1), "allreduce"), "another scope counts apart");
        assert!(!c.first(Scope::SendTo(1), "allreduce"));
        assert!(c.first(Scope::SendTo(2), "allreduce"));
        assert!(c.first(Scope::RecvFrom(1), "allreduce"));
    }
}
