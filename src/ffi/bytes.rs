//! A contiguous CPU tensor's memory as bytes: how checkpoints read and write tensors without a copy.
//! The callers' contract (stated at each call) is that no one else writes the tensor while its bytes are
//! read, and no one else reads or writes it while they are written.
use tch::{Device, Tensor};

/// The byte count of a contiguous CPU tensor, or None for any other.
fn cpu_len(t: &Tensor) -> Option<usize> {
    (t.device() == Device::Cpu && t.is_contiguous()).then(|| t.numel() * t.kind().elt_size_in_bytes())
}

/// The bytes of a contiguous CPU tensor, borrowed from it; None for any other tensor.
pub(crate) fn bytes(t: &Tensor) -> Option<&[u8]> {
    match cpu_len(t)? {
        0 => Some(&[]),
        // SAFETY: a contiguous CPU tensor's data is `n` initialised bytes at data_ptr, kept alive by `t`,
        // which the slice borrows; by the callers' contract nothing writes them meanwhile.
        n => Some(unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, n) }),
    }
}

/// Runs `f` over the bytes of a contiguous CPU tensor to fill them; None (without calling `f`) for
/// any other tensor.
pub(crate) fn fill<R>(t: &Tensor, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
    match cpu_len(t)? {
        0 => Some(f(&mut [])),
        // SAFETY: `n` bytes at data_ptr belong to `t`, alive for the call; by the callers' contract no
        // one else reads or writes them while `f` runs, and the slice does not outlive it.
        n => Some(f(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, n) })),
    }
}

/// Copies `src`'s bytes into `dst`, both contiguous on the CPU, of one kind and size, and apart;
/// false (having done nothing) otherwise.
pub(crate) fn copy(src: &Tensor, dst: &Tensor) -> bool {
    let (Some(n), Some(m)) = (cpu_len(src), cpu_len(dst)) else { return false };
    if n != m || src.kind() != dst.kind() || n == 0 {
        return n == m && n == 0;
    }
    let (s, d) = (src.data_ptr() as usize, dst.data_ptr() as usize);
    if s < d + n && d < s + n {
        return false;
    }
    // SAFETY: both spans are n bytes of live contiguous CPU tensors, checked not to overlap; by the
    // callers' contract no one else uses `dst` meanwhile.
    unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, n) };
    true
}
