//! The vocabulary split across the tensor-parallel group (Megatron's `VocabParallelEmbedding` and
//! `vocab_parallel_cross_entropy`): rank r of t holds rows `[r·V/t, (r+1)·V/t)` of the embedding, and the
//! same slice of the output logits (a [`ColumnParallelLinear`](super::ColumnParallelLinear) without
//! `gather_output`). The full-vocabulary logits never exist on one rank: the cross-entropy needs only
//! three allreduces of one number per token (the max, the sum of exponentials, the target's logit).
use std::sync::Arc;

use tch::{nn, Kind, Tensor};

use super::ops::reduce_from_parallel_region;
use crate::error::{Error, Result};
use crate::group::{ProcessGroup, ReduceOp};

/// This rank's vocabulary range `[start, end)` for a vocabulary of `vocab` split over `pg`.
fn vocab_range(what: &str, vocab: i64, pg: &ProcessGroup) -> Result<(i64, i64)> {
    let t = pg.size() as i64;
    if vocab % t != 0 {
        return Err(Error::invalid(
            what.to_string(),
            format!("the vocabulary ({vocab}) is not divisible by the tensor-parallel size {t}"),
        ));
    }
    let per = vocab / t;
    Ok((pg.rank() as i64 * per, (pg.rank() as i64 + 1) * per))
}

/// `ids` outside `[start, end)`: a mask, and the ids shifted into the slice (0 where masked).
fn local_ids(ids: &Tensor, start: i64, end: i64) -> Result<(Tensor, Tensor)> {
    let outside = ids.f_lt(start)?.f_logical_or(&ids.f_ge(end)?)?;
    let local = ids.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
    Ok((outside, local))
}

/// An embedding table split by rows (tokens) across the group; its output (the full embedding of
/// every token) is the same on every rank.
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    /// `[V / t, d]`: this rank's rows.
    pub ws: Tensor,
    start: i64,
    end: i64,
    pg: Arc<ProcessGroup>,
}

impl VocabParallelEmbedding {
    /// `nn::embedding(path, vocab, dim, config)` split over `pg`: this rank's rows of the table that
    /// layer would draw. `padding_idx`, `sparse` and `scale_grad_by_freq` are not supported here.
    pub fn new(
        path: &nn::Path,
        vocab: i64,
        dim: i64,
        pg: Arc<ProcessGroup>,
        config: nn::EmbeddingConfig,
    ) -> Result<Self> {
        let what = "VocabParallelEmbedding";
        if config.padding_idx >= 0 || config.sparse || config.scale_grad_by_freq {
            return Err(Error::invalid(
                what,
                format!("padding_idx, sparse and scale_grad_by_freq are not supported (given {config:?})"),
            ));
        }
        let (start, end) = vocab_range(what, vocab, &pg)?;
        let part = super::init::Part { dim: 0, start, len: end - start };
        let ws = super::init::slice(what, config.ws_init, &[vocab, dim], part, (path.kind(), path.device()))?;
        Self::from_local(path, &ws, vocab, pg)
    }

    /// This rank's rows of `weight` (`[V, d]`), as the variable `weight` under `path`.
    pub fn from_full(path: &nn::Path, weight: &Tensor, pg: Arc<ProcessGroup>) -> Result<Self> {
        let (start, end) = vocab_range("VocabParallelEmbedding", weight.size()[0], &pg)?;
        Self::from_local(path, &weight.f_narrow(0, start, end - start)?.f_contiguous()?, weight.size()[0], pg)
    }

    fn from_local(path: &nn::Path, rows: &Tensor, vocab: i64, pg: Arc<ProcessGroup>) -> Result<Self> {
        let (start, end) = vocab_range("VocabParallelEmbedding", vocab, &pg)?;
        let ws = path.f_var_copy("weight", rows)?;
        let global: Vec<i64> = std::iter::once(vocab).chain(ws.size()[1..].iter().copied()).collect();
        let offsets: Vec<i64> = std::iter::once(start).chain(global[1..].iter().map(|_| 0)).collect();
        crate::placement::record_shard(&ws, &pg, 0, &global, &offsets, &ws.size())?;
        Ok(VocabParallelEmbedding { ws, start, end, pg })
    }

    /// The token ids this rank holds rows for: `[start, end)`.
    pub fn vocab_range(&self) -> (i64, i64) {
        (self.start, self.end)
    }

    /// The embeddings of `ids` (any shape, int64), `[..., d]`; errors returned.
    pub fn f_forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (outside, local) = local_ids(ids, self.start, self.end)?;
        // rows of other ranks' tokens are zeros here, their own rank's there: the allreduce joins them
        let e =
            Tensor::f_embedding(&self.ws, &local, -1, false, false)?.f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        reduce_from_parallel_region(&e, &self.pg)
    }
}

module!(VocabParallelEmbedding);

/// Per-token cross-entropy (`torch.nn.functional.cross_entropy(..., reduction="none")`) of logits split
/// over `pg` along the vocabulary: `logits` is this rank's slice `[..., V / t]` (rank r's is vocabulary
/// `[r·V/t, (r+1)·V/t)`), `targets` the full ids `[...]`. Returns the loss per token, the same on every
/// rank; its backward gives each rank the gradient of its own slice (softmax minus one-hot), with no
/// communication. Computed in float32 whatever the logits' dtype. Targets out of range are an error; on
/// CUDA, where reading them would make the host wait every forward, a device-side assert at the next
/// sync, as `cross_entropy`'s (fatal to the process's CUDA context).
pub fn vocab_parallel_cross_entropy(logits: &Tensor, targets: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let what = "vocab_parallel_cross_entropy";
    let size = logits.size();
    let per = *size.last().ok_or_else(|| Error::invalid(what, "logits must have a vocabulary dimension"))?;
    if targets.size() != size[..size.len() - 1] {
        return Err(Error::invalid(
            what,
            format!("targets {:?} do not match logits {:?} without their last dimension", targets.size(), size),
        ));
    }
    let vocab = per * pg.size() as i64;
    if targets.numel() > 0 && !matches!(targets.device(), tch::Device::Cuda(_)) {
        let (lo, hi) = (targets.f_min()?.f_int64_value(&[])?, targets.f_max()?.f_int64_value(&[])?);
        if lo < 0 || hi >= vocab {
            return Err(Error::invalid(what, format!("targets must be in [0, {vocab}), not [{lo}, {hi}]")));
        }
    } else if targets.numel() > 0 {
        // Reading the range would sync the host every forward. As `cross_entropy` on CUDA, an id out of
        // range fails as a device-side assert at the next sync: an index into a table of the vocabulary
        // (CUDA's index_select asserts index < size; negative ids are moved past the end)
        let ids = targets.f_flatten(0, -1)?;
        let ids = ids.f_masked_fill(&ids.f_lt(0)?, vocab)?;
        let _ = Tensor::f_empty([vocab], (Kind::Int8, targets.device()))?.f_index_select(0, &ids)?;
    }
    let (start, end) = vocab_range(what, vocab, pg)?;
    let z = logits.f_to_kind(Kind::Float)?;
    // the max only shifts the exponentials (its gradient cancels): taken without autograd
    let mut max = z.f_detach()?.f_amax([-1i64].as_slice(), true)?;
    pg.allreduce(&mut max, ReduceOp::Max)?;
    let shifted = z.f_sub(&max)?;
    let sum_exp =
        reduce_from_parallel_region(&shifted.f_exp()?.f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?, pg)?;
    let (outside, local) = local_ids(targets, start, end)?;
    let picked =
        shifted.f_gather(-1, &local.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?.f_masked_fill(&outside, 0.0)?;
    let target_logit = reduce_from_parallel_region(&picked, pg)?;
    Ok(sum_exp.f_log()?.f_sub(&target_logit)?)
}
