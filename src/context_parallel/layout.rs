//! Which tokens of a sequence each rank of a context-parallel group holds. The sequence is cut into equal
//! chunks; with load balancing into `2c` chunks for `c` ranks, rank `i` holding chunks `i` and `2c-1-i`
//! (head and tail), so that under a causal mask every rank has the same work; without it into `c`
//! chunks, rank `i` holding chunk `i`. PyTorch's `context_parallel` lays sequences out the same way
//! (its head-tail load balancer).
use tch::Tensor;

use crate::error::{Error, Result};

/// The chunks of the sequence that one rank holds, in its local order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunks {
    /// Global chunk indices (chunk `j` holds tokens `[j·len, (j+1)·len)`).
    pub(crate) ids: Vec<i64>,
    /// How many chunks the whole sequence has.
    pub(crate) count: i64,
}

impl Chunks {
    pub(crate) fn of(rank: usize, ranks: usize, load_balance: bool) -> Chunks {
        let (r, c) = (rank as i64, ranks as i64);
        if load_balance {
            Chunks { ids: vec![r, 2 * c - 1 - r], count: 2 * c }
        } else {
            Chunks { ids: vec![r], count: c }
        }
    }

    /// The chunk length for a local part of `local` tokens, or an error naming `what`.
    pub(crate) fn len(&self, what: &str, local: i64) -> Result<i64> {
        let n = self.ids.len() as i64;
        if local <= 0 || local % n != 0 {
            return Err(Error::invalid(
                what,
                format!("this rank's {local} tokens do not split into its {n} chunks of the sequence"),
            ));
        }
        Ok(local / n)
    }
}

/// This rank's part of `x`, the whole sequence along `dim`: its chunks, concatenated (differentiable).
pub(crate) fn shard(what: &str, x: &Tensor, dim: i64, chunks: &Chunks) -> Result<Tensor> {
    let size = x.size();
    let d = dim_index(what, &size, dim)?;
    let total = size[d];
    if total % chunks.count != 0 {
        return Err(Error::invalid(
            what,
            format!(
                "the sequence (dim {dim} of {size:?}) has {total} tokens, not divisible into {} chunks",
                chunks.count
            ),
        ));
    }
    let len = total / chunks.count;
    let parts =
        chunks.ids.iter().map(|&j| x.f_narrow(d as i64, j * len, len)).collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&parts, d as i64)?)
}

/// The whole sequence along `dim` from every rank's part (`parts[r]` from rank `r`), in global order.
pub(crate) fn unshard(what: &str, parts: &[Tensor], dim: i64, ranks: usize, load_balance: bool) -> Result<Tensor> {
    let Some(first) = parts.first() else { return Err(Error::invalid(what, "no parts")) };
    let size = first.size();
    let d = dim_index(what, &size, dim)?;
    let per_rank = Chunks::of(0, ranks, load_balance);
    let len = per_rank.len(what, size[d])?;
    let mut by_id: Vec<Option<Tensor>> = (0..per_rank.count).map(|_| None).collect();
    for (r, p) in parts.iter().enumerate() {
        for (i, &j) in Chunks::of(r, ranks, load_balance).ids.iter().enumerate() {
            by_id[j as usize] = Some(p.f_narrow(d as i64, i as i64 * len, len)?);
        }
    }
    let ordered =
        by_id.into_iter().collect::<Option<Vec<_>>>().ok_or_else(|| Error::invalid(what, "a chunk is missing"))?;
    Ok(Tensor::f_cat(&ordered, d as i64)?)
}

fn dim_index(what: &str, size: &[i64], dim: i64) -> Result<usize> {
    let n = size.len() as i64;
    let d = if dim < 0 { dim + n } else { dim };
    if !(0..n).contains(&d) {
        return Err(Error::invalid(what, format!("dim {dim} is out of range for a tensor of shape {size:?}")));
    }
    Ok(d as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn head_and_tail_chunks_cover_the_sequence_once_and_round_trip() {
        for ranks in 1..=4usize {
            for lb in [false, true] {
                let x = Tensor::arange(24 * ranks as i64, (Kind::Int64, Device::Cpu)).view([1, -1]);
                let parts: Vec<Tensor> =
                    (0..ranks).map(|r| shard("t", &x, 1, &Chunks::of(r, ranks, lb)).unwrap()).collect();
                let back = unshard("t", &parts, -1, ranks, lb).unwrap();
                assert!(back.equal(&x), "ranks {ranks} balanced {lb}");
            }
        }
        // 3 ranks, balanced: rank 0 holds chunks 0 and 5 of 6
        let x = Tensor::arange(12, (Kind::Int64, Device::Cpu));
        let p = shard("t", &x, 0, &Chunks::of(0, 3, true)).unwrap();
        assert_eq!(Vec::<i64>::try_from(&p).unwrap(), vec![0, 1, 10, 11]);
        assert!(shard("t", &x.narrow(0, 0, 10), 0, &Chunks::of(0, 3, true)).is_err());
    }
}
