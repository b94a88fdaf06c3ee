//! Ring attention: each rank keeps its queries and passes its keys and values around the ring, one
//! neighbour a step; after `c` steps every query has met every key. Each step's block gives partial
//! outputs and their log-sum-exp, merged at the end as flash attention merges its tiles (weights
//! `exp(lse_i - lse)`), so the result is exact softmax attention. Autograd runs the ring backwards: the
//! shift's backward sends the keys' and values' gradients to the previous rank.
//!
//! Under a causal mask the work is decided per pair of chunks from their global places, on the host and
//! alike on every rank: an earlier key chunk is attended in full, the same chunk under a triangular
//! mask, a later one not at all. With the head-tail layout every rank attends the same number of pairs
//! at every step.
//!
//! Each block runs in ATen's math ops (scores in float32 for half inputs); a block holds its
//! `[chunk, chunk]` scores for backward, so a rank holds `seq²/c` scores per head, where one process
//! running the same math holds `seq²`. The exchange runs after each step's compute, not beside it.
use tch::{Kind, Tensor};

use super::layout::Chunks;
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// What one pair of chunks needs under the mask.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pair {
    Full,
    Diagonal,
    Skip,
}

fn pair(causal: bool, query: i64, key: i64) -> Pair {
    match (causal, key.cmp(&query)) {
        (false, _) | (true, std::cmp::Ordering::Less) => Pair::Full,
        (true, std::cmp::Ordering::Equal) => Pair::Diagonal,
        (true, std::cmp::Ordering::Greater) => Pair::Skip,
    }
}

fn half(k: Kind) -> bool {
    matches!(k, Kind::Half | Kind::BFloat16)
}

/// Softmax attention of `q` over `k`, `v` (optionally under `mask`, true where masked): the output
/// (float32 for half inputs) and the log-sum-exp of each query's scores.
fn block(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let mut s = q.f_matmul(&k.f_transpose(-2, -1)?)?;
    if half(s.kind()) {
        s = s.f_to_kind(Kind::Float)?;
    }
    s = s.f_mul_scalar(scale)?;
    if let Some(m) = mask {
        s = s.f_masked_fill(m, f64::NEG_INFINITY)?;
    }
    let lse = s.f_logsumexp([-1], true)?;
    let p = s.f_sub(&lse)?.f_exp()?;
    let o = p.f_to_kind(v.kind())?.f_matmul(v)?;
    let o = if half(o.kind()) { o.f_to_kind(Kind::Float)? } else { o };
    Ok((o, lse))
}

/// One query chunk's blocks merged by their log-sum-exp.
fn merge(parts: Vec<(Tensor, Tensor)>) -> Result<Tensor> {
    let (mut outs, lses): (Vec<Tensor>, Vec<Tensor>) = parts.into_iter().unzip();
    if outs.len() == 1 {
        return outs.pop().ok_or_else(|| Error::invalid("ring attention", "no block"));
    }
    let lse = Tensor::f_stack(&lses, 0)?;
    let total = lse.f_logsumexp([0], true)?;
    let w = lse.f_sub(&total)?.f_exp()?;
    let o = Tensor::f_stack(&outs, 0)?.f_mul(&w)?;
    Ok(o.f_sum_dim_intlist(0, false, o.kind())?)
}

/// `x` to the next rank of the ring, the previous rank's in its place (differentiable: the gradient
/// goes the other way).
fn shift(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let (r, c) = (pg.rank(), pg.size());
    let n = x.numel();
    let (mut ins, mut outs) = (vec![0; c], vec![0; c]);
    ins[(r + 1) % c] = n;
    outs[(r + c - 1) % c] = n;
    let y = crate::moe::all_to_all(&x.f_reshape([-1])?, pg, &outs, &ins)?;
    Ok(y.f_view(x.size().as_slice())?)
}

/// Ring attention of this rank's queries over every rank's keys and values (see the module docs):
/// `q`, `k`, `v` are `[batch, heads, local seq, head dim]`, this rank's chunks in `chunks(rank)`'s order.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: Option<f64>,
    pg: &ProcessGroup,
    chunks: impl Fn(usize) -> Chunks,
) -> Result<Tensor> {
    let what = "ContextParallel::attention";
    let (qs, ks, vs) = (q.size(), k.size(), v.size());
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err(Error::invalid(
            what,
            format!("q {qs:?}, k {ks:?} and v {vs:?} must be [batch, heads, seq, head_dim]"),
        ));
    }
    if qs[..3] != ks[..3] || ks[..3] != vs[..3] || qs[3] != ks[3] {
        return Err(Error::invalid(
            what,
            format!(
                "q {qs:?}, k {ks:?} and v {vs:?} must agree in batch, heads and (local) sequence, and q and k in head_dim"
            ),
        ));
    }
    if q.kind() != k.kind() || k.kind() != v.kind() {
        return Err(Error::invalid(
            what,
            format!("q, k and v have dtypes {:?}, {:?}, {:?}", q.kind(), k.kind(), v.kind()),
        ));
    }
    let (r, c) = (pg.rank(), pg.size());
    let scale = scale.unwrap_or(1.0 / (qs[3] as f64).sqrt());
    let mine = chunks(r);
    let len = mine.len(what, qs[2])?;
    // without a mask the chunks need no telling apart: one block a step
    let pieces = |x: &Tensor, ids: &[i64]| -> Result<Vec<(i64, Tensor)>> {
        if !causal {
            return Ok(vec![(0, x.shallow_clone())]);
        }
        ids.iter().enumerate().map(|(i, &j)| Ok((j, x.f_narrow(2, i as i64 * len, len)?))).collect()
    };
    let queries = pieces(q, &mine.ids)?;
    let mask = if causal { Some(Tensor::f_ones([len, len], (Kind::Bool, q.device()))?.f_triu(1)?) } else { None };
    let mut parts: Vec<Vec<(Tensor, Tensor)>> = queries.iter().map(|_| Vec::new()).collect();
    // keys and values travel together: one exchange a step
    let mut kv = Tensor::f_stack(&[k, v], 0)?;
    for step in 0..c {
        let src = (r + c - step) % c;
        let (kk, vv) = (kv.f_select(0, 0)?, kv.f_select(0, 1)?);
        let theirs = chunks(src);
        let (keys, values) = (pieces(&kk, &theirs.ids)?, pieces(&vv, &theirs.ids)?);
        for ((a, qa), acc) in queries.iter().zip(parts.iter_mut()) {
            for ((b, kb), (_, vb)) in keys.iter().zip(&values) {
                match pair(causal, *a, *b) {
                    Pair::Skip => {}
                    Pair::Full => acc.push(block(qa, kb, vb, scale, None)?),
                    Pair::Diagonal => acc.push(block(qa, kb, vb, scale, mask.as_ref())?),
                }
            }
        }
        if step + 1 < c {
            kv = shift(&kv, pg)?;
        }
    }
    let outs = parts.into_iter().map(merge).collect::<Result<Vec<_>>>()?;
    let out = Tensor::f_cat(&outs, 2)?.f_to_kind(q.kind())?;
    // The backward's exchanges pair up across ranks, so every rank must run all of them, also one whose
    // mask left the last blocks it received unused (a causal mask without load balancing): the last
    // keys and values, on which every exchange before depends, enter the output with weight zero.
    if c == 1 {
        return Ok(out);
    }
    let anchor = kv.f_reshape([-1])?.f_narrow(0, 0, 1)?.f_sum(out.kind())?.f_mul_scalar(0.0)?;
    Ok(out.f_add(&anchor)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With the head-tail layout every rank attends the same number of chunk pairs at every step.
    #[test]
    fn head_tail_chunks_balance_causal_work() {
        for c in 2..=5usize {
            for step in 0..c {
                let work: Vec<usize> = (0..c)
                    .map(|r| {
                        let (mine, theirs) = (Chunks::of(r, c, true), Chunks::of((r + c - step) % c, c, true));
                        let pairs = mine.ids.iter().flat_map(|&a| theirs.ids.iter().map(move |&b| pair(true, a, b)));
                        pairs.filter(|p| *p != Pair::Skip).count()
                    })
                    .collect();
                assert!(work.iter().all(|&w| w == work[0]), "c {c} step {step}: {work:?}");
            }
            // contiguous chunks: the last rank does c times the first's work
            let total = |r: usize| (0..c).filter(|&s| pair(true, r as i64, s as i64) != Pair::Skip).count();
            assert_eq!((total(0), total(c - 1)), (1, c));
        }
    }
}
