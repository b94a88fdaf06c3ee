//! Uneven inputs: PyTorch's `Join` context manager for DDP. A rank whose data runs out "joins": until every
//! rank has, it shadows the others' iterations, taking part in each collective of their forward and
//! backward with zeros, so nobody hangs and the others' gradients are still averaged. When all have
//! joined, the model of the last rank to finish is copied to every rank.
//!
//! The collectives, their order, dtypes and devices are PyTorch's (`Join.notify_join_context`,
//! `_DDPJoinHook`), so a joined rank shadows PyTorch DDP ranks too.
//!
//! ```no_run
//! use tch_dist::prelude::*;
//! # use tch::nn::Module;
//! # let (ddp, batches): (tch_dist::ddp::DistributedDataParallel<tch::nn::Sequential>, Vec<(tch::Tensor, tch::Tensor)>) = todo!();
//! # let mut opt: tch::nn::Optimizer = todo!();
//! use tch_dist::ddp::JoinOptions;
//! ddp.join(JoinOptions::default(), || {
//!     for (x, y) in &batches {            // as many batches as this rank has
//!         let loss = ddp.forward(x).mse_loss(y, tch::Reduction::Mean);
//!         opt.zero_grad();
//!         ddp.backward(&loss)?;
//!         opt.step();
//!     }
//!     Ok(())
//! })?;
//! # Ok::<(), tch_dist::Error>(())
//! ```
//!
//! Inside `join`, DDP's forward runs PyTorch's protocol instead of tch-dist's own loop check. Collectives
//! of your own in the loop (a logged loss allreduced, a `GradScaler` with a process group, ZeRO's
//! gathers) are not shadowed: keep them out of the loop, or use `throw_on_early_termination`.
use super::DistributedDataParallel;
use crate::error::{Error, Result};
use crate::group::{ProcessGroup, ReduceOp};

/// Options of [`DistributedDataParallel::join`], as PyTorch's `ddp.join(...)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinOptions {
    /// Divide gradients by the world size even when some ranks have joined (their zeros count), as
    /// PyTorch does by default; `false` divides by the ranks still training.
    pub divide_by_initial_world_size: bool,
    /// Instead of shadowing, fail on every rank as soon as one runs out of inputs.
    pub throw_on_early_termination: bool,
}

impl Default for JoinOptions {
    fn default() -> Self {
        JoinOptions { divide_by_initial_world_size: true, throw_on_early_termination: false }
    }
}

impl JoinOptions {
    pub fn divide_by_initial_world_size(mut self, on: bool) -> Self {
        self.divide_by_initial_world_size = on;
        self
    }
    pub fn throw_on_early_termination(mut self, on: bool) -> Self {
        self.throw_on_early_termination = on;
        self
    }
}

pub(crate) fn exhausted(pg: &ProcessGroup, why: &str) -> Error {
    Error::UnevenInputs {
        op: format!("DDP join on {} of {}", pg.who(pg.rank()), pg.size()),
        msg: format!("{why} (throw_on_early_termination)"),
    }
}

/// The highest rank for which `candidate` holds (PyTorch's `_find_common_rank`).
pub(crate) fn common_rank<M>(ddp: &DistributedDataParallel<M>, candidate: bool) -> Result<usize> {
    let pg = ddp.pg();
    let mine = if candidate { pg.rank() as i64 } else { -1 };
    let r = pg.meta_as_pytorch(ddp.device()).allreduce("DDP join: authoritative rank", &[mine], ReduceOp::Max)?[0];
    usize::try_from(r).map_err(|_| Error::invalid("DDP join", "no rank qualified as the authoritative copy"))
}

impl<M> DistributedDataParallel<M> {
    /// Runs `train` (this rank's training loop) so that ranks with fewer batches than others neither
    /// hang nor fail: see the [module docs](self). Every rank calls it. Returns `train`'s result once
    /// all ranks are done and hold the same model.
    pub fn join<R>(&self, opts: JoinOptions, train: impl FnOnce() -> Result<R>) -> Result<R> {
        if self.reducer.join_options().is_some() {
            return Err(Error::invalid("DDP join", "already inside join"));
        }
        self.reducer.set_join(Some(opts));
        let out = train().and_then(|r| self.shadow_until_all_joined(&opts).map(|()| r));
        self.reducer.set_join(None);
        out
    }

    /// PyTorch's `Join.__exit__` with `_DDPJoinHook`: shadow every iteration of the ranks still training,
    /// then copy the model of the last rank to finish.
    fn shadow_until_all_joined(&self, opts: &JoinOptions) -> Result<()> {
        let pg = self.pg();
        let meta = pg.meta_as_pytorch(self.device());
        let mut last_to_finish = true;
        loop {
            let training = meta.allreduce("DDP join: ranks still training", &[0f32], ReduceOp::Sum)?[0];
            if training == 0.0 {
                break;
            }
            if opts.throw_on_early_termination {
                meta.allreduce("DDP join: early termination", &[1f32], ReduceOp::Sum)?;
                return Err(exhausted(pg, "this rank ran out of inputs"));
            }
            self.reducer.rebuild_if_due(true)?;
            self.sync_buffers(true, false)?;
            let sync = meta.allreduce("DDP join: backward sync", &[0f32], ReduceOp::Sum)?[0] != 0.0;
            self.reducer.set_forward_param_sync(sync);
            if sync {
                self.reducer.shadow_backward()?;
            }
            last_to_finish = false;
        }
        let root = common_rank(self, last_to_finish)?;
        super::sync::broadcast_coalesced(pg, &self.module_states, super::sync::BROADCAST_BUCKET_BYTES, root)
    }
}
