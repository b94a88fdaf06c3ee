//! Context parallelism (torchtitan's `context_parallel_degree`): long sequences split along the
//! sequence over the ranks of a context-parallel group, attention run as ring attention across them.
//!
//! Everything but attention works token by token, so each rank runs the model on its part of every
//! sequence ([`ContextParallel::shard`] the inputs, the targets and the position embeddings alike), and
//! attention passes keys and values around the ring ([`ContextParallel::attention`], in place of
//! `scaled_dot_product_attention`). The parameters stay replicated: each rank's gradients are of its own
//! tokens' loss, averaged over the group as data parallelism's are (DDP or FSDP over a group that spans
//! the context-parallel ranks, as torchtitan's `dp_shard_cp`).
//!
//! With load balancing (the default, for causal masks) the sequence is cut into `2c` chunks and rank
//! `i` holds chunks `i` and `2c-1-i`, as PyTorch's head-tail load balancer lays it out.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tch::{Device, Kind, Tensor};
//! use tch_dist::context_parallel::{ContextParallel, RingAttentionConfig};
//! let cp = ContextParallel::new(Arc::new(tch_dist::ProcessGroup::from_env()?), Default::default());
//! let x = Tensor::randn([2, 4, 1024, 64], (Kind::Float, Device::Cpu)); // the whole sequence
//! let q = cp.shard(&x, 2)?;                                           // this rank's 1024 / c tokens
//! let y = cp.attention(&q, &q, &q, RingAttentionConfig { causal: true, ..Default::default() })?;
//! let whole = cp.unshard(&y, 2)?;                                     // for inspection, not training
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod layout;
pub(crate) mod ring;

use std::sync::Arc;

use tch::Tensor;

use crate::error::Result;
use crate::group::ProcessGroup;
use layout::Chunks;

/// How sequences are laid out over the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextParallelConfig {
    /// Head-tail chunks (rank `i` holds chunks `i` and `2c-1-i` of `2c`), so that causal attention costs
    /// every rank the same; else rank `i` holds the `i`-th of `c` contiguous chunks.
    pub load_balance: bool,
}

impl Default for ContextParallelConfig {
    fn default() -> Self {
        ContextParallelConfig { load_balance: true }
    }
}

/// One ring attention call's settings.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RingAttentionConfig {
    /// Mask the future (a decoder's attention), by global token positions.
    pub causal: bool,
    /// The scores' scale; `1/sqrt(head_dim)` when `None`, as `scaled_dot_product_attention`'s.
    pub scale: Option<f64>,
}

/// A context-parallel group and its sequence layout.
#[derive(Debug, Clone)]
pub struct ContextParallel {
    pg: Arc<ProcessGroup>,
    cfg: ContextParallelConfig,
}

impl ContextParallel {
    pub fn new(pg: Arc<ProcessGroup>, cfg: ContextParallelConfig) -> ContextParallel {
        ContextParallel { pg, cfg }
    }

    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    pub fn config(&self) -> ContextParallelConfig {
        self.cfg
    }

    fn chunks(&self, rank: usize) -> Chunks {
        Chunks::of(rank, self.pg.size(), self.cfg.load_balance)
    }

    /// This rank's part of `x`, whose dimension `dim` is the whole sequence (its length divisible by
    /// `2c` with load balancing, else by `c`): differentiable, no communication. Inputs, targets and
    /// position embeddings go through it alike.
    pub fn shard(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        layout::shard("ContextParallel::shard", x, dim, &self.chunks(self.pg.rank()))
    }

    /// The global positions of this rank's tokens of a sequence of `seq` tokens, in local order.
    pub fn positions(&self, seq: i64) -> Result<Vec<i64>> {
        let all = Tensor::f_arange(seq, (tch::Kind::Int64, tch::Device::Cpu))?;
        Ok(Vec::<i64>::try_from(&self.shard(&all, 0)?)?)
    }

    /// The whole sequence along `dim` from every rank's part (an all-gather, then the chunks in global
    /// order): for results and tests, outside autograd. Every rank of the group calls it.
    pub fn unshard(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        let what = "ContextParallel::unshard";
        let x = x.f_detach()?.f_contiguous()?;
        let mut parts: Vec<Tensor> =
            (0..self.pg.size()).map(|_| x.f_empty_like()).collect::<std::result::Result<_, _>>()?;
        self.pg.all_gather(&mut parts, &x)?;
        layout::unshard(what, &parts, dim, self.pg.size(), self.cfg.load_balance)
    }

    /// Ring attention (see the module docs): `q`, `k`, `v` are `[batch, heads, local
    /// seq, head_dim]`, this rank's tokens as [`shard`](Self::shard) gives them; the result is this
    /// rank's rows of softmax attention over the whole sequence, differentiable. Every rank of the group
    /// calls it with the same shapes.
    pub fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cfg: RingAttentionConfig) -> Result<Tensor> {
        let scale = cfg.scale.unwrap_or(1.0 / (q.size().last().copied().unwrap_or(1).max(1) as f64).sqrt());
        let ring = ring::Ring { pg: self.pg.clone(), load_balance: self.cfg.load_balance, causal: cfg.causal, scale };
        ring::attention(ring, q, k, v)
    }
}
