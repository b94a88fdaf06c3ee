//! tch's `nn`, with the layers a [`Plan`](crate::parallelize::Plan) can split or synchronise in place of
//! tch's own: `use tch_dist::nn;` where the model said `use tch::nn;`, and its `nn::linear`,
//! `nn::embedding` and `nn::batch_norm*d` calls, and its fields typed `nn::Linear` or `nn::Embedding`,
//! stay as they are. [`unit()`] adds the one thing tch's `nn` has no word for: a block FSDP shards as one.
//! A model that reads a layer's `ws` field (an output head tied to the embedding) calls `ws()`, which
//! gives the part this rank holds.
//!
//! Outside a plan (or under one that does not split the layer) each layer is tch's, with the same
//! variables, names and values after the same seed; inside [`Plan::build`](crate::parallelize::Plan::build)
//! it is the layer the plan's styles ask for (a column- or row-parallel linear, a vocabulary-parallel
//! embedding, a synchronised batch norm). Everything else is tch's `nn`, re-exported. As in tch, these
//! functions panic on error (an error naming the layer's path, such as a fused projection given a plain
//! column-wise split); their `f_` twins return it.
//!
//! ```no_run
//! use tch_dist::nn::{self, Module, OptimizerConfig}; // was: use tch::nn::{self, Module, OptimizerConfig};
//! use tch_dist::prelude::*;
//!
//! #[derive(Debug)]
//! struct Mlp {
//!     fc: nn::Linear, // tch's layer in one process, this rank's part under tensor parallelism
//!     proj: nn::Linear,
//! }
//!
//! impl Mlp {
//!     fn new(p: nn::Path, dim: i64) -> Mlp {
//!         Mlp { fc: nn::linear(&p / "fc", dim, 4 * dim, Default::default()), proj: nn::linear(&p / "proj", 4 * dim, dim, Default::default()) }
//!     }
//! }
//!
//! impl Module for Mlp {
//!     fn forward(&self, xs: &tch::Tensor) -> tch::Tensor {
//!         xs.apply(&self.fc).gelu("none").apply(&self.proj)
//!     }
//! }
//!
//! let world = ProcessGroup::from_env()?;
//! let dims = ParallelDims { tp: world.size(), ..Default::default() }.build(&world)?;
//! let vs = nn::VarStore::new(world.device());
//! let plan = dims.plan().style("*.fc", Style::colwise()).style("*.proj", Style::rowwise());
//! let model = plan.build(&vs, || Mlp::new(vs.root() / "mlp", 64))?;
//! let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
use std::borrow::Borrow;

#[doc(no_inline)]
pub use tch::nn::*;

use crate::error::Result;
use crate::parallelize;
pub use crate::parallelize::{BatchNorm, Embedding, Linear, Unit};

/// tch's `nn::linear`, or its split form under the entered plan's style for this path.
pub fn f_linear<'a, T: Borrow<Path<'a>>>(vs: T, in_dim: i64, out_dim: i64, c: LinearConfig) -> Result<Linear> {
    parallelize::linear(vs.borrow(), in_dim, out_dim, c)
}

/// [`f_linear`], panicking on error as tch's `nn::linear` does.
#[track_caller]
pub fn linear<'a, T: Borrow<Path<'a>>>(vs: T, in_dim: i64, out_dim: i64, c: LinearConfig) -> Linear {
    match f_linear(vs, in_dim, out_dim, c) {
        Ok(layer) => layer,
        Err(e) => panic!("{e}"),
    }
}

/// tch's `nn::embedding`, or its vocabulary-parallel form under the entered plan's style for this path.
pub fn f_embedding<'a, T: Borrow<Path<'a>>>(vs: T, num: i64, dim: i64, c: EmbeddingConfig) -> Result<Embedding> {
    parallelize::embedding(vs.borrow(), num, dim, c)
}

/// [`f_embedding`], panicking on error as tch's `nn::embedding` does.
#[track_caller]
pub fn embedding<'a, T: Borrow<Path<'a>>>(vs: T, num: i64, dim: i64, c: EmbeddingConfig) -> Embedding {
    match f_embedding(vs, num, dim, c) {
        Ok(layer) => layer,
        Err(e) => panic!("{e}"),
    }
}

/// tch's `nn::batch_norm1d`, or its synchronised form under the entered plan's `sync_batch_norm`.
pub fn f_batch_norm1d<'a, T: Borrow<Path<'a>>>(vs: T, out_dim: i64, c: BatchNormConfig) -> Result<BatchNorm> {
    parallelize::batch_norm1d(vs.borrow(), out_dim, c)
}

/// [`f_batch_norm1d`], panicking on error as tch's `nn::batch_norm1d` does.
#[track_caller]
pub fn batch_norm1d<'a, T: Borrow<Path<'a>>>(vs: T, out_dim: i64, c: BatchNormConfig) -> BatchNorm {
    match f_batch_norm1d(vs, out_dim, c) {
        Ok(layer) => layer,
        Err(e) => panic!("{e}"),
    }
}

/// tch's `nn::batch_norm2d`, or its synchronised form under the entered plan's `sync_batch_norm`.
pub fn f_batch_norm2d<'a, T: Borrow<Path<'a>>>(vs: T, out_dim: i64, c: BatchNormConfig) -> Result<BatchNorm> {
    parallelize::batch_norm2d(vs.borrow(), out_dim, c)
}

/// [`f_batch_norm2d`], panicking on error as tch's `nn::batch_norm2d` does.
#[track_caller]
pub fn batch_norm2d<'a, T: Borrow<Path<'a>>>(vs: T, out_dim: i64, c: BatchNormConfig) -> BatchNorm {
    match f_batch_norm2d(vs, out_dim, c) {
        Ok(layer) => layer,
        Err(e) => panic!("{e}"),
    }
}

/// tch's `nn::batch_norm3d`, or its synchronised form under the entered plan's `sync_batch_norm`.
pub fn f_batch_norm3d<'a, T: Borrow<Path<'a>>>(vs: T, out_dim: i64, c: BatchNormConfig) -> Result<BatchNorm> {
    parallelize::batch_norm3d(vs.borrow(), out_dim, c)
}

/// [`f_batch_norm3d`], panicking on error as tch's `nn::batch_norm3d` does.
#[track_caller]
pub fn batch_norm3d<'a, T: Borrow<Path<'a>>>(vs: T, out_dim: i64, c: BatchNormConfig) -> BatchNorm {
    match f_batch_norm3d(vs, out_dim, c) {
        Ok(layer) => layer,
        Err(e) => panic!("{e}"),
    }
}

/// A block of the model (a transformer block) built at `vs`: an FSDP unit of its variables under a plan
/// that shards, else the block itself ([`Plan::unit`](crate::parallelize::Plan::unit)).
pub fn f_unit<'a, T: Borrow<Path<'a>>, M>(vs: T, block: M) -> Result<Unit<M>> {
    parallelize::unit(vs.borrow(), block)
}

/// [`f_unit`], panicking on error as tch's `nn` functions do.
#[track_caller]
pub fn unit<'a, T: Borrow<Path<'a>>, M>(vs: T, block: M) -> Unit<M> {
    match f_unit(vs, block) {
        Ok(layer) => layer,
        Err(e) => panic!("{e}"),
    }
}
