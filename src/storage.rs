//! A tensor's storage freed and allocated again in place: FSDP frees a unit's gathered parameters between
//! uses this way. The storage object stays, so every tensor sharing it (the parameters' views, the tensors
//! autograd saved for backward) sees memory again once it is allocated and filled. Also: memory handed
//! from one storage to another (FSDP's buffer handover), and whether a storage is shared (a pipeline
//! stage frees its sent output only when nothing else reads it). A storage that a collective still uses
//! ([`InUse`]) is neither freed nor handed over: its memory would go back to the allocator, and on CUDA
//! to the next kernel, while the engine still writes into it.
use std::collections::BTreeMap;
use std::sync::Mutex;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi;

/// Storages with collectives in flight, by identity, and how many.
static PENDING: Mutex<BTreeMap<i64, usize>> = Mutex::new(BTreeMap::new());

fn id(t: &Tensor) -> Result<i64> {
    ffi::storage_id(t)
}

/// The storages of a collective in flight, registered until this is dropped (after its wait).
#[must_use]
pub(crate) struct InUse(Vec<i64>);

/// Registers the storages of `ts` as used by a collective in flight.
pub(crate) fn in_use(ts: &[&Tensor]) -> Result<InUse> {
    let ids = ts.iter().map(|t| id(t)).collect::<Result<Vec<_>>>()?;
    let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    for &i in &ids {
        *p.entry(i).or_insert(0) += 1;
    }
    Ok(InUse(ids))
}

impl Drop for InUse {
    fn drop(&mut self) {
        let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        for i in &self.0 {
            if let Some(n) = p.get_mut(i) {
                *n -= 1;
                if *n == 0 {
                    p.remove(i);
                }
            }
        }
    }
}

fn refuse_if_pending(t: &Tensor, what: &str) -> Result<()> {
    let i = id(t)?;
    if i != 0 && PENDING.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&i) {
        return Err(Error::invalid(
            format!("{what} of {:?}{:?}", t.kind(), t.size()),
            "a collective on this storage is still in flight: wait for it first (its memory would be reused \
             while the engine writes into it)",
        ));
    }
    Ok(())
}

fn resize(t: &Tensor, nbytes: i64) -> Result<()> {
    ffi::storage_resize(t, nbytes)
}

/// Frees `t`'s storage. Until [`allocate`] gives it memory again, nothing may read a tensor sharing it.
pub(crate) fn free(t: &Tensor) -> Result<()> {
    refuse_if_pending(t, "free the storage")?;
    resize(t, 0)
}

/// Gives `t`'s freed storage memory for all of `t` (a tensor at offset 0 covering its storage), contents
/// undefined.
pub(crate) fn allocate(t: &Tensor) -> Result<()> {
    resize(t, bytes_of(t))
}

/// The bytes all of `t` takes: what [`allocate`] gives its storage.
pub(crate) fn bytes_of(t: &Tensor) -> i64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as i64
}

/// Bytes `t`'s storage holds now (0 when freed).
pub(crate) fn nbytes(t: &Tensor) -> Result<i64> {
    ffi::storage_nbytes(t)
}

/// Whether no other tensor shares `t`'s storage: no view of it, no copy autograd saved for backward.
pub(crate) fn sole_owner(t: &Tensor) -> Result<bool> {
    Ok(ffi::storage_use_count(t)? == 1)
}

/// Moves `src`'s memory into `dst`'s freed storage, leaving `src`'s freed: a buffer handed from one
/// tensor to another without a trip through the allocator.
pub(crate) fn move_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    refuse_if_pending(src, "hand over the storage")?;
    ffi::storage_move(dst, src)
}
