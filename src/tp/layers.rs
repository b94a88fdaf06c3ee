//! Column- and row-parallel linear layers and the MLP made of them. Each rank keeps only its slice of the
//! weights, cut from the same full matrix, so the sharded layer computes exactly what the full one does.
use std::sync::Arc;

use tch::{nn, Kind, Tensor};

use super::ops::{
    copy_to_parallel_region, gather_from_parallel_region, gather_from_sequence_parallel_region,
    reduce_from_parallel_region_owned, reduce_scatter_to_sequence_parallel_region, scatter_to_parallel_region,
};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

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
    pub gather_output: bool,
    /// The input is this rank's part of the sequence (`[s / t, b, in]`, Megatron's sequence
    /// parallelism): gathered along the sequence on entry, reduce-scattered in backward.
    pub sequence_parallel: bool,
    pg: Arc<ProcessGroup>,
}

impl ColumnParallelLinear {
    /// This rank's slice of `weight` (`[out, in]`) and `bias` (`[out]`), as variables under `path`.
    pub fn from_full(
        path: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        pg: Arc<ProcessGroup>,
        gather_output: bool,
    ) -> Result<Self> {
        let what = "ColumnParallelLinear";
        let ws = shard(what, weight, 0, &pg)?;
        let bs = bias.map(|b| shard(what, b, 0, &pg)).transpose()?;
        Self::from_local(path, &ws, bs.as_ref(), pg, gather_output)
    }

    /// From this rank's slices as they are (`[out / t, in]`, `[out / t]`).
    pub(crate) fn from_local(
        path: &nn::Path,
        ws: &Tensor,
        bs: Option<&Tensor>,
        pg: Arc<ProcessGroup>,
        gather_output: bool,
    ) -> Result<Self> {
        let ws = path.f_var_copy("weight", ws)?;
        let bs = bs.map(|b| path.f_var_copy("bias", b)).transpose()?;
        for t in std::iter::once(&ws).chain(bs.as_ref()) {
            place_slice(t, &pg, 0)?;
        }
        Ok(ColumnParallelLinear { ws, bs, gather_output, sequence_parallel: false, pg })
    }

    /// Takes sequence-parallel input (see [`sequence_parallel`](Self::sequence_parallel)).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Output features of this rank (all of them with `gather_output`); errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.sequence_parallel {
            gather_from_sequence_parallel_region(x, &self.pg)?
        } else {
            copy_to_parallel_region(x, &self.pg)?
        };
        let y = x.f_linear(&self.ws, self.bs.as_ref())?;
        if self.gather_output {
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
    /// The input arrives already split (from a column-parallel layer); otherwise it is split on entry.
    pub input_is_parallel: bool,
    /// The output is this rank's part of the sequence (`[s / t, b, out]`): the partial products are
    /// reduce-scattered along the sequence instead of allreduced (the bias added to the part).
    pub sequence_parallel: bool,
    pg: Arc<ProcessGroup>,
}

impl RowParallelLinear {
    pub fn from_full(
        path: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        pg: Arc<ProcessGroup>,
        input_is_parallel: bool,
    ) -> Result<Self> {
        let ws = path.f_var_copy("weight", &shard("RowParallelLinear", weight, 1, &pg)?)?;
        let bs = bias.map(|b| path.f_var_copy("bias", b)).transpose()?;
        place_slice(&ws, &pg, 1)?;
        if let Some(b) = &bs {
            crate::placement::record_along(b, &pg, crate::placement::Placement::Replicate)?;
        }
        Ok(RowParallelLinear { ws, bs, input_is_parallel, sequence_parallel: false, pg })
    }

    /// Gives sequence-parallel output (see [`sequence_parallel`](Self::sequence_parallel)).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// The layer's output (the same on every rank); errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.input_is_parallel { x.shallow_clone() } else { scatter_to_parallel_region(x, &self.pg)? };
        let partial = x.f_linear::<&Tensor>(&self.ws, None)?;
        let mut y = if self.sequence_parallel {
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
            fc1: ColumnParallelLinear::from_full(&(path / "fc1"), w1, Some(b1), pg.clone(), false)?,
            fc2: RowParallelLinear::from_full(&(path / "fc2"), w2, Some(b2), pg, true)?,
        })
    }

    /// Initialised as `nn::linear` would be after `tch::manual_seed(seed)`: every rank draws the same full
    /// matrices (on the CPU, from a generator of its own: the global one is left alone) and keeps its
    /// slices.
    pub fn new(path: &nn::Path, d_model: i64, hidden: i64, pg: Arc<ProcessGroup>, seed: i64) -> Result<Self> {
        let bound = |fan_in: i64| 1.0 / (fan_in as f64).sqrt();
        let draws = [
            (vec![hidden, d_model], bound(d_model)),
            (vec![hidden], bound(d_model)),
            (vec![d_model, hidden], bound(hidden)),
            (vec![d_model], bound(hidden)),
        ];
        let [w1, b1, w2, b2]: [Tensor; 4] = crate::random::uniform_seq(seed as u64, Kind::Float, &draws)?
            .try_into()
            .map_err(|_| Error::invalid("ParallelMlp::new", "expected four initial tensors"))?;
        let dev = path.device();
        Self::from_full(path, &w1.to_device(dev), &b1.to_device(dev), &w2.to_device(dev), &b2.to_device(dev), pg)
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
