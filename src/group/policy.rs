//! How a group runs, as settings give it: its agreement checks' policy and its flat collectives'
//! algorithm. A leaf (it imports nothing of the group), so that the settings read from the environment
//! name these values without importing the group that uses them.

/// When agreement checks run, with `GroupOptions::verify` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CheckPolicy {
    /// Before every collective, on every engine (`TCH_DIST_VERIFY=always`).
    Always,
    /// Every time on Gloo; at each kind of check's first call on NCCL.
    #[default]
    OnceOnNccl,
    /// At each kind of check's first call, on every engine (`TCH_DIST_VERIFY=once`): NCCL's policy on
    /// Gloo, so that CI runs it without a GPU.
    Once,
}

/// How the flat collectives run ([`GroupOptions::collectives`](super::GroupOptions::collectives)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Collectives {
    /// The engine's fastest: NCCL's own collectives on NCCL, the ring on Gloo.
    #[default]
    Auto,
    /// The engine's own `all_gather_into_tensor` / `reduce_scatter_tensor` everywhere.
    Native,
    /// Rings of batched point-to-point steps everywhere.
    Ring,
}
