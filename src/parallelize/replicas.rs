//! The variables a tensor-parallel group does not split are replicated: every rank of the group must
//! hold the same values, or the ranks train different models and nothing says so (a seed per rank, a
//! checkpoint loaded on one rank). PyTorch's `distribute_tensor` broadcasts a replicated tensor from the
//! mesh's first rank; here they are compared instead, once, when the model is finished, so that the
//! mistake is named rather than hidden: the split layers would still start from slices of different
//! draws, which no broadcast repairs.
use std::sync::Arc;

use tch::{nn, Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// Compares every variable of `vs` that `pg` does not split across `pg`'s ranks: an error naming the first
/// that differs and the ranks. Collective over `pg` (one all-gather of two integers per variable).
pub(crate) fn check_agree(vs: &nn::VarStore, pg: &Arc<ProcessGroup>) -> Result<()> {
    // what each rank holds: a variable FSDP shards is an empty placeholder in the VarStore, its values
    // in the shard (the same range on the ranks of a tensor-parallel group, which share a shard group place)
    let vars: Vec<(String, Tensor)> = crate::var_store::sorted_variables(vs)
        .into_iter()
        .filter_map(|(name, t)| match crate::placement::of(&t) {
            Some(l) if l.is_partial_over(pg) => None,
            Some(l) => Some((name, l.local().map_or(t, |s| s.shallow_clone()))),
            None => Some((name, t)),
        })
        .collect();
    // every rank calls the collective, whatever it holds: a rank that skipped it would hang the others
    let _g = tch::no_grad_guard();
    let rows = vars.iter().map(|(_, t)| digest(t)).collect::<Result<Vec<_>>>()?;
    let mine = if rows.is_empty() {
        Tensor::f_zeros([0], (Kind::Int64, pg.meta_device()))?
    } else {
        Tensor::f_cat(&rows.iter().map(|r| r.f_to(pg.meta_device())).collect::<tch::Result<Vec<_>>>()?, 0)?
    };
    let mut all: Vec<Tensor> = (0..pg.size()).map(|_| mine.zeros_like()).collect();
    pg.all_gather(&mut all, &mine)?;
    let all: Vec<Vec<i64>> =
        all.iter().map(|a| a.f_to(Device::Cpu).and_then(|c| Vec::<i64>::try_from(&c))).collect::<tch::Result<_>>()?;
    for (i, (name, t)) in vars.iter().enumerate() {
        let of = |r: usize| &all[r][2 * i..2 * i + 2];
        if let Some(r) = (1..pg.size()).find(|&r| of(r) != of(0)) {
            return Err(Error::mismatch(
                "Plan::finish",
                format!(
                    "variable {name} ({:?} {:?}), which tensor parallelism does not split, holds different values on \
                     ranks 0 and {r} of the tensor-parallel group: its ranks must build the model from the same \
                     seed (tch::manual_seed with one value on every rank; a seed per rank draws different \
                     models) and load the same state",
                    t.kind(),
                    t.size()
                ),
            ));
        }
    }
    Ok(())
}

/// Two integers that equal another tensor's exactly when (short of a collision) the bits do: the
/// elements' bits as integers, summed plainly and weighted by position. Integer sums are exact in any
/// order, so equal tensors give equal digests on any machine and thread count.
fn digest(t: &Tensor) -> Result<Tensor> {
    let flat = t.f_detach()?.f_contiguous()?.f_reshape([-1])?;
    let bits = match t.kind().elt_size_in_bytes() {
        8 => flat.f_view_dtype(Kind::Int64)?,
        4 => flat.f_view_dtype(Kind::Int)?,
        2 => flat.f_view_dtype(Kind::Int16)?,
        _ => flat.f_view_dtype(Kind::Uint8)?,
    };
    let n = bits.size()[0];
    let mut sums = Tensor::f_zeros([2], (Kind::Int64, bits.device()))?;
    // in chunks: the integer copies of a large embedding must not need memory of their own
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        let part = bits.f_narrow(0, start, len)?.f_to_kind(Kind::Int64)?;
        let weights = Tensor::f_arange_start(start, start + len, (Kind::Int64, bits.device()))?
            .f_remainder(1021)?
            .f_add_scalar(1)?;
        let plain = part.f_sum(Kind::Int64)?;
        let weighted = part.f_mul(&weights)?.f_sum(Kind::Int64)?;
        sums = sums.f_add(&Tensor::f_stack(&[plain, weighted], 0)?)?;
        start += len;
    }
    Ok(sums)
}

/// Elements digested at a time.
const CHUNK: i64 = 1 << 24;
