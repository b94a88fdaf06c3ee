//! Multi-head self-attention split by heads across the tensor-parallel group (Megatron's
//! `ParallelAttention`): a column-parallel QKV projection gives rank r the queries, keys and values of
//! heads `[r·h/t, (r+1)·h/t)`, each rank attends over its own heads (ATen's fused
//! `scaled_dot_product_attention`, which keeps no `[seq, seq]` scores for backward), and a row-parallel output
//! projection sums the ranks' parts. One allreduce forward (after the output projection), one backward
//! (before the QKV projection), as the MLP.
use std::sync::Arc;

use tch::{nn, Tensor};

use super::init::{self, Part};
use super::layers::{bias_init, ColumnParallelLinear, RowParallelConfig, RowParallelLinear};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// A [`ParallelAttention`]'s configuration, as tch's `nn::LinearConfig` is a linear layer's.
#[derive(Clone, Copy, Debug, Default)]
pub struct ParallelAttentionConfig {
    /// Mask the future (a decoder's attention).
    pub causal: bool,
    /// Dropout on the attention weights while training (`scaled_dot_product_attention`'s `dropout_p`;
    /// each rank draws its own heads' masks).
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
        // this rank's heads of the queries, keys and values: rows [r·d/t, (r+1)·d/t) of each third
        let mine: Vec<(i64, i64)> = (0..3).map(|p| (p * d + r * (d / t), d / t)).collect();
        // in nn::linear's order: the bias, then the weight
        let b_qkv = c.bias.then(|| init::rows(what, bias_init(c, d), &[3 * d], &mine, opts)).transpose()?;
        let w_qkv = init::rows(what, c.ws_init, &[3 * d, d], &mine, opts)?;
        let qkv = Self::qkv_from_local(path, &w_qkv, b_qkv.as_ref(), d, &pg, c)?;
        let b_out = c
            .bias
            .then(|| init::slice(what, bias_init(c, d), &[d], Part { dim: 0, start: 0, len: d }, opts))
            .transpose()?;
        let w_out = init::slice(what, c.ws_init, &[d, d], Part::even(1, d, r as usize, t as usize), opts)?;
        let out = RowParallelLinear::from_local(&(path / "out"), &w_out, b_out.as_ref(), pg, Self::row(c))?;
        Ok(ParallelAttention { qkv, out, local_heads: heads / t, head_dim: d / heads, config })
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
        // only this rank's rows are copied, never a reordered full matrix
        let r = pg.rank() as i64;
        let mine = |x: &Tensor| -> Result<Tensor> {
            let parts = (0..3)
                .map(|p| x.f_narrow(0, p * d + r * (d / t), d / t))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            Ok(Tensor::f_cat(&parts, 0)?)
        };
        let qkv = Self::qkv_from_local(path, &mine(w_qkv)?, Some(&mine(b_qkv)?), d, &pg, &config.linear)?;
        let out = RowParallelLinear::from_full(&(path / "out"), w_out, Some(b_out), pg, Self::row(&config.linear))?;
        Ok(ParallelAttention { qkv, out, local_heads: heads / t, head_dim: d / heads, config })
    }

    fn row(linear: &nn::LinearConfig) -> RowParallelConfig {
        RowParallelConfig { linear: *linear, ..Default::default() }
    }

    /// The QKV projection from this rank's rows, with their placement: viewed as `[3, d, ...]` (queries,
    /// keys, values; `in_proj_weight.view(3, d, d)` in PyTorch's terms), a slice along dimension 1.
    fn qkv_from_local(
        path: &nn::Path,
        w: &Tensor,
        b: Option<&Tensor>,
        d: i64,
        pg: &Arc<ProcessGroup>,
        linear: &nn::LinearConfig,
    ) -> Result<ColumnParallelLinear> {
        let (r, t) = (pg.rank() as i64, pg.size() as i64);
        let cfg = super::layers::ColumnParallelConfig { linear: *linear, ..Default::default() };
        let qkv = ColumnParallelLinear::from_local(&(path / "qkv"), w, b, pg.clone(), cfg)?;
        for x in std::iter::once(&qkv.ws).chain(qkv.bs.as_ref()) {
            let size = x.size();
            let lengths: Vec<i64> = [vec![3, d / t], size[1..].to_vec()].concat();
            let mut global = lengths.clone();
            global[1] = d;
            let mut offsets = vec![0; lengths.len()];
            offsets[1] = r * (d / t);
            crate::placement::record_shard(x, pg, 1, &global, &offsets, &lengths)?;
        }
        Ok(qkv)
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
        let ctx =
            Tensor::f_scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, p, self.config.causal, None, false)?;
        let ctx = ctx.f_transpose(1, 2)?.f_contiguous()?.f_view([b, s, h * hd])?;
        self.out.f_forward(&ctx)
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
