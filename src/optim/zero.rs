//! ZeRO stage 1 (as PyTorch's `ZeroRedundancyOptimizer`, but over one flat buffer): the parameters are
//! viewed as one flat vector (per dtype), cut into `world` contiguous shards; each rank keeps optimizer
//! state for its shard only, steps it with the (already reduced) gradients, and the updated shards are
//! all-gathered back into every rank's parameters. Optimizer memory per rank falls by the world size.
use std::sync::Arc;

use tch::Tensor;

use super::Optimizer;
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::hooks;

/// Wraps an optimizer built over this rank's shard (see [`ShardedOptimizer::new`]).
pub struct ShardedOptimizer {
    params: Vec<Tensor>,
    pg: Arc<ProcessGroup>,
    numel: i64,
    shard_len: i64,
    /// This rank's slice of the flat parameters: the tensor the inner optimizer updates.
    shard: Tensor,
    inner: Box<dyn Optimizer + Send>,
}

impl ShardedOptimizer {
    /// `make` builds the inner optimizer over the one shard tensor it is given, e.g.
    /// `|p| Box::new(AdamW::new(p, 1e-3))`. All parameters must share one dtype and device.
    pub fn new(
        params: Vec<Tensor>,
        pg: Arc<ProcessGroup>,
        make: impl FnOnce(Vec<Tensor>) -> Box<dyn Optimizer + Send>,
    ) -> Result<ShardedOptimizer> {
        let first = params.first().ok_or_else(|| Error::invalid("ShardedOptimizer", "no parameters"))?;
        let (kind, device) = (first.kind(), first.device());
        if let Some(p) = params.iter().find(|p| p.kind() != kind || p.device() != device) {
            return Err(Error::invalid(
                "ShardedOptimizer",
                format!("parameters mix {kind:?} on {device:?} with {:?} on {:?}; shard each group separately", p.kind(), p.device()),
            ));
        }
        let numel: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let world = pg.size() as i64;
        let shard_len = (numel + world - 1) / world;
        let flat = Self::flatten(&params, numel, shard_len * world, |p| p.shallow_clone())?;
        let shard = flat.f_narrow(0, pg.rank() as i64 * shard_len, shard_len)?.f_detach_copy()?.set_requires_grad(true);
        let inner = make(vec![shard.shallow_clone()]);
        Ok(ShardedOptimizer { params, pg, numel, shard_len, shard, inner })
    }

    fn flatten(params: &[Tensor], numel: i64, padded: i64, pick: impl Fn(&Tensor) -> Tensor) -> Result<Tensor> {
        let mut parts: Vec<Tensor> = params.iter().map(|p| pick(p).f_reshape([-1])).collect::<std::result::Result<_, _>>()?;
        if padded > numel {
            parts.push(Tensor::f_zeros([padded - numel], (params[0].kind(), params[0].device()))?);
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    }

    /// Elements of optimizer-visible parameters on this rank (its shard).
    pub fn shard_numel(&self) -> i64 {
        self.shard_len
    }
}

impl Optimizer for ShardedOptimizer {
    fn step(&mut self) -> Result<()> {
        let _g = tch::no_grad_guard();
        let (world, rank) = (self.pg.size() as i64, self.pg.rank() as i64);
        // this rank's slice of the (reduced) gradients; missing ones count as zero
        let grads = Self::flatten(&self.params, self.numel, self.shard_len * world, |p| {
            let g = p.grad();
            if g.defined() { g } else { p.zeros_like() }
        })?;
        let gshard = grads.f_narrow(0, rank * self.shard_len, self.shard_len)?.f_contiguous()?;
        hooks::set_grad(&self.shard, Some(&gshard))?;
        self.inner.step()?;
        // everyone's updated shard, back into the parameters
        let mut outs: Vec<Tensor> = (0..world).map(|_| self.shard.zeros_like()).collect();
        self.pg.all_gather(&mut outs, &self.shard.detach())?;
        let flat = Tensor::f_cat(&outs, 0)?;
        let mut off = 0i64;
        for p in &self.params {
            let n = p.numel() as i64;
            p.shallow_clone().f_copy_(&flat.f_narrow(0, off, n)?.f_view(p.size().as_slice())?)?;
            off += n;
        }
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        hooks::zero_grads(&self.params)
    }

    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut s = self.inner.state_dict();
        s.push(("zero.shard".to_string(), self.shard.detach()));
        s
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let saved = super::find(state, "zero.shard", &self.shard)?;
        self.shard.shallow_clone().detach().f_copy_(saved)?;
        self.inner.load_state_dict(state)
    }
}
