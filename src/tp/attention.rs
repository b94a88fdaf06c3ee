//! Multi-head self-attention split by heads across the tensor-parallel group (Megatron's
//! `ParallelAttention`): a column-parallel QKV projection gives rank r the queries, keys and values of
//! heads `[r·h/t, (r+1)·h/t)`, each rank attends over its own heads (ATen's fused
//! `scaled_dot_product_attention`, which keeps no `[seq, seq]` scores for backward), and a row-parallel output
//! projection sums the ranks' parts. One allreduce forward (after the output projection), one backward
//! (before the QKV projection), as the MLP.
use std::sync::Arc;

use tch::{nn, Tensor};

use super::init::{self, Part};
use super::layers::{bias_init, ColumnParallelConfig, ColumnParallelLinear, RowParallelConfig, RowParallelLinear};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// A [`ParallelAttention`]'s configuration, as tch's `nn::LinearConfig` is a linear layer's.
#[derive(Clone, Copy, Debug, Default)]
pub struct ParallelAttentionConfig {
    /// Mask the future (a decoder's attention).
    pub causal: bool,
    /// Dropout on the attention weights while training (`scaled_dot_product_attention`'s `dropout_p`).
    /// Each rank draws its heads' masks from a generator of its own, seeded by one draw of the global
    /// generator (which the ranks of one replica share) and its rank: Megatron's model-parallel RNG.
    pub dropout: f64,
    /// The QKV and output projections' initialisation and bias, as `nn::linear`'s.
    pub linear: nn::LinearConfig,
}

/// Self-attention over `[batch, seq, d]` with `heads` heads split across the group.
#[derive(Debug)]
pub struct ParallelAttention {
    /// `d → 3d/t`: this rank's heads' queries, keys and values, in that order.
    pub qkv: ColumnParallelLinear,
    /// `d/t → d`, summed across the group.
    pub out: RowParallelLinear,
    local_heads: i64,
    head_dim: i64,
    config: ParallelAttentionConfig,
    /// This rank in the group, and the group's size.
    rank: usize,
    ranks: usize,
}

/// `heads` heads of `d` split over `t` ranks, or an error naming what does not divide.
fn check_heads(d: i64, heads: i64, t: i64) -> Result<()> {
    let what = "ParallelAttention";
    if heads <= 0 || d % heads != 0 {
        return Err(Error::invalid(what, format!("d_model {d} is not divisible by {heads} heads")));
    }
    if heads % t != 0 {
        return Err(Error::invalid(what, format!("{heads} heads are not divisible by the tensor-parallel size {t}")));
    }
    Ok(())
}

impl ParallelAttention {
    /// A new layer under `path` (`qkv`, `out`): on every rank exactly its heads' rows of what tch's
    /// `nn::linear(path / "qkv", d, 3d, cfg)` and `nn::linear(path / "out", d, d, cfg)` would draw after
    /// the same seed (the whole matrices never exist), with the generator left where they leave it.
    pub fn new(
        path: &nn::Path,
        d: i64,
        heads: i64,
        pg: Arc<ProcessGroup>,
        config: ParallelAttentionConfig,
    ) -> Result<Self> {
        let what = "ParallelAttention";
        let (r, t) = (pg.rank() as i64, pg.size() as i64);
        check_heads(d, heads, t)?;
        let (c, opts) = (&config.linear, (path.kind(), path.device()));
        // its heads' rows of each third (queries, keys, values)
        let mine = super::layers::block_rows(3 * d, 3, r, t);
        // in nn::linear's order: the bias, then the weight
        let b_qkv = c.bias.then(|| init::rows(what, bias_init(c, d), &[3 * d], &mine, opts)).transpose()?;
        let w_qkv = init::rows(what, c.ws_init, &[3 * d, d], &mine, opts)?;
        let qkv = ColumnParallelLinear::from_local(&(path / "qkv"), &w_qkv, b_qkv.as_ref(), pg.clone(), Self::qkv(c))?;
        let b_out = c
            .bias
            .then(|| init::slice(what, bias_init(c, d), &[d], Part { dim: 0, start: 0, len: d }, opts))
            .transpose()?;
        let w_out = init::slice(what, c.ws_init, &[d, d], Part::even(1, d, r as usize, t as usize), opts)?;
        let out = RowParallelLinear::from_local(&(path / "out"), &w_out, b_out.as_ref(), pg, Self::row(c))?;
        Ok(Self::assemble(qkv, out, d, heads, config, (r, t)))
    }

    /// From the full layer's weights: `w_qkv: [3d, d]` (queries, then keys, then values, head by head
    /// within each, as `torch.nn.MultiheadAttention`'s `in_proj_weight`), `b_qkv: [3d]`, `w_out: [d, d]`,
    /// `b_out: [d]` (for tests and loading; [`new`](Self::new) draws only this rank's part).
    #[allow(clippy::too_many_arguments)]
    pub fn from_full(
        path: &nn::Path,
        w_qkv: &Tensor,
        b_qkv: &Tensor,
        w_out: &Tensor,
        b_out: &Tensor,
        heads: i64,
        pg: Arc<ProcessGroup>,
        config: ParallelAttentionConfig,
    ) -> Result<Self> {
        let what = "ParallelAttention";
        let (d, t) = (w_out.size()[0], pg.size() as i64);
        check_heads(d, heads, t)?;
        if !config.linear.bias {
            return Err(Error::invalid(what, "from_full takes both biases: config.linear.bias must be true"));
        }
        if w_qkv.size() != [3 * d, d] || b_qkv.size() != [3 * d] {
            return Err(Error::invalid(
                what,
                format!(
                    "w_qkv {:?} and b_qkv {:?} must be [{}, {d}] and [{}]",
                    w_qkv.size(),
                    b_qkv.size(),
                    3 * d,
                    3 * d
                ),
            ));
        }
        let r = pg.rank() as i64;
        let qkv = ColumnParallelLinear::from_full(
            &(path / "qkv"),
            w_qkv,
            Some(b_qkv),
            pg.clone(),
            Self::qkv(&config.linear),
        )?;
        let out = RowParallelLinear::from_full(&(path / "out"), w_out, Some(b_out), pg, Self::row(&config.linear))?;
        Ok(Self::assemble(qkv, out, d, heads, config, (r, t)))
    }

    /// The layer from its projections; `(r, t)`: this rank and the group's size.
    fn assemble(
        qkv: ColumnParallelLinear,
        out: RowParallelLinear,
        d: i64,
        heads: i64,
        config: ParallelAttentionConfig,
        (r, t): (i64, i64),
    ) -> Self {
        let (rank, ranks) = (r as usize, t as usize);
        ParallelAttention { qkv, out, local_heads: heads / t, head_dim: d / heads, config, rank, ranks }
    }

    fn row(linear: &nn::LinearConfig) -> RowParallelConfig {
        RowParallelConfig { linear: *linear, ..Default::default() }
    }

    /// The QKV projection: three fused blocks (queries, keys, values), each split by heads.
    fn qkv(linear: &nn::LinearConfig) -> ColumnParallelConfig {
        ColumnParallelConfig { linear: *linear, parts: 3, ..Default::default() }
    }

    /// The attention's output `[batch, seq, d]`, the same on every rank, with dropout while `train`;
    /// errors returned.
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let size = x.size();
        let [b, s, _] = size[..] else {
            return Err(Error::invalid("ParallelAttention", format!("input must be [batch, seq, d], not {size:?}")));
        };
        let (h, hd) = (self.local_heads, self.head_dim);
        // [b, s, 3·h·hd] → three [b, h, s, hd]; unbound, not selected three times: the backward of one
        // unbind is one stack of the three gradients, where each select's would be a zero-filled
        // [3, ...] buffer and the three summed
        let qkv = self.qkv.f_forward(x)?.f_view([b, s, 3, h, hd])?.f_unbind(2)?;
        let [q, k, v] = &qkv[..] else {
            return Err(Error::invalid("ParallelAttention", "unbind of the QKV projection gave not three parts"));
        };
        let (q, k, v) = (q.f_transpose(1, 2)?, k.f_transpose(1, 2)?, v.f_transpose(1, 2)?);
        let p = if train { self.config.dropout } else { 0.0 };
        let ctx = if p > 0.0 && self.ranks > 1 {
            self.attend_with_own_masks(&q, &k, &v, p)?
        } else {
            Tensor::f_scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, p, self.config.causal, None, false)?
        };
        let ctx = ctx.f_transpose(1, 2)?.f_contiguous()?.f_view([b, s, h * hd])?;
        self.out.f_forward(&ctx)
    }

    /// Attention with dropout whose masks this rank draws itself. SDPA's dropout draws from the default
    /// generators, which the tensor-parallel ranks of a replica share (their other dropouts must agree):
    /// rank r's heads would get rank 0's masks. So SDPA runs (its dropout inside the fused kernel where
    /// it has one: CUDA's) with the default generators seeded for this rank from one shared draw, and
    /// put back after (DTensor's RNG tracker does the same for tensor-parallel dropout). The backward
    /// draws nothing: the kernels keep their mask, or its seed and offset.
    fn attend_with_own_masks(&self, q: &Tensor, k: &Tensor, v: &Tensor, p: f64) -> Result<Tensor> {
        let shared = Tensor::f_randint(i64::MAX, [1], (tch::Kind::Int64, tch::Device::Cpu))?.f_int64_value(&[0])?;
        attend_seeded(q, k, v, p, self.config.causal, head_mask_seed(shared as u64, self.rank))
    }

    /// The forward without dropout (evaluation), errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        self.f_forward_t(x, false)
    }
}

/// A `ModuleT` (its dropout follows the train flag), as tch's layers with dropout.
impl nn::ModuleT for ParallelAttention {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(x, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// `scaled_dot_product_attention` with dropout `p`, its masks drawn from the default generators seeded
/// with `seed`; the program's own draws left where they were.
fn attend_seeded(q: &Tensor, k: &Tensor, v: &Tensor, p: f64, causal: bool, seed: u64) -> Result<Tensor> {
    let _fork = crate::random::Fork::new()?;
    tch::manual_seed(seed as i64);
    Ok(Tensor::f_scaled_dot_product_attention(q, k, v, None::<Tensor>, p, causal, None, false)?)
}

/// The seed of a rank's attention-dropout masks: the replica's shared draw, spread by the rank.
fn head_mask_seed(shared: u64, rank: usize) -> u64 {
    shared.wrapping_add((rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    /// Ranks get different masks from one shared draw; the same rank and draw, the same mask; the
    /// program's generator is left where it was.
    #[test]
    fn each_rank_draws_its_own_masks() {
        // values 1: with every weight equal, an output element is the fraction of its row's weights kept
        let ones = Tensor::ones([1, 4, 64, 8], (Kind::Float, Device::Cpu));
        let attend =
            |rank| super::attend_seeded(&ones, &ones, &ones, 0.5, false, super::head_mask_seed(7, rank)).unwrap();
        let (a, b) = (attend(0), attend(1));
        assert!(a.equal(&attend(0)), "a rank's mask is not reproducible");
        assert!(!a.equal(&b), "two ranks drew the same mask");
        let kept = a.mean(Kind::Float).double_value(&[]);
        assert!((kept - 1.0).abs() < 0.05, "dropout 0.5 rescales by 2: mean {kept}, not 1");
        tch::manual_seed(11);
        let _ = attend(0);
        let after = Tensor::randn([4], (Kind::Float, Device::Cpu));
        tch::manual_seed(11);
        assert!(after.equal(&Tensor::randn([4], (Kind::Float, Device::Cpu))), "the program's generator moved");
    }
}
