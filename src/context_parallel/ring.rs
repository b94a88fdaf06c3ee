//! Ring attention: each rank keeps its queries and passes its keys and values around the ring, one
//! neighbour a step; after `c` steps every query has met every key. Each step's blocks give partial
//! outputs and their log-sum-exp, merged as flash attention merges its tiles (weights `exp(lse_i - lse)`),
//! so the result is exact softmax attention. The next step's keys and values travel while this step's
//! blocks compute (an all-to-all waited on after them: the host on Gloo, the stream on NCCL).
//!
//! The backward is written out, as PyTorch's ring attention's and FlashAttention-2's: it keeps only q,
//! k, v, the output and its log-sum-exp (memory linear in the sequence), runs the ring again and
//! recomputes each block's probabilities from the saved log-sum-exp; the keys' and values' gradients
//! travel with their blocks, and one last exchange brings each rank its own. Every rank makes the same
//! exchanges whatever its mask skipped, so they pair up on NCCL.
//!
//! Under a causal mask the work is decided per pair of chunks from their global places, on the host and
//! alike on every rank: an earlier key chunk is attended in full, the same chunk under a triangular
//! mask, a later one not at all. With the head-tail layout every rank attends the same number of pairs
//! at every step.
//!
//! Blocks run in ATen's matrix products, in float32 for float32 and half inputs (the inputs converted per
//! block; the exchanges carry the input dtype), in float64 for float64. A block's `[chunk, chunk]`
//! scores and probabilities live only while it computes: memory kept across the call is linear in the
//! sequence, the working memory of one block quadratic in the chunk.
use std::sync::Arc;

use tch::{Kind, Tensor};

use super::layout::Chunks;
use crate::error::{Error, Result};
use crate::group::{meta, ProcessGroup, Scope};
use crate::work::Work;

/// What one pair of chunks needs under the mask.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
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

/// The kind blocks compute in: float32, or float64 for float64 inputs.
fn acc(k: Kind) -> Kind {
    if k == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// One ring attention call: the group, the layout and the mask.
#[derive(Clone)]
pub(crate) struct Ring {
    pub(crate) pg: Arc<ProcessGroup>,
    pub(crate) load_balance: bool,
    pub(crate) causal: bool,
    pub(crate) scale: f64,
}

/// A tensor's pieces along the sequence (dim `dim`), each with its global chunk: one piece, the whole,
/// without a mask (the chunks need no telling apart).
fn pieces(causal: bool, x: &Tensor, dim: i64, chunks: &Chunks, len: i64) -> Result<Vec<(i64, Tensor)>> {
    if !causal {
        return Ok(vec![(0, x.shallow_clone())]);
    }
    chunks.ids.iter().enumerate().map(|(i, &j)| Ok((j, x.f_narrow(dim, i as i64 * len, len)?))).collect()
}

/// `x` on its way to the next rank of the ring; `wait` gives the previous rank's in its place.
struct Shift {
    buf: Tensor,
    work: Work,
    size: Vec<i64>,
}

impl Shift {
    fn start(x: &Tensor, pg: &ProcessGroup) -> Result<Shift> {
        let (r, c) = (pg.rank(), pg.size());
        let flat = x.f_contiguous()?.f_view([-1])?;
        let n = flat.numel();
        let (mut ins, mut outs) = (vec![0; c], vec![0; c]);
        ins[(r + 1) % c] = n;
        outs[(r + c - 1) % c] = n;
        let mut buf = flat.f_empty_like()?;
        // the splits pair up by construction once the shapes agree (checked per call, `Ring::agree`)
        let work = pg.all_to_all_single_checked(&mut buf, &flat, &outs, &ins, false)?;
        Ok(Shift { buf, work, size: x.size() })
    }

    fn wait(self) -> Result<Tensor> {
        self.work.wait()?;
        Ok(self.buf.f_view(self.size.as_slice())?)
    }
}

impl Ring {
    fn chunks(&self, rank: usize) -> Chunks {
        Chunks::of(rank, self.pg.size(), self.load_balance)
    }

    /// A block's scores in float32, scaled and masked.
    fn scores(&self, q: &Tensor, k: &Tensor, pair: Pair, mask: &Option<Tensor>) -> Result<Tensor> {
        let acc = acc(q.kind());
        let s = q.f_to_kind(acc)?.f_matmul(&k.f_to_kind(acc)?.f_transpose(-2, -1)?)?.f_mul_scalar(self.scale)?;
        Ok(match (pair, mask) {
            (Pair::Diagonal, Some(m)) => s.f_masked_fill(m, f64::NEG_INFINITY)?,
            _ => s,
        })
    }

    /// Forward, without autograd: this rank's output (in the blocks' kind) and its log-sum-exp `[b, h, s, 1]`.
    pub(crate) fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let _g = tch::no_grad_guard();
        let (r, c) = (self.pg.rank(), self.pg.size());
        let mine = self.chunks(r);
        let len = mine.len("ContextParallel::attention", q.size()[2])?;
        let mask = self.mask(len, q)?;
        let queries = pieces(self.causal, q, 2, &mine, len)?;
        let mut acc: Vec<Option<(Tensor, Tensor)>> = queries.iter().map(|_| None).collect();
        let mut kv = Tensor::f_stack(&[k, v], 0)?;
        for step in 0..c {
            let next = if step + 1 < c { Some(Shift::start(&kv, &self.pg)?) } else { None };
            let theirs = self.chunks((r + c - step) % c);
            let keys = pieces(self.causal, &kv.f_select(0, 0)?, 2, &theirs, len)?;
            let values = pieces(self.causal, &kv.f_select(0, 1)?, 2, &theirs, len)?;
            for ((a, qa), slot) in queries.iter().zip(acc.iter_mut()) {
                for ((b, kb), (_, vb)) in keys.iter().zip(&values) {
                    let p = pair(self.causal, *a, *b);
                    if p == Pair::Skip {
                        continue;
                    }
                    let s = self.scores(qa, kb, p, &mask)?;
                    let lse = s.f_logsumexp([-1], true)?;
                    let o = s.f_sub(&lse)?.f_exp()?.f_matmul(&vb.f_to_kind(s.kind())?)?;
                    *slot = Some(match slot.take() {
                        None => (o, lse),
                        Some((ao, al)) => {
                            let l = al.f_logaddexp(&lse)?;
                            let ao = ao.f_mul(&al.f_sub(&l)?.f_exp()?)?.f_add(&o.f_mul(&lse.f_sub(&l)?.f_exp()?)?)?;
                            (ao, l)
                        }
                    });
                }
            }
            if let Some(n) = next {
                kv = n.wait()?;
            }
        }
        let (outs, lses): (Vec<Tensor>, Vec<Tensor>) = acc
            .into_iter()
            .map(|a| a.ok_or_else(|| Error::invalid("ring attention", "a query chunk met no key")))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        Ok((Tensor::f_cat(&outs, 2)?, Tensor::f_cat(&lses, 2)?))
    }

    /// Backward, without autograd: the gradients of q, k and v from the output's (`g`), the output and
    /// its log-sum-exp.
    pub(crate) fn backward(
        &self,
        g: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
    ) -> Result<[Tensor; 3]> {
        let _g = tch::no_grad_guard();
        let (r, c) = (self.pg.rank(), self.pg.size());
        let mine = self.chunks(r);
        let len = mine.len("ContextParallel::attention", q.size()[2])?;
        let mask = self.mask(len, q)?;
        let acc = acc(q.kind());
        let g = g.f_to_kind(acc)?;
        // the softmax backward's row term: rowsum(dO * O)
        let d = g.f_mul(out)?.f_sum_dim_intlist(&[-1i64][..], true, acc)?;
        let dq = q.f_zeros_like()?.f_to_kind(acc)?;
        let queries = pieces(self.causal, q, 2, &mine, len)?;
        let (gs, ds, ls, dqs) = (
            pieces(self.causal, &g, 2, &mine, len)?,
            pieces(self.causal, &d, 2, &mine, len)?,
            pieces(self.causal, lse, 2, &mine, len)?,
            pieces(self.causal, &dq, 2, &mine, len)?,
        );
        let mut kv = Tensor::f_stack(&[k, v], 0)?;
        // the gradient of the keys and values held now, travelling with them
        let mut dkv = kv.f_zeros_like()?.f_to_kind(acc)?;
        for step in 0..c {
            let next = if step + 1 < c { Some(Shift::start(&kv, &self.pg)?) } else { None };
            let theirs = self.chunks((r + c - step) % c);
            let keys = pieces(self.causal, &kv.f_select(0, 0)?, 2, &theirs, len)?;
            let values = pieces(self.causal, &kv.f_select(0, 1)?, 2, &theirs, len)?;
            let dks = pieces(self.causal, &dkv.f_select(0, 0)?, 2, &theirs, len)?;
            let dvs = pieces(self.causal, &dkv.f_select(0, 1)?, 2, &theirs, len)?;
            for (i, (a, qa)) in queries.iter().enumerate() {
                let (ga, da, la, dqa) = (&gs[i].1, &ds[i].1, &ls[i].1, &dqs[i].1);
                for (j, (b, kb)) in keys.iter().enumerate() {
                    let p = pair(self.causal, *a, *b);
                    if p == Pair::Skip {
                        continue;
                    }
                    let (vb, mut dkb, mut dvb) = (&values[j].1, dks[j].1.shallow_clone(), dvs[j].1.shallow_clone());
                    let prob = self.scores(qa, kb, p, &mask)?.f_sub(la)?.f_exp()?;
                    let _ = dvb.f_add_(&prob.f_transpose(-2, -1)?.f_matmul(ga)?)?;
                    let dp = ga.f_matmul(&vb.f_transpose(-2, -1)?.f_to_kind(acc)?)?;
                    let dsc = prob.f_mul(&dp.f_sub(da)?)?.f_mul_scalar(self.scale)?;
                    let _ = dqa.shallow_clone().f_add_(&dsc.f_matmul(&kb.f_to_kind(acc)?)?)?;
                    let _ = dkb.f_add_(&dsc.f_transpose(-2, -1)?.f_matmul(&qa.f_to_kind(acc)?)?)?;
                }
            }
            // after the last step, one more exchange brings each rank the gradient of its own block
            if c > 1 {
                dkv = Shift::start(&dkv, &self.pg)?.wait()?;
            }
            if let Some(n) = next {
                kv = n.wait()?;
            }
        }
        let (dk, dv) = (dkv.f_select(0, 0)?.f_to_kind(k.kind())?, dkv.f_select(0, 1)?.f_to_kind(v.kind())?);
        Ok([dq.f_to_kind(q.kind())?, dk, dv])
    }

    /// The agreement check before a call (by the group's policy: every call on Gloo, the first on NCCL),
    /// before any rank refuses its input alone: every rank's shapes, dtypes and settings alike, so that
    /// the ring's exchanges pair up (or every rank refuses the same input).
    fn agree(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        if !self.pg.checks_now(Scope::Collective, "ring_attention", q.device()) {
            return Ok(());
        }
        let mut mine = Vec::with_capacity(18);
        for t in [q, k, v] {
            let size = t.size();
            mine.extend((0..4).map(|i| size.get(i).copied().unwrap_or(-1)));
            mine.extend([size.len() as i64, crate::dtype::code(t.kind()).map_or(-1, i64::from)]);
        }
        mine.extend([
            self.causal as i64,
            self.load_balance as i64,
            self.scale.to_bits() as i64,
            q.device().is_cuda() as i64,
        ]);
        self.pg.meta().agree("ring attention (agreement check before it)", &mine, |rows| {
            let show = |r: &[i64]| {
                let dims = |at: usize| format!("{:?}", &r[at..at + (r[at + 4].clamp(0, 4) as usize)]);
                let on = if r[21] != 0 { "CUDA" } else { "CPU" };
                format!("q {}, k {}, v {}, causal {}, on {on}", dims(0), dims(6), dims(12), r[18] != 0)
            };
            format!("ranks call it differently: {}", meta::by_rank(rows, show, "; "))
        })?;
        Ok(())
    }

    /// The diagonal blocks' mask (true above the diagonal), on q's device.
    fn mask(&self, len: i64, q: &Tensor) -> Result<Option<Tensor>> {
        if !self.causal {
            return Ok(None);
        }
        Ok(Some(Tensor::f_ones([len, len], (Kind::Bool, q.device()))?.f_triu(1)?))
    }
}

/// Ring attention of this rank's queries over every rank's keys and values (see the module docs):
/// `q`, `k`, `v` are `[batch, heads, local seq, head dim]`, this rank's chunks in its layout's order.
pub(crate) fn attention(ring: Ring, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let what = "ContextParallel::attention";
    ring.agree(q, k, v)?;
    let (qs, ks, vs) = (q.size(), k.size(), v.size());
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err(Error::invalid(
            what,
            format!("q {qs:?}, k {ks:?} and v {vs:?} must be [batch, heads, seq, head_dim]"),
        ));
    }
    if qs != ks || ks != vs {
        return Err(Error::invalid(what, format!("q {qs:?}, k {ks:?} and v {vs:?} must have one shape")));
    }
    if !ring.scale.is_finite() {
        return Err(Error::invalid(what, format!("scale {} is not finite", ring.scale)));
    }
    if q.kind() != k.kind() || k.kind() != v.kind() || q.device() != k.device() || k.device() != v.device() {
        return Err(Error::invalid(
            what,
            format!(
                "q, k and v have dtypes {:?}, {:?}, {:?} on {:?}, {:?}, {:?}: one of each",
                q.kind(),
                k.kind(),
                v.kind(),
                q.device(),
                k.device(),
                v.device()
            ),
        ));
    }
    let (out, lse) = ring.forward(q, k, v)?;
    let out_saved = out.shallow_clone();
    let saved = [q.detach(), k.detach(), v.detach()];
    // a copy, not an alias of what the backward reads (an in-place edit of the result must not change it)
    let mut y = out.f_empty_like()?.f_to_kind(q.kind())?;
    y.f_copy_(&out)?;
    let mut outs = crate::function::attach("RingAttentionBackward", &[q, k, v], &[y], move |g| {
        let [q, k, v] = &saved;
        let grads = ring.backward(&g[0], q, k, v, &out_saved, &lse)?;
        Ok(grads.into_iter().map(Some).collect())
    })?;
    outs.pop().ok_or_else(|| Error::invalid(what, "no output"))
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
