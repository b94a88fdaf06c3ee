//! Batch normalization whose training statistics are the whole group's (PyTorch's
//! `torch.nn.SyncBatchNorm`): for CNNs whose batch per rank is small. Built as tch's `nn::batch_norm*`
//! are, with the same variables (`weight`, `bias`, `running_mean`, `running_var`), so checkpoints
//! interchange with tch's layer.
//!
//! - **Training**: the mean and variance are over every rank's batch, weighted by each rank's count
//!   (ranks may hold different batch sizes, or none); the running statistics take the group's mean and
//!   unbiased variance, as PyTorch's. Backward sums each channel's `sum(dy)` and `sum(dy * (x - mean))`
//!   over the group; the weight's and bias's gradients stay this rank's, for DDP to average.
//! - **Evaluation** uses the running statistics, with no collective.
//! - **On the wire** it is PyTorch's protocol (an all_gather of `[mean, invstd, count]`, a list on Gloo,
//!   one tensor on NCCL; in backward, when the input needs a gradient, an allreduce of `[sum_dy,
//!   sum_dy_xmu]`), so a PyTorch rank and a tch-dist rank share a group (`tests/interop/sync_batch_norm.rs`).
//!   No value is read back to the host: an empty rank drops out by its count of zero.
//!
//! ```no_run
//! use tch::{nn, nn::ModuleT, Device};
//! use tch_dist::sync_batch_norm::sync_batch_norm2d;
//! let pg = std::sync::Arc::new(tch_dist::ProcessGroup::from_env()?);
//! let vs = nn::VarStore::new(Device::Cpu);
//! let bn = sync_batch_norm2d(vs.root() / "bn", 16, Default::default(), pg);
//! let y = tch::Tensor::randn([2, 16, 8, 8], (tch::Kind::Float, Device::Cpu)).apply_t(&bn, true);
//! # Ok::<(), tch_dist::Error>(())
//! ```
use std::borrow::Borrow;
use std::sync::Arc;

use tch::{nn, Tensor};

use crate::error::{Error, Result};
use crate::ffi::c10d::SyncBnTensors;
use crate::group::shim_op::{self, Collectives};
use crate::group::ProcessGroup;

/// A batch-normalization layer over `nd` spatial dimensions whose training statistics are `pg`'s.
#[derive(Debug)]
pub struct SyncBatchNorm {
    config: nn::BatchNormConfig,
    pub running_mean: Tensor,
    pub running_var: Tensor,
    pub ws: Option<Tensor>,
    pub bs: Option<Tensor>,
    pub nd: usize,
    pg: Arc<ProcessGroup>,
}

impl SyncBatchNorm {
    /// The layer's variables under `vs`, as tch's `nn::batch_norm*` creates them, its statistics over
    /// `pg` (PyTorch's `process_group=`; the world group, or DDP's, as a rule).
    pub fn new<'a, T: Borrow<nn::Path<'a>>>(
        vs: T,
        nd: usize,
        out_dim: i64,
        config: nn::BatchNormConfig,
        pg: Arc<ProcessGroup>,
    ) -> SyncBatchNorm {
        let vs = vs.borrow();
        let (ws, bs) = if config.affine {
            (Some(vs.var("weight", &[out_dim], config.ws_init)), Some(vs.var("bias", &[out_dim], config.bs_init)))
        } else {
            (None, None)
        };
        SyncBatchNorm {
            config,
            running_mean: vs.zeros_no_train("running_mean", &[out_dim]),
            running_var: vs.ones_no_train("running_var", &[out_dim]),
            ws,
            bs,
            nd,
            pg,
        }
    }

    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// The forward, errors returned (tch's `f_` convention): the group's statistics when `train`, the
    /// running ones otherwise.
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let dim = xs.dim();
        let fits = if self.nd == 1 { dim == 2 || dim == 3 } else { dim == self.nd + 2 };
        if !fits {
            let want = if self.nd == 1 { "2 or 3".to_string() } else { (self.nd + 2).to_string() };
            return Err(Error::invalid(
                "SyncBatchNorm",
                format!("a {}-d layer takes inputs of {want} dimensions, got {:?}", self.nd, xs.size()),
            ));
        }
        let c = self.running_mean.size()[0];
        if xs.size()[1] != c {
            return Err(Error::invalid(
                "SyncBatchNorm",
                format!("the layer has {c} channels, the input {:?} has {} in dimension 1", xs.size(), xs.size()[1]),
            ));
        }
        let cfg = &self.config;
        if !train || self.pg.size() == 1 {
            // PyTorch falls back to the plain layer when there is nothing to synchronise
            return Ok(xs.f_batch_norm(
                self.ws.as_ref(),
                self.bs.as_ref(),
                Some(&self.running_mean),
                Some(&self.running_var),
                train,
                cfg.momentum,
                cfg.eps,
                cfg.cudnn_enabled,
            )?);
        }
        let stats =
            if xs.kind() == tch::Kind::Half || xs.kind() == tch::Kind::BFloat16 { tch::Kind::Float } else { xs.kind() };
        let t = |k: i64| format!("{stats:?}[{k}] on {:?}", xs.device());
        let collectives = Collectives {
            forward: Some(format!("all_gather of {}", t(2 * c + 1))),
            backward: Some(format!("allreduce(Sum) of {}", t(2 * c))),
        };
        let p = SyncBnTensors {
            weight: self.ws.as_ref(),
            bias: self.bs.as_ref(),
            running_mean: &self.running_mean,
            running_var: &self.running_var,
        };
        shim_op::run(xs, &self.pg, "SyncBatchNorm", collectives, |engine, input| {
            engine.sync_batch_norm(input, p, cfg.eps, cfg.momentum)
        })
    }
}

impl nn::ModuleT for SyncBatchNorm {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Over `(N, C)` or `(N, C, L)` inputs, as tch's `nn::batch_norm1d`.
pub fn sync_batch_norm1d<'a, T: Borrow<nn::Path<'a>>>(
    vs: T,
    out_dim: i64,
    config: nn::BatchNormConfig,
    pg: Arc<ProcessGroup>,
) -> SyncBatchNorm {
    SyncBatchNorm::new(vs, 1, out_dim, config, pg)
}

/// Over `(N, C, H, W)` inputs, as tch's `nn::batch_norm2d`.
pub fn sync_batch_norm2d<'a, T: Borrow<nn::Path<'a>>>(
    vs: T,
    out_dim: i64,
    config: nn::BatchNormConfig,
    pg: Arc<ProcessGroup>,
) -> SyncBatchNorm {
    SyncBatchNorm::new(vs, 2, out_dim, config, pg)
}

/// Over `(N, C, D, H, W)` inputs, as tch's `nn::batch_norm3d`.
pub fn sync_batch_norm3d<'a, T: Borrow<nn::Path<'a>>>(
    vs: T,
    out_dim: i64,
    config: nn::BatchNormConfig,
    pg: Arc<ProcessGroup>,
) -> SyncBatchNorm {
    SyncBatchNorm::new(vs, 3, out_dim, config, pg)
}
