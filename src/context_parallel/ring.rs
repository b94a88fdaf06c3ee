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
//! On the CPU a block is one call of ATen's fused flash attention, which returns the block's
//! log-sum-exp beside its output (`_scaled_dot_product_flash_attention_for_cpu`), and its gradients one
//! call of that kernel's backward given the merged output and log-sum-exp (PyTorch's ring attention
//! does the same with the CUDA kernels): the block's scores never exist whole, and memory is linear in
//! the chunk. Outputs merge in float32 (float64 for float64). Elsewhere (CUDA, until its kernels are
//! wired and checked on a GPU) blocks run in ATen's matrix products, in float32 for float32 and half
//! inputs (converted per block; the exchanges carry the input dtype), in float64 for float64, a
//! block's `[chunk, chunk]` scores living only while it computes.
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

#[cfg(feature = "testing")]
thread_local! {
    /// `reference::with_written_out_attention`: this thread's blocks in matrix products.
    pub(crate) static WRITTEN_OUT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether blocks of `q`'s dtype and device run in the fused kernel (see the module docs).
fn fused(q: &Tensor) -> bool {
    #[cfg(feature = "testing")]
    if WRITTEN_OUT.with(|w| w.get()) {
        return false;
    }
    // the kernel reads a row's head dimension packed (SDPA's dispatcher refuses it strided too); k and v
    // reach it stacked, so contiguous
    q.device() == tch::Device::Cpu
        && matches!(q.kind(), Kind::Float | Kind::Double | Kind::BFloat16 | Kind::Half)
        && q.stride().last() == Some(&1)
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

/// One kernel call of a step: query chunks `q` (indices into this rank's chunks) against chunks `k` of
/// the keys held now, under a causal mask (the same chunks, in ascending order) or none.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Call {
    q: std::ops::Range<usize>,
    k: std::ops::Range<usize>,
    causal: bool,
}

/// A step's calls, as few as the mask allows (PyTorch's ring attention makes one per step): with the
/// same chunks on both sides (a rank's own, ascending), one causal call over them all; else, where the
/// pairs that are not skipped form a rectangle of full pairs over consecutive chunks (always, in either
/// layout), one call over it; else one per pair.
fn calls(causal: bool, queries: &[i64], keys: &[i64]) -> Vec<Call> {
    let all = |n: usize| 0..n;
    if !causal {
        return vec![Call { q: all(queries.len()), k: all(keys.len()), causal: false }];
    }
    if queries == keys && queries.windows(2).all(|w| w[0] < w[1]) {
        return vec![Call { q: all(queries.len()), k: all(keys.len()), causal: true }];
    }
    let live = |i: usize, j: usize| pair(true, queries[i], keys[j]);
    let qi: Vec<usize> = all(queries.len()).filter(|&i| all(keys.len()).any(|j| live(i, j) != Pair::Skip)).collect();
    let kj: Vec<usize> = all(keys.len()).filter(|&j| all(queries.len()).any(|i| live(i, j) != Pair::Skip)).collect();
    let range = |v: &[usize]| match (v.first(), v.last()) {
        (Some(&a), Some(&b)) if b - a + 1 == v.len() => Some(a..b + 1),
        _ => None,
    };
    match (range(&qi), range(&kj)) {
        (Some(q), Some(k)) if q.clone().all(|i| k.clone().all(|j| live(i, j) == Pair::Full)) => {
            vec![Call { q, k, causal: false }]
        }
        _ if qi.is_empty() => Vec::new(),
        _ => {
            let pairs = all(queries.len()).flat_map(|i| all(keys.len()).map(move |j| (i, j)));
            pairs
                .filter(|&(i, j)| live(i, j) != Pair::Skip)
                .map(|(i, j)| Call { q: i..i + 1, k: j..j + 1, causal: live(i, j) == Pair::Diagonal })
                .collect()
        }
    }
}

/// Chunks `r` of `x` along the sequence (dim 2), each `len` long.
fn span(x: &Tensor, r: &std::ops::Range<usize>, len: i64) -> Result<Tensor> {
    Ok(x.f_narrow(2, r.start as i64 * len, (r.end - r.start) as i64 * len)?)
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

    /// The chunks of this rank's queries and of the keys held at `step`, as [`calls`] reads them: one
    /// piece each without a mask (the chunks need no telling apart).
    fn ids(&self, step: usize) -> (Vec<i64>, Vec<i64>) {
        let (r, c) = (self.pg.rank(), self.pg.size());
        match self.causal {
            true => (self.chunks(r).ids, self.chunks((r + c - step) % c).ids),
            false => (vec![0], vec![0]),
        }
    }

    /// Chunk length: the whole local sequence without a mask (one piece), a chunk's with one.
    fn piece_len(&self, q: &Tensor) -> Result<i64> {
        let len = self.chunks(self.pg.rank()).len("ContextParallel::attention", q.size()[2])?;
        Ok(if self.causal { len } else { q.size()[2] })
    }

    /// A block's scores in the blocks' kind, scaled and masked.
    fn scores(&self, q: &Tensor, k: &Tensor, causal: bool) -> Result<Tensor> {
        let acc = acc(q.kind());
        let s = q.f_to_kind(acc)?.f_matmul(&k.f_to_kind(acc)?.f_transpose(-2, -1)?)?.f_mul_scalar(self.scale)?;
        if !causal {
            return Ok(s);
        }
        let (lq, lk) = (q.size()[2], k.size()[2]);
        let future = Tensor::f_ones([lq, lk], (Kind::Bool, q.device()))?.f_triu(1)?;
        Ok(s.f_masked_fill(&future, f64::NEG_INFINITY)?)
    }

    /// One call's output (normalised over its keys, in the blocks' kind) and its log-sum-exp
    /// `[b, h, s, 1]`.
    fn block(&self, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Tensor)> {
        let acc = acc(q.kind());
        if fused(q) {
            let (o, lse) = Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu(
                q,
                k,
                v,
                0.0,
                causal,
                None::<Tensor>,
                Some(self.scale),
            )?;
            return Ok((o.f_to_kind(acc)?, lse.f_to_kind(acc)?.f_unsqueeze(-1)?));
        }
        let s = self.scores(q, k, causal)?;
        let lse = s.f_logsumexp([-1], true)?;
        let o = s.f_sub(&lse)?.f_exp()?.f_matmul(&v.f_to_kind(acc)?)?;
        Ok((o, lse))
    }

    /// Forward, without autograd: this rank's output (in the blocks' kind) and its log-sum-exp `[b, h, s, 1]`.
    pub(crate) fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let _g = tch::no_grad_guard();
        let c = self.pg.size();
        let len = self.piece_len(q)?;
        let whole = self.ids(0).0.len();
        // (output, log-sum-exp) so far: a first call over every query is taken as it is; else they start
        // at 0 and -inf, which the first block merged replaces
        let mut seen: Option<(Tensor, Tensor)> = None;
        let mut kv = Tensor::f_stack(&[k, v], 0)?;
        for step in 0..c {
            let next = if step + 1 < c { Some(Shift::start(&kv, &self.pg)?) } else { None };
            let (qs, ks) = self.ids(step);
            let (keys, values) = (kv.f_select(0, 0)?, kv.f_select(0, 1)?);
            for call in calls(self.causal, &qs, &ks) {
                let (o, l) = self.block(
                    &span(q, &call.q, len)?,
                    &span(&keys, &call.k, len)?,
                    &span(&values, &call.k, len)?,
                    call.causal,
                )?;
                let (out, lse) = match seen.take() {
                    None if call.q == (0..whole) => {
                        seen = Some((o, l));
                        continue;
                    }
                    None => {
                        let mut size = q.size();
                        let out = Tensor::f_zeros(size.as_slice(), (acc(q.kind()), q.device()))?;
                        size[3] = 1;
                        (out, Tensor::f_full(size.as_slice(), f64::NEG_INFINITY, (acc(q.kind()), q.device()))?)
                    }
                    Some(s) => s,
                };
                let (ao, al) = (span(&out, &call.q, len)?, span(&lse, &call.q, len)?);
                let merged = al.f_logaddexp(&l)?;
                let _ = ao.shallow_clone().f_mul_(&al.f_sub(&merged)?.f_exp()?)?;
                let _ = ao.shallow_clone().f_add_(&o.f_mul(&l.f_sub(&merged)?.f_exp()?)?)?;
                al.shallow_clone().f_copy_(&merged)?;
                seen = Some((out, lse));
            }
            if let Some(n) = next {
                kv = n.wait()?;
            }
        }
        seen.ok_or_else(|| Error::invalid("ring attention", "no query met a key"))
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
        let len = self.piece_len(q)?;
        let acc = acc(q.kind());
        let dq = q.f_zeros_like()?.f_to_kind(acc)?;
        let (dk, dv) = if fused(q) {
            // the kernel's operands: the input dtype, the log-sum-exp as it returns it ([b, h, s])
            let kernel_lse = if q.kind() == Kind::Double { Kind::Double } else { Kind::Float };
            // dense rows (the kernel reads a row's head dimension packed): the incoming gradient may be
            // an expanded scalar (`out.sum()`) with every stride 0
            let (g, out) = (g.f_to_kind(q.kind())?.f_contiguous()?, out.f_to_kind(q.kind())?);
            let lse = lse.f_to_kind(kernel_lse)?;
            // given the merged output and log-sum-exp of its queries, a call's gradients are its exact
            // share of the whole's
            self.ring_backward(k, v, len, acc, |call, kb, vb, dkb, dvb| {
                let at = |x: &Tensor| span(x, &call.q, len);
                let (bq, bk, bv) = Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu_backward(
                    &at(&g)?,
                    &at(q)?,
                    kb,
                    vb,
                    &at(&out)?,
                    &at(&lse)?.f_squeeze_dim(-1)?,
                    0.0,
                    call.causal,
                    None::<Tensor>,
                    Some(self.scale),
                )?;
                let _ = at(&dq)?.f_add_(&bq)?;
                let _ = dkb.shallow_clone().f_add_(&bk)?;
                let _ = dvb.shallow_clone().f_add_(&bv)?;
                Ok(())
            })?
        } else {
            let g = g.f_to_kind(acc)?;
            // the softmax backward's row term: rowsum(dO * O)
            let d = g.f_mul(out)?.f_sum_dim_intlist(&[-1i64][..], true, acc)?;
            self.ring_backward(k, v, len, acc, |call, kb, vb, dkb, dvb| {
                let at = |x: &Tensor| span(x, &call.q, len);
                let (qa, ga) = (at(q)?, at(&g)?);
                let prob = self.scores(&qa, kb, call.causal)?.f_sub(&at(lse)?)?.f_exp()?;
                let _ = dvb.shallow_clone().f_add_(&prob.f_transpose(-2, -1)?.f_matmul(&ga)?)?;
                let dp = ga.f_matmul(&vb.f_transpose(-2, -1)?.f_to_kind(acc)?)?;
                let dsc = prob.f_mul(&dp.f_sub(&at(&d)?)?)?.f_mul_scalar(self.scale)?;
                let _ = at(&dq)?.f_add_(&dsc.f_matmul(&kb.f_to_kind(acc)?)?)?;
                let _ = dkb.shallow_clone().f_add_(&dsc.f_transpose(-2, -1)?.f_matmul(&qa.f_to_kind(acc)?)?)?;
                Ok(())
            })?
        };
        Ok([dq.f_to_kind(q.kind())?, dk, dv])
    }

    /// The backward's walk around the ring: `block(call, k, v, dk, dv)` adds the gradients of one call
    /// (its keys and values given, and their gradients' places in this step's share); returns the
    /// gradients of this rank's own keys and values, in their dtypes.
    ///
    /// The keys' and values' gradients travel the ring with them, summed along the way: a step's share
    /// is computed while the sum so far is on its way from the previous rank, added once it arrives, and
    /// sent on without waiting (PyTorch's ring backward overlaps it so); after the last step the sums
    /// reach their owners.
    fn ring_backward(
        &self,
        k: &Tensor,
        v: &Tensor,
        len: i64,
        acc: Kind,
        mut block: impl FnMut(&Call, &Tensor, &Tensor, &Tensor, &Tensor) -> Result<()>,
    ) -> Result<(Tensor, Tensor)> {
        let c = self.pg.size();
        let mut kv = Tensor::f_stack(&[k, v], 0)?;
        // the sum so far of the gradient of the keys and values held now, on its way here
        let mut arriving: Option<Shift> = None;
        let mut dkv = Tensor::new();
        for step in 0..c {
            let next = if step + 1 < c { Some(Shift::start(&kv, &self.pg)?) } else { None };
            let (qs, ks) = self.ids(step);
            let (keys, values) = (kv.f_select(0, 0)?, kv.f_select(0, 1)?);
            let mut share = kv.f_zeros_like()?.f_to_kind(acc)?;
            let (dks, dvs) = (share.f_select(0, 0)?, share.f_select(0, 1)?);
            for call in calls(self.causal, &qs, &ks) {
                let at = |x: &Tensor| span(x, &call.k, len);
                block(&call, &at(&keys)?, &at(&values)?, &at(&dks)?, &at(&dvs)?)?;
            }
            dkv = match arriving.take() {
                Some(sum) => share.f_add_(&sum.wait()?)?,
                None => share,
            };
            if c > 1 {
                arriving = Some(Shift::start(&dkv, &self.pg)?);
            }
            if let Some(n) = next {
                kv = n.wait()?;
            }
        }
        // the sums of this rank's own keys and values, from the rank that held them last
        if let Some(sum) = arriving {
            dkv = sum.wait()?;
        }
        Ok((dkv.f_select(0, 0)?.f_to_kind(k.kind())?, dkv.f_select(0, 1)?.f_to_kind(v.kind())?))
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
    let mut outs = crate::ffi::function::attach("RingAttentionBackward", &[q, k, v], &[y], move |g| {
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

    /// A step's calls cover exactly the pairs the mask leaves, each once, under the mask it needs; in
    /// either layout a step is at most one call (PyTorch's count).
    #[test]
    fn a_step_is_one_call_covering_exactly_the_pairs_left() {
        for c in 1..=5usize {
            for balanced in [true, false] {
                for r in 0..c {
                    for step in 0..c {
                        let (qs, ks) =
                            (Chunks::of(r, c, balanced).ids, Chunks::of((r + c - step) % c, c, balanced).ids);
                        let made = calls(true, &qs, &ks);
                        assert!(made.len() <= 1, "c {c} balanced {balanced} rank {r} step {step}: {made:?}");
                        let mut covered = std::collections::BTreeMap::new();
                        for call in &made {
                            for i in call.q.clone() {
                                for j in call.k.clone() {
                                    let p = pair(true, qs[i], ks[j]);
                                    // a causal call's mask is the diagonal's where the chunks meet themselves
                                    let masked = if call.causal { qs[i] == ks[j] } else { false };
                                    assert!(
                                        p != Pair::Skip || (call.causal && qs[i] < ks[j]),
                                        "{call:?} covers a skipped pair"
                                    );
                                    if p != Pair::Skip {
                                        assert_eq!(masked, p == Pair::Diagonal, "{call:?}: pair ({i}, {j})");
                                        *covered.entry((i, j)).or_insert(0) += 1;
                                    }
                                }
                            }
                        }
                        for (i, &a) in qs.iter().enumerate() {
                            for (j, &b) in ks.iter().enumerate() {
                                let want = usize::from(pair(true, a, b) != Pair::Skip);
                                assert_eq!(
                                    covered.get(&(i, j)).copied().unwrap_or(0),
                                    want,
                                    "c {c} rank {r} step {step} pair ({i}, {j})"
                                );
                            }
                        }
                    }
                }
            }
        }
        // chunks out of order on one side, or a ragged set of pairs: one call per pair
        assert_eq!(calls(true, &[1, 0], &[1, 0]).len(), 3);
        assert_eq!(calls(true, &[1, 3], &[0, 2]).len(), 3);
    }
}
