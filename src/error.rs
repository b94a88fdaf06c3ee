//! One error type for the crate: what failed, and the message libtorch gave.
use std::time::Duration;

/// Errors of tch-dist. Each variant says which operation failed and carries the engine's message. `Debug`
/// prints the same one line as `Display`, so `main() -> Result<(), Box<dyn Error>>` reports it readably.
#[derive(thiserror::Error)]
pub enum Error {
    /// An operation did not complete within its timeout (collective, store wait, rendezvous).
    #[error("{op}: timed out after {timeout:?}: {msg}")]
    Timeout { op: String, timeout: Duration, msg: String },
    /// A peer closed its connection, died, or could not be reached.
    #[error("{op}: peer gone or unreachable: {msg}")]
    PeerGone { op: String, msg: String },
    /// Tensors or models disagree across ranks or with what the operation needs.
    #[error("{op}: mismatch: {msg}")]
    Mismatch { op: String, msg: String },
    /// A bad argument: rank out of range, unsupported dtype for an op, ...
    #[error("{op}: invalid argument: {msg}")]
    Invalid { op: String, msg: String },
    /// The backend or device is not available (e.g. NCCL without the `cuda` feature, or no GPU).
    #[error("{what} is not available: {msg}")]
    Unavailable { what: String, msg: String },
    /// Another rank failed its part of a collective step (writing a checkpoint, an optimizer step, ...);
    /// every rank gets this error at once, naming the rank and its cause.
    #[error("{op}: rank {rank} failed: {msg}")]
    RankFailed { op: String, rank: usize, msg: String },
    /// Ranks ran out of inputs unevenly, and `JoinOptions::throw_on_early_termination` asked to fail.
    #[error("{op}: uneven inputs: {msg}")]
    UnevenInputs { op: String, msg: String },
    /// A `torchrun`-style environment variable is missing or malformed.
    #[error("environment variable {var}: {msg}")]
    Env { var: String, msg: String },
    /// Any other failure reported by c10d.
    #[error("{op}: {msg}")]
    Backend { op: String, msg: String },
    /// An error from tch itself.
    #[error(transparent)]
    Torch(tch::TchError),
}

/// A tch error is ours again when it carries one of our errors that failed a backward (see
/// [`queue_backward_callback`](crate::hooks::queue_backward_callback)), with its kind: a DDP or FSDP
/// backward that lost a peer is a peer failure.
impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        across::take(&e.to_string()).unwrap_or(Error::Torch(e))
    }
}

/// The message that fails a backward with `e` (autograd carries only text): `e`'s own, marked so that
/// the tch error the backward returns turns back into `e` (`From<TchError>`).
/// An error kept to be reported later, again: an invalid argument as it was, any other as one.
pub(crate) fn replay(e: &Error) -> Error {
    match e {
        Error::Invalid { op, msg } => Error::invalid(op.clone(), msg.clone()),
        other => Error::invalid("tch-dist", other.to_string()),
    }
}

pub(crate) fn crossing_autograd(e: Error) -> String {
    across::put(e)
}

/// Errors on their way across autograd, by number: a few, the latest (one that nobody turns back is
/// dropped when newer ones push it out).
mod across {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use super::Error;

    const MARK: &str = "[tch-dist error #";
    const KEEP: usize = 16;
    static WAITING: Mutex<(u64, VecDeque<(u64, Error)>)> = Mutex::new((0, VecDeque::new()));

    pub(super) fn put(e: Error) -> String {
        let mut msg = e.to_string();
        // the shim's error buffer holds 2048 bytes: the message is cut before the mark, never the mark
        let mut keep = msg.len().min(2048 - 48);
        while !msg.is_char_boundary(keep) {
            keep -= 1;
        }
        msg.truncate(keep);
        let mut w = WAITING.lock().unwrap_or_else(|p| p.into_inner());
        w.0 += 1;
        let n = w.0;
        w.1.push_back((n, e));
        while w.1.len() > KEEP {
            w.1.pop_front();
        }
        format!("{msg} {MARK}{n}]")
    }

    pub(super) fn take(msg: &str) -> Option<Error> {
        let at = msg.rfind(MARK)? + MARK.len();
        let n: u64 = msg[at..].split(']').next()?.parse().ok()?;
        let mut w = WAITING.lock().unwrap_or_else(|p| p.into_inner());
        let i = w.1.iter().position(|(k, _)| *k == n)?;
        w.1.remove(i).map(|(_, e)| e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl Error {
    pub(crate) fn invalid(op: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Invalid { op: op.into(), msg: msg.into() }
    }

    pub(crate) fn mismatch(op: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Mismatch { op: op.into(), msg: msg.into() }
    }

    /// The same error, reported as a failure of `op` (keeps the kind and the engine's message).
    pub(crate) fn in_op(self, op: String) -> Self {
        match self {
            Error::Timeout { timeout, msg, .. } => Error::Timeout { op, timeout, msg },
            Error::PeerGone { msg, .. } => Error::PeerGone { op, msg },
            Error::Mismatch { msg, .. } => Error::Mismatch { op, msg },
            Error::Invalid { msg, .. } => Error::Invalid { op, msg },
            Error::Backend { msg, .. } => Error::Backend { op, msg },
            other => other,
        }
    }

    /// The same error with `note` appended to its message (e.g. which rank never arrived).
    pub(crate) fn with_note(self, note: &str) -> Self {
        let add = |msg: String| format!("{msg}; {note}");
        match self {
            Error::Timeout { op, timeout, msg } => Error::Timeout { op, timeout, msg: add(msg) },
            Error::PeerGone { op, msg } => Error::PeerGone { op, msg: add(msg) },
            Error::Mismatch { op, msg } => Error::Mismatch { op, msg: add(msg) },
            Error::Invalid { op, msg } => Error::Invalid { op, msg: add(msg) },
            Error::Backend { op, msg } => Error::Backend { op, msg: add(msg) },
            other => other,
        }
    }

    /// True for errors that mean a peer is gone or did not answer in time.
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::PeerGone { .. })
    }
}

/// What a caught panic said, on one line: a panicking tch op's own message (not `called
/// Result::unwrap() on an Err value: Torch("...")` around it, nor the C++ backtrace after it).
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    let msg =
        p.downcast_ref::<String>().map(|s| s.as_str()).or_else(|| p.downcast_ref::<&str>().copied()).unwrap_or("panic");
    let first = msg.lines().next().unwrap_or(msg);
    // tch's error inside the unwrap's message is its Debug form: escaped, its backtrace after a "\n"
    let inner = first.strip_prefix("called `Result::unwrap()` on an `Err` value: Torch(\"").unwrap_or(first);
    let inner = inner.split("\\n").next().unwrap_or(inner);
    inner.strip_suffix("\")").unwrap_or(inner).to_string()
}

pub(crate) fn classify_invalid(op: String, msg: String) -> Error {
    if looks_like_mismatch(&msg) {
        Error::Mismatch { op, msg }
    } else {
        Error::Invalid { op, msg }
    }
}

pub(crate) fn classify_generic(op: String, msg: String) -> Error {
    if looks_like_mismatch(&msg) {
        Error::Mismatch { op, msg }
    } else {
        Error::Backend { op, msg }
    }
}

// Gloo reports a size disagreement between ranks as a failed length check on the received message.
fn looks_like_mismatch(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("mismatch") || m.contains("preamble.length") || m.contains("nbytes") || m.contains("size of")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_reads_like_display() {
        let e = Error::invalid("allreduce", "a CPU tensor");
        assert_eq!(format!("{e:?}"), "allreduce: invalid argument: a CPU tensor");
        assert_eq!(format!("{e:?}"), e.to_string());
    }

    #[test]
    fn a_panicking_tch_op_reads_as_its_own_message() {
        let a = tch::Tensor::zeros([4], (tch::Kind::Float, tch::Device::Cpu));
        let b = tch::Tensor::zeros([7], (tch::Kind::Float, tch::Device::Cpu));
        let p = std::panic::catch_unwind(|| &a + &b).expect_err("mismatched shapes panic in tch");
        let msg = panic_message(&*p);
        assert!(msg.starts_with("The size of tensor a (4) must match the size of tensor b (7)"), "{msg}");
        assert!(!msg.contains("unwrap") && !msg.contains("\\n"), "{msg}");
        assert_eq!(panic_message(&"plain"), "plain");
    }

    #[test]
    fn an_error_that_failed_a_backward_comes_back_of_its_kind() {
        let msg = crossing_autograd(Error::PeerGone { op: "allreduce".into(), msg: "connection closed".into() });
        let e = Error::from(tch::TchError::Torch(format!("in backward: {msg} (and a backtrace)")));
        assert!(matches!(e, Error::PeerGone { .. }) && e.is_peer_failure(), "{e:?}");
        // a message longer than the shim's 2048-byte buffer keeps its mark within it
        let long =
            crossing_autograd(Error::Timeout { op: "x".into(), timeout: Duration::ZERO, msg: "é".repeat(3000) });
        assert!(long.len() <= 2047, "{}", long.len());
        assert!(Error::from(tch::TchError::Torch(long)).is_peer_failure());
        // taken once: the same text again is only tch's error
        let again = Error::from(tch::TchError::Torch(msg));
        assert!(matches!(again, Error::Torch(_)), "{again:?}");
    }
}
