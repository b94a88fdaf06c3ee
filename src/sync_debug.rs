//! `torch.cuda.set_sync_debug_mode`: while on, every operation that makes the host wait for the GPU (a
//! `.item()`, a copy to the host, a stream synchronize) warns or fails where it is called. The GPU kit
//! runs warmed training steps under it to show that they never wait.
use crate::error::{Error, Result};
use crate::ffi;

/// What a host-device sync does while the mode is on (PyTorch's "default", "warn", "error").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncDebugMode {
    Off,
    /// A warning, "called a synchronizing CUDA operation", on libtorch's warning handler (stderr).
    Warn,
    /// An error raised by the synchronizing operation.
    Error,
}

/// Sets the mode for the process; returns the one before. Without the `cuda` feature it is unavailable.
pub fn set_mode(mode: SyncDebugMode) -> Result<SyncDebugMode> {
    let code = match mode {
        SyncDebugMode::Off => 0,
        SyncDebugMode::Warn => 1,
        SyncDebugMode::Error => 2,
    };
    match ffi::cuda_set_sync_debug_mode(code) {
        Some(previous) => Ok(match previous {
            1 => SyncDebugMode::Warn,
            2 => SyncDebugMode::Error,
            _ => SyncDebugMode::Off,
        }),
        None => Err(Error::Unavailable {
            what: "CUDA sync debug mode".into(),
            msg: "this build has no CUDA (the `cuda` feature is off)".into(),
        }),
    }
}
