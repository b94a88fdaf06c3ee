//! Safe wrappers of the few C library calls the crate makes itself (the host's name, a socket's state,
//! an exit hook, a signal to this process), so that `unsafe` stays under `ffi`.
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// This machine's host name ("" when it cannot be read).
pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it on success.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(0);
    if ok {
        String::from_utf8_lossy(&buf[..end]).to_string()
    } else {
        String::new()
    }
}

/// Whether the peer closed `stream` (a look at its input without taking any, never blocking).
pub(crate) fn peer_closed(stream: &TcpStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: the descriptor is open for the duration of the call (`stream` owns it), and the buffer is
    // one valid byte; MSG_PEEK | MSG_DONTWAIT neither consumes input nor blocks.
    let n = unsafe {
        libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    n == 0
}

/// Runs `f` at the process's normal exit (C's `atexit`).
pub(crate) fn at_exit(f: extern "C" fn()) {
    // SAFETY: registers a plain extern "C" function with no arguments, run once at normal exit.
    unsafe { libc::atexit(f) };
}

/// Kills this process with SIGKILL (fault injection).
#[cfg(feature = "testing")]
pub(crate) fn kill_self() {
    // SAFETY: raising a signal on this process has no memory-safety preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}
