//! Safe wrappers of the shim's references (the `testing` feature): libtorch's own implementations that
//! tests compare ours against.
use super::check;
use crate::error::{Error, Result};
use crate::ffi;

/// `c10d::compute_bucket_assignment_by_size` on tensors of the given element counts, dtypes and device ids
/// (0 or 1: two distinct devices), without a tensor index order (so buckets are sorted by smallest index).
/// Returns the buckets in libtorch's order, each a list of tensor indices.
pub fn libtorch_bucket_assignment(
    numels: &[i64],
    kinds: &[tch::Kind],
    devices: &[u8],
    limits: &[u64],
) -> Result<Vec<Vec<usize>>> {
    let n = numels.len();
    if kinds.len() != n || devices.len() != n {
        return Err(Error::invalid("libtorch_bucket_assignment", "numels, kinds and devices differ in length"));
    }
    if devices.iter().any(|&d| d > 1) {
        return Err(Error::invalid("libtorch_bucket_assignment", "device ids must be 0 or 1"));
    }
    let dtypes: Vec<i32> = kinds
        .iter()
        .map(|&k| {
            crate::dtype::code(k)
                .ok_or_else(|| Error::invalid("libtorch_bucket_assignment", format!("unsupported kind {k:?}")))
        })
        .collect::<Result<_>>()?;
    let devs: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
    let mut order = vec![0i64; n];
    let mut bucket_of = vec![0i64; n];
    let mut nb = 0usize;
    // SAFETY: all arrays have n (or limits.len()) elements.
    let code = unsafe {
        ffi::tdx_ref_bucket_assignment(
            numels.as_ptr(),
            dtypes.as_ptr(),
            devs.as_ptr(),
            n,
            limits.as_ptr(),
            limits.len(),
            order.as_mut_ptr(),
            bucket_of.as_mut_ptr(),
            &mut nb,
        )
    };
    check(code, std::time::Duration::ZERO, || "c10d::compute_bucket_assignment_by_size".into())?;
    let mut buckets = vec![Vec::new(); nb];
    for &i in &order {
        buckets[bucket_of[i as usize] as usize].push(i as usize);
    }
    Ok(buckets)
}

/// Checks the layout assumptions behind the declaration-only gloo headers against the linked libtorch.
/// Returns a description of what was checked, or an error naming the broken assumption.
pub fn gloo_layout_check() -> Result<String> {
    let mut buf = vec![0u8; 512];
    // SAFETY: buf is writable for its length.
    let code = unsafe { ffi::tdx_layout_check(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let msg = String::from_utf8_lossy(&buf[..end]).to_string();
    if code == ffi::TDX_EINVALID && !msg.is_empty() {
        return Err(Error::mismatch("gloo layout check", msg));
    }
    check(code, std::time::Duration::ZERO, || "gloo layout check".into())?;
    Ok(msg)
}

/// Runs `f` while counting the outermost ATen operators it calls on this thread (and on autograd's
/// threads working for it; not the operators those call in turn, nor other threads'), and returns its
/// result with the counts by name (`aten::linear`, not the `aten::addmm` it calls): the dispatcher's
/// top-level calls, as torch.profiler lists them. One count at a time in the process.
pub fn count_ops<R>(f: impl FnOnce() -> R) -> Result<(R, std::collections::BTreeMap<String, i64>)> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: no pointers; the shim catches everything.
    check(unsafe { ffi::tdx_op_counter(1) }, std::time::Duration::ZERO, || "starting the op counter".into())?;
    let r = f();
    // SAFETY: as above.
    check(unsafe { ffi::tdx_op_counter(0) }, std::time::Duration::ZERO, || "stopping the op counter".into())?;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let mut needed = 0usize;
        // SAFETY: `buf` is writable for its length; the shim writes at most that, NUL-terminated.
        let code = unsafe { ffi::tdx_op_counts(buf.as_mut_ptr() as *mut libc::c_char, buf.len(), &mut needed) };
        check(code, std::time::Duration::ZERO, || "reading the op counts".into())?;
        if needed <= buf.len() {
            buf.truncate(needed.saturating_sub(1));
            break;
        }
        buf = vec![0u8; needed];
    }
    let text = String::from_utf8_lossy(&buf);
    let mut counts = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Some((name, n)) = line.split_once('\t') {
            counts.insert(name.to_string(), n.parse().map_err(|_| Error::invalid("count_ops", line.to_string()))?);
        }
    }
    Ok((r, counts))
}
