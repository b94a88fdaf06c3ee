//! Column- and row-parallel linear layers and the MLP made of them. Each rank keeps only its slice of the
//! weights: `new` draws it as tch's `nn::linear` would draw the whole layer (`tp/init.rs`), `from_full`
//! cuts it from given full matrices; either way the sharded layer computes what the full one does.
use std::sync::Arc;

use tch::{nn, Tensor};

use super::init::{self, Part};
use super::ops::{
    copy_to_parallel_region, gather_from_parallel_region, gather_from_sequence_parallel_region,
    reduce_from_parallel_region_owned, reduce_scatter_to_sequence_parallel_region, scatter_to_parallel_region,
};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// A [`ColumnParallelLinear`]'s configuration: tch's [`nn::LinearConfig`] (initialisation, bias) and
/// where its input and output live.
#[derive(Clone, Copy, Debug, Default)]
pub struct ColumnParallelConfig {
    /// As `nn::linear`'s (read by [`ColumnParallelLinear::new`]; `from_full` is given its values).
    pub linear: nn::LinearConfig,
    /// Gather the output features from every rank (default false: each keeps its own, for a
    /// row-parallel layer after it or a vocabulary-parallel loss).
    pub gather_output: bool,
    /// The input is this rank's part of the sequence (`[s / t, b, in]`, Megatron's sequence
    /// parallelism): gathered along the sequence on entry, reduce-scattered in backward.
    pub sequence_parallel: bool,
    /// The output features are this many equal blocks side by side, each split on its own (Megatron's
    /// layout of a fused projection): 3 for a fused QKV (queries, keys, values), 2 for SwiGLU's fused
    /// gate and up. Rank r holds its slice of every block, in block order, so `y.chunk(parts, -1)` gives
    /// its part of each. 0 (the default) and 1: one block. See [`crate::parallelize::Style::colwise_fused`].
    pub parts: usize,
}

impl ColumnParallelConfig {
    /// The number of blocks (0 read as 1).
    pub(crate) fn blocks(&self) -> i64 {
        self.parts.max(1) as i64
    }
}

/// This rank's rows of `out` output features made of `parts` equal blocks each split over `t` ranks:
/// `(start, len)` per block.
pub(crate) fn block_rows(out: i64, parts: i64, r: i64, t: i64) -> Vec<(i64, i64)> {
    let block = out / parts;
    (0..parts).map(|k| (k * block + r * (block / t), block / t)).collect()
}

/// A [`RowParallelLinear`]'s configuration, as [`ColumnParallelConfig`].
#[derive(Clone, Copy, Debug)]
pub struct RowParallelConfig {
    pub linear: nn::LinearConfig,
    /// The input arrives already split (default true: from a column-parallel layer); false splits it on
    /// entry.
    pub input_is_parallel: bool,
    /// The output is this rank's part of the sequence (`[s / t, b, out]`): the partial products are
    /// reduce-scattered along the sequence instead of allreduced (the bias added to the part).
    pub sequence_parallel: bool,
}

impl Default for RowParallelConfig {
    fn default() -> Self {
        RowParallelConfig { linear: Default::default(), input_is_parallel: true, sequence_parallel: false }
    }
}

/// The VarStore name prefix of `path` (`"block3.mlp.fc"`).
pub(crate) fn dotted(path: &nn::Path) -> String {
    path.components().collect::<Vec<_>>().join(".")
}

/// `n` split in `pg.size()` equal parts, or an error naming the layer.
fn divisible(what: &str, name: &str, n: i64, pg: &ProcessGroup) -> Result<()> {
    if n % pg.size() as i64 != 0 {
        return Err(Error::invalid(
            what.to_string(),
            format!("{name} {n} is not divisible by the tensor-parallel size {}", pg.size()),
        ));
    }
    Ok(())
}

/// tch's bias initialisation for a linear layer of `in_dim` inputs (`nn::linear`'s).
pub(crate) fn bias_init(c: &nn::LinearConfig, in_dim: i64) -> nn::Init {
    c.bs_init.unwrap_or_else(|| {
        let bound = 1.0 / (in_dim as f64).sqrt();
        nn::Init::Uniform { lo: -bound, up: bound }
    })
}

fn shard(what: &str, t: &Tensor, dim: i64, pg: &ProcessGroup) -> Result<Tensor> {
    let (n, parts) = (t.size()[dim as usize], pg.size() as i64);
    if n % parts != 0 {
        return Err(Error::invalid(
            what.to_string(),
            format!("dimension {dim} of {:?} ({n}) is not divisible by the tensor-parallel size {parts}", t.size()),
        ));
    }
    Ok(t.f_narrow(dim, pg.rank() as i64 * (n / parts), n / parts)?.f_contiguous()?)
}

/// `out` output features in `config.parts` blocks split over `pg`, or an error naming what does not
/// divide; a fused layer's output is not gathered (it would interleave the blocks rank by rank).
fn check_blocks(what: &str, out: i64, config: &ColumnParallelConfig, pg: &ProcessGroup) -> Result<()> {
    let (parts, t) = (config.blocks(), pg.size() as i64);
    if parts == 1 {
        return divisible(what, "out_dim", out, pg);
    }
    if out % (parts * t) != 0 {
        return Err(Error::invalid(
            what.to_string(),
            format!(
                "out_dim {out} is not {parts} equal blocks each divisible by the tensor-parallel size {t} \
                 (ColumnParallelConfig::parts = {parts})"
            ),
        ));
    }
    if config.gather_output {
        return Err(Error::invalid(
            what.to_string(),
            format!("gather_output with {parts} fused blocks: each rank's output holds its slice of every block"),
        ));
    }
    Ok(())
}

/// Records the variable `t` (this rank's rows of `parts` fused blocks, [`block_rows`]) as a slice along
/// dimension 1 of the layer viewed as `[parts, out / parts, ...]`: PyTorch's `in_proj_weight.view(3, d, d)`
/// for a fused QKV.
fn place_blocks(t: &Tensor, pg: &Arc<ProcessGroup>, parts: i64) -> Result<()> {
    let size = t.size();
    let lengths: Vec<i64> = [vec![parts, size[0] / parts], size[1..].to_vec()].concat();
    let mut global = lengths.clone();
    global[1] *= pg.size() as i64;
    let mut offsets = vec![0; lengths.len()];
    offsets[1] = pg.rank() as i64 * lengths[1];
    crate::placement::record_shard(t, pg, 1, &global, &offsets, &lengths)
}

/// Records the variable `t` as this rank's slice along `dim` of a tensor `pg.size()` times as long there
/// (in rank order), for the parts that read placements (clipping, checkpoints).
pub(crate) fn place_slice(t: &Tensor, pg: &Arc<ProcessGroup>, dim: usize) -> Result<()> {
    let local = t.size();
    let mut global = local.clone();
    let mut offsets = vec![0; local.len()];
    global[dim] *= pg.size() as i64;
    offsets[dim] = pg.rank() as i64 * local[dim];
    crate::placement::record_shard(t, pg, dim, &global, &offsets, &local)
}

/// `Y = X Aᵀ + b` with A split by rows (output features) across the group: rank r computes output
/// features `[r * out/t, (r+1) * out/t)`. Its input must be the full `X`.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    /// `[out / t, in]`
    pub ws: Tensor,
    /// `[out / t]`
    pub bs: Option<Tensor>,
    pub config: ColumnParallelConfig,
    pg: Arc<ProcessGroup>,
    /// Its VarStore path, for errors.
    name: String,
}

impl ColumnParallelLinear {
    /// `nn::linear(path, in_dim, out_dim, config.linear)` split over `pg`: this rank's rows of the weight
    /// and bias that layer would draw (`in_dim` inputs, `out_dim / t` outputs here).
    pub fn new(
        path: &nn::Path,
        in_dim: i64,
        out_dim: i64,
        pg: Arc<ProcessGroup>,
        config: ColumnParallelConfig,
    ) -> Result<Self> {
        let what = &format!("ColumnParallelLinear {}", dotted(path));
        check_blocks(what, out_dim, &config, &pg)?;
        let (opts, c) = ((path.kind(), path.device()), &config.linear);
        let mine = block_rows(out_dim, config.blocks(), pg.rank() as i64, pg.size() as i64);
        // in nn::linear's order: the bias, then the weight
        let bs = c.bias.then(|| init::rows(what, bias_init(c, in_dim), &[out_dim], &mine, opts)).transpose()?;
        let ws = init::rows(what, c.ws_init, &[out_dim, in_dim], &mine, opts)?;
        Self::from_local(path, &ws, bs.as_ref(), pg, config)
    }

    /// This rank's slice of `weight` (`[out, in]`) and `bias` (`[out]`), as variables under `path`.
    pub fn from_full(
        path: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        pg: Arc<ProcessGroup>,
        config: ColumnParallelConfig,
    ) -> Result<Self> {
        let what = "ColumnParallelLinear";
        if config.blocks() == 1 {
            let ws = shard(what, weight, 0, &pg)?;
            let bs = bias.map(|b| shard(what, b, 0, &pg)).transpose()?;
            return Self::from_local(path, &ws, bs.as_ref(), pg, config);
        }
        check_blocks(what, weight.size()[0], &config, &pg)?;
        let mine = block_rows(weight.size()[0], config.blocks(), pg.rank() as i64, pg.size() as i64);
        // only this rank's rows are copied, never a reordered full matrix
        let take = |x: &Tensor| -> Result<Tensor> {
            let parts = mine.iter().map(|&(a, n)| x.f_narrow(0, a, n)).collect::<std::result::Result<Vec<_>, _>>()?;
            Ok(Tensor::f_cat(&parts, 0)?)
        };
        let bs = bias.map(take).transpose()?;
        Self::from_local(path, &take(weight)?, bs.as_ref(), pg, config)
    }

    /// From this rank's slices as they are (`[out / t, in]`, `[out / t]`).
    pub(crate) fn from_local(
        path: &nn::Path,
        ws: &Tensor,
        bs: Option<&Tensor>,
        pg: Arc<ProcessGroup>,
        config: ColumnParallelConfig,
    ) -> Result<Self> {
        check_blocks("ColumnParallelLinear", ws.size()[0] * pg.size() as i64, &config, &pg)?;
        let bs = bs.map(|b| path.f_var_copy("bias", b)).transpose()?;
        let ws = path.f_var_copy("weight", ws)?;
        for t in std::iter::once(&ws).chain(bs.as_ref()) {
            match config.blocks() {
                1 => place_slice(t, &pg, 0)?,
                parts => place_blocks(t, &pg, parts)?,
            }
        }
        Ok(ColumnParallelLinear { ws, bs, config, pg, name: dotted(path) })
    }

    /// Output features of this rank (all of them with `gather_output`); errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.config.sequence_parallel {
            gather_from_sequence_parallel_region(x, &self.pg)?
        } else {
            copy_to_parallel_region(x, &self.pg)?
        };
        let features = self.ws.size()[1];
        if x.size().last() != Some(&features) {
            return Err(Error::invalid(
                format!("{} (column-wise over {} ranks)", self.name, self.pg.size()),
                format!("input {:?}: its last dimension must be the layer's {features} input features", x.size()),
            ));
        }
        let y = x.f_linear(&self.ws, self.bs.as_ref())?;
        if self.config.gather_output {
            gather_from_parallel_region(&y, &self.pg)
        } else {
            Ok(y)
        }
    }
}

/// `Y = X Aᵀ + b` with A split by columns (input features): rank r multiplies its slice of X's last
/// dimension by its columns of A; the partial products are summed by an allreduce; `b` is replicated.
#[derive(Debug)]
pub struct RowParallelLinear {
    /// `[out, in / t]`
    pub ws: Tensor,
    /// `[out]`, the same on every rank
    pub bs: Option<Tensor>,
    pub config: RowParallelConfig,
    pg: Arc<ProcessGroup>,
    /// Its VarStore path, for errors.
    name: String,
}

impl RowParallelLinear {
    /// `nn::linear(path, in_dim, out_dim, config.linear)` split over `pg`: this rank's columns of the
    /// weight that layer would draw (`in_dim / t` inputs here), and its whole bias.
    pub fn new(
        path: &nn::Path,
        in_dim: i64,
        out_dim: i64,
        pg: Arc<ProcessGroup>,
        config: RowParallelConfig,
    ) -> Result<Self> {
        let what = &format!("RowParallelLinear {}", dotted(path));
        divisible(what, "in_dim", in_dim, &pg)?;
        let (rank, t, opts) = (pg.rank(), pg.size(), (path.kind(), path.device()));
        let c = &config.linear;
        let whole = Part { dim: 0, start: 0, len: out_dim };
        let bs = c.bias.then(|| init::slice(what, bias_init(c, in_dim), &[out_dim], whole, opts)).transpose()?;
        let ws = init::slice(what, c.ws_init, &[out_dim, in_dim], Part::even(1, in_dim, rank, t), opts)?;
        Self::from_local(path, &ws, bs.as_ref(), pg, config)
    }

    /// This rank's columns of `weight` (`[out, in]`) and all of `bias` (`[out]`), as variables under
    /// `path`.
    pub fn from_full(
        path: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        pg: Arc<ProcessGroup>,
        config: RowParallelConfig,
    ) -> Result<Self> {
        let ws = shard("RowParallelLinear", weight, 1, &pg)?;
        Self::from_local(path, &ws, bias, pg, config)
    }

    pub(crate) fn from_local(
        path: &nn::Path,
        ws: &Tensor,
        bs: Option<&Tensor>,
        pg: Arc<ProcessGroup>,
        config: RowParallelConfig,
    ) -> Result<Self> {
        let bs = bs.map(|b| path.f_var_copy("bias", b)).transpose()?;
        let ws = path.f_var_copy("weight", ws)?;
        place_slice(&ws, &pg, 1)?;
        if let Some(b) = &bs {
            crate::placement::record_along(b, &pg, crate::placement::Placement::Replicate)?;
        }
        Ok(RowParallelLinear { ws, bs, config, pg, name: dotted(path) })
    }

    /// The layer's output (the same on every rank); errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        let (mine, t) = (self.ws.size()[1], self.pg.size() as i64);
        let want = if self.config.input_is_parallel { mine } else { mine * t };
        if x.size().last() != Some(&want) {
            let expected = if self.config.input_is_parallel {
                format!(
                    "this rank's {mine} of the layer's {} input features (the output of a column-wise layer \
                     before it; a whole input needs input_is_parallel: false)",
                    mine * t
                )
            } else {
                format!("the layer's {want} input features")
            };
            return Err(Error::invalid(
                format!("{} (row-wise over {t} ranks)", self.name),
                format!("input {:?}: its last dimension must be {expected}", x.size()),
            ));
        }
        let x =
            if self.config.input_is_parallel { x.shallow_clone() } else { scatter_to_parallel_region(x, &self.pg)? };
        let partial = x.f_linear::<&Tensor>(&self.ws, None)?;
        let mut y = if self.config.sequence_parallel {
            reduce_scatter_to_sequence_parallel_region(&partial, &self.pg)?
        } else {
            // the partial product is ours alone (a linear does not save its output): summed in place
            reduce_from_parallel_region_owned(&partial, &self.pg)?
        };
        if let Some(b) = &self.bs {
            // in place too (no backward saves the sum), so the output costs one buffer, not two
            let _ = y.f_add_(b)?;
        }
        Ok(y)
    }
}

/// Megatron's MLP: column-parallel `d → h`, GELU, row-parallel `h → d`. One allreduce forward (after
/// the second layer) and one backward (before the first).
#[derive(Debug)]
pub struct ParallelMlp {
    pub fc1: ColumnParallelLinear,
    pub fc2: RowParallelLinear,
}

impl ParallelMlp {
    /// From the full layers' weights (`w1: [h, d]`, `w2: [d, h]`), sliced for this rank.
    pub fn from_full(
        path: &nn::Path,
        w1: &Tensor,
        b1: &Tensor,
        w2: &Tensor,
        b2: &Tensor,
        pg: Arc<ProcessGroup>,
    ) -> Result<Self> {
        Ok(ParallelMlp {
            fc1: ColumnParallelLinear::from_full(&(path / "fc1"), w1, Some(b1), pg.clone(), Default::default())?,
            fc2: RowParallelLinear::from_full(&(path / "fc2"), w2, Some(b2), pg, Default::default())?,
        })
    }

    /// `fc1 = nn::linear(path / "fc1", d_model, hidden)` and `fc2 = nn::linear(path / "fc2", hidden,
    /// d_model)`, split over `pg`: the values those layers would draw from the global generator, which
    /// ends where they would leave it.
    pub fn new(path: &nn::Path, d_model: i64, hidden: i64, pg: Arc<ProcessGroup>) -> Result<Self> {
        Ok(ParallelMlp {
            fc1: ColumnParallelLinear::new(&(path / "fc1"), d_model, hidden, pg.clone(), Default::default())?,
            fc2: RowParallelLinear::new(&(path / "fc2"), hidden, d_model, pg, Default::default())?,
        })
    }

    /// The MLP's output (the same on every rank); errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.f_forward(x)?.f_gelu("none")?;
        self.fc2.f_forward(&h)
    }
}

module!(ColumnParallelLinear);
module!(RowParallelLinear);
module!(ParallelMlp);
