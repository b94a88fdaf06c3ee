//! Multi-head self-attention split by heads across the tensor-parallel group (Megatron's
//! `ParallelAttention`): a column-parallel QKV projection gives rank r the queries, keys and values of
//! heads `[r·h/t, (r+1)·h/t)`, each rank attends over its own heads (ATen's fused
//! `scaled_dot_product_attention`, which keeps no `[seq, seq]` scores for backward), and a row-parallel output
//! projection sums the ranks' parts. One allreduce forward (after the output projection), one backward
//! (before the QKV projection), as the MLP.
use std::sync::Arc;

use tch::{nn, Tensor};

use super::layers::{ColumnParallelLinear, RowParallelLinear};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// Self-attention over `[batch, seq, d]` with `heads` heads split across the group.
#[derive(Debug)]
pub struct ParallelAttention {
    /// `d → 3d/t`: this rank's heads' queries, keys and values, in that order.
    pub qkv: ColumnParallelLinear,
    /// `d/t → d`, summed across the group.
    pub out: RowParallelLinear,
    local_heads: i64,
    head_dim: i64,
    causal: bool,
}

impl ParallelAttention {
    /// From the full layer's weights: `w_qkv: [3d, d]` (queries, then keys, then values, head by head
    /// within each, as `torch.nn.MultiheadAttention`'s `in_proj_weight`), `b_qkv: [3d]`, `w_out: [d, d]`,
    /// `b_out: [d]`. `causal` masks the future (a decoder's attention).
    #[allow(clippy::too_many_arguments)]
    pub fn from_full(
        path: &nn::Path,
        w_qkv: &Tensor,
        b_qkv: &Tensor,
        w_out: &Tensor,
        b_out: &Tensor,
        heads: i64,
        causal: bool,
        pg: Arc<ProcessGroup>,
    ) -> Result<Self> {
        let what = "ParallelAttention";
        let (d, t) = (w_out.size()[0], pg.size() as i64);
        if heads <= 0 || d % heads != 0 {
            return Err(Error::invalid(what, format!("d_model {d} is not divisible by {heads} heads")));
        }
        if heads % t != 0 {
            return Err(Error::invalid(
                what,
                format!("{heads} heads are not divisible by the tensor-parallel size {t}"),
            ));
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
        // this rank's heads of the queries, keys and values: rows [r·d/t, (r+1)·d/t) of each third, one
        // after the other (only this rank's rows are copied, never a reordered full matrix)
        let r = pg.rank() as i64;
        let mine = |x: &Tensor| -> Result<Tensor> {
            let parts = (0..3)
                .map(|p| x.f_narrow(0, p * d + r * (d / t), d / t))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            Ok(Tensor::f_cat(&parts, 0)?)
        };
        let qkv = ColumnParallelLinear::from_local(
            &(path / "qkv"),
            &mine(w_qkv)?,
            Some(&mine(b_qkv)?),
            pg.clone(),
            Default::default(),
        )?;
        // viewed as [3, d, ...] (queries, keys, values; `in_proj_weight.view(3, d, d)` in PyTorch's terms),
        // this rank's rows are a slice along dimension 1
        for x in std::iter::once(&qkv.ws).chain(qkv.bs.as_ref()) {
            let size = x.size();
            let lengths: Vec<i64> = [vec![3, d / t], size[1..].to_vec()].concat();
            let mut global = lengths.clone();
            global[1] = d;
            let mut offsets = vec![0; lengths.len()];
            offsets[1] = r * (d / t);
            crate::placement::record_shard(x, &pg, 1, &global, &offsets, &lengths)?;
        }
        let out = RowParallelLinear::from_full(&(path / "out"), w_out, Some(b_out), pg, Default::default())?;
        Ok(ParallelAttention { qkv, out, local_heads: heads / t, head_dim: d / heads, causal })
    }

    /// The attention's output `[batch, seq, d]`, the same on every rank; errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
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
        let ctx = Tensor::f_scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, self.causal, None, false)?;
        let ctx = ctx.f_transpose(1, 2)?.f_contiguous()?.f_view([b, s, h * hd])?;
        self.out.f_forward(&ctx)
    }
}

module!(ParallelAttention);
