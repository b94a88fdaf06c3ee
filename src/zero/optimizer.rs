//! ZeRO-1 and ZeRO-2's optimizer: each rank steps its shards of DDP's buckets, then the shards are
//! all-gathered back into every rank's parameters.
use std::collections::VecDeque;
use std::sync::Arc;

use tch::{Kind, Tensor};

use super::flat::{self, FlatBucket};
use super::grad_shards::GradShards;
use super::ZeroStage;
use crate::ddp::DistributedDataParallel;
use crate::ddp::{BackwardCount, GradSink};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::hooks;
use crate::optim::{self, Optimizer, OptimizerMemory};
use crate::placement::{self, Piece};

pub(super) struct Shard {
    pub(super) params: FlatBucket,
    /// The averaged gradient of this rank's shard (a view into DDP's bucket, or ZeRO-2's shard).
    pub(super) grad: Tensor,
    /// What the inner optimizer steps: the parameter shard itself, or its float32 master copy.
    pub(super) stepped: Tensor,
    pub(super) master: bool,
    /// One optimizer per shard, so that a step's temporaries (float32 gradient copies included) are one
    /// bucket's at a time. Where this rank's shard is all padding it steps an empty tensor, so every rank
    /// holds the same state entries (consolidation gathers them).
    pub(super) opt: Box<dyn Optimizer + Send>,
    /// The bucket's parameters: (index in DDP's order, offset in the flat buffer, shape).
    pub(super) members: Vec<(usize, i64, Vec<i64>)>,
}

/// An optimizer sharded across the ranks of a DDP model (ZeRO stage 1 or 2, see the module docs).
pub struct ShardedOptimizer {
    pub(super) pg: Arc<ProcessGroup>,
    stage: ZeroStage,
    pub(super) shards: Vec<Shard>,
    /// The model's parameters, and the full gradient buffers to zero: DDP's buckets (stage 1) or the
    /// gradient shards (stage 2).
    pub(super) params: Vec<Tensor>,
    full_grads: Vec<Tensor>,
    /// DDP's synchronised backwards so far: gradients prepared for an earlier one are stale.
    backwards: BackwardCount,
    /// The backward whose gradients `stepped` has (with master weights, cast), for the coming step.
    prepared: Option<i64>,
}

impl ShardedOptimizer {
    /// Shards `ddp`'s parameters: fixes its bucket layout, moves each bucket's parameters into a flat
    /// buffer, and builds an inner optimizer with `make` for each of this rank's non-empty shards (one
    /// tensor each), e.g. `|p| Box::new(AdamW::new(p, 1e-3))`. Call before training: with
    /// `ZeroStage::Two`, gradients present are dropped.
    pub fn new<M>(
        ddp: &DistributedDataParallel<M>,
        stage: ZeroStage,
        make: impl Fn(Vec<Tensor>) -> Box<dyn Optimizer + Send>,
    ) -> Result<ShardedOptimizer> {
        if stage == ZeroStage::Three {
            return Err(Error::invalid(
                "ShardedOptimizer::new",
                "ZeRO-3 shards the parameters, which changes how the model runs: wrap it in FSDP \
                 (fsdp::FullyShardedDataParallel, or Plan::fully_shard) and step its shards with any optimizer",
            ));
        }
        if ddp.sharded() {
            return Err(Error::invalid(
                "ShardedOptimizer::new",
                format!(
                    "ZeRO-{}: this DDP model's buckets are sharded by another ShardedOptimizer already (one per model)",
                    stage.number()
                ),
            ));
        }
        if stage == ZeroStage::Two {
            ddp.refuse_comm_hook("ZeRO-2 setup")?;
        }
        let pg = ddp.process_group().clone();
        let (rank, world) = (pg.rank(), pg.size());
        let layout = ddp.fix_layout()?;
        let params = ddp.params();
        // Everything that can fail comes before DDP hands its gradients over (stage 2's route_to, whose
        // sink is built last): a failed setup leaves the model as plain DDP, free for another try.
        let mut built = Vec::with_capacity(layout.len());
        for idx in layout.iter().map(|b| &b.params) {
            let members: Vec<Tensor> = idx.iter().map(|&i| params[i].shallow_clone()).collect();
            let flat = FlatBucket::new(&members, rank, world)?;
            let view = flat.shard()?;
            let master = matches!(view.kind(), Kind::Half | Kind::BFloat16);
            let stepped = if master { view.f_to_kind(Kind::Float)? } else { view.f_detach()? }.set_requires_grad(true);
            let opt = make(vec![stepped.shallow_clone()]);
            let members: Vec<(usize, i64, Vec<i64>)> =
                idx.iter().zip(&flat.offsets).map(|(&i, &off)| (i, off, params[i].size())).collect();
            record_pieces(&stepped, &pg, &flat, &members, &params)?;
            built.push((flat, stepped, master, opt, members));
        }
        // its gradients are this optimizer's (DDP's buckets, or the shards): clipping the parameters' is refused
        let by = format!("ZeRO-{}'s ShardedOptimizer", stage.number());
        for p in &params {
            placement::record_stepped_by(p, Some(&by))?;
        }
        // this rank's averaged gradient of each bucket, and the full buffers zero_grad zeroes
        let routed = (|| -> Result<(Vec<Tensor>, Vec<Tensor>)> {
            Ok(match stage {
                ZeroStage::One => {
                    let mut grads = Vec::with_capacity(layout.len());
                    for (b, (flat, ..)) in layout.iter().zip(&built) {
                        // DDP's bucket is unpadded: a rank whose shard is all padding gets an empty slice at the end
                        let at = (rank as i64 * flat.len).min(b.grads.numel() as i64);
                        grads.push(b.grads.f_narrow(0, at, flat.own)?);
                    }
                    (grads, layout.iter().map(|b| b.grads.shallow_clone()).collect())
                }
                _ => {
                    let mut out = (Vec::new(), Vec::new());
                    ddp.route_to("ZeRO-2 setup", |buckets| {
                        let sink = GradShards::new(buckets, world)?;
                        for (t, (flat, ..)) in sink.shards.iter().zip(&built) {
                            out.0.push(t.f_narrow(0, 0, flat.own)?);
                        }
                        out.1 = sink.shards.iter().map(|t| t.shallow_clone()).collect();
                        Ok(Box::new(sink) as Box<dyn GradSink>)
                    })?;
                    out
                }
            })
        })();
        let (grads, full_grads) = match routed {
            Ok(r) => r,
            Err(e) => {
                // a failed setup leaves plain DDP, whose parameters' gradients are clipped again
                for p in &params {
                    let _ = placement::record_stepped_by(p, None);
                }
                return Err(e);
            }
        };
        let shards = built
            .into_iter()
            .zip(grads)
            .map(|((params, stepped, master, opt, members), grad)| Shard {
                params,
                grad,
                stepped,
                master,
                opt,
                members,
            })
            .collect();
        ddp.mark_sharded();
        let backwards = ddp.backward_count();
        Ok(ShardedOptimizer { pg, stage, shards, params, full_grads, backwards, prepared: None })
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Elements of parameters this rank updates (the sum of its shards).
    pub fn shard_numel(&self) -> i64 {
        self.shards.iter().map(|s| s.params.own).sum()
    }

    /// The inner optimizers, one per non-empty shard.
    pub fn inner_mut(&mut self) -> impl Iterator<Item = &mut (dyn Optimizer + Send + 'static)> {
        self.shards.iter_mut().map(|s| s.opt.as_mut() as &mut (dyn Optimizer + Send + 'static))
    }

    /// Points the inner optimizers at all gradients at once (for [`Optimizer::gradients`]).
    fn prepare(&mut self) -> Result<()> {
        let now = self.backwards.get();
        if self.prepared != Some(now) {
            for s in &self.shards {
                s.prepare()?;
            }
            self.prepared = Some(now);
        }
        Ok(())
    }
}

/// Records which slices of the bucket's parameters this rank's `stepped` shard holds: elements
/// `[rank * len, rank * len + own)` of the bucket; the bucket's first parameter when they are all padding.
fn record_pieces(
    stepped: &Tensor,
    pg: &Arc<ProcessGroup>,
    flat: &FlatBucket,
    members: &[(usize, i64, Vec<i64>)],
    params: &[Tensor],
) -> Result<()> {
    let lo = pg.rank() as i64 * flat.len;
    let hi = lo + flat.own;
    let mut pieces: Vec<Piece> = members
        .iter()
        .filter_map(|(i, off, shape)| {
            let n: i64 = shape.iter().product();
            let (s, e) = (lo.max(*off), hi.min(off + n));
            (e > s).then(|| Piece { variable: params[*i].shallow_clone(), start: s - off, len: e - s, at: s - lo })
        })
        .collect();
    if pieces.is_empty() {
        if let Some((i, _, _)) = members.first() {
            pieces.push(Piece { variable: params[*i].shallow_clone(), start: 0, len: 0, at: 0 });
        }
    }
    placement::record_pieces(stepped, pg, lo, pg.size() as i64 * flat.len, pieces)
}

impl Shard {
    /// This rank's update of its shard of the bucket. `prepared`: the gradient is in place already (the
    /// caller unscaled or clipped it).
    fn step_local(&mut self, prepared: bool) -> Result<()> {
        if !prepared {
            // one bucket at a time (a float32 gradient copy lives for this bucket's step only)
            self.prepare()?;
        }
        self.opt.step()?;
        if self.master {
            self.params.shard()?.f_copy_(&self.stepped)?;
            hooks::set_grad(&self.stepped, None)?; // the float32 copy of the gradient is scratch
        }
        Ok(())
    }

    /// Gives the stepped tensor its gradient: the shard's own, or a float32 copy for master weights.
    fn prepare(&self) -> Result<()> {
        let g = if self.master { self.grad.f_to_kind(Kind::Float)? } else { self.grad.shallow_clone() };
        hooks::set_grad(&self.stepped, Some(&g))?;
        Ok(())
    }
}

impl Optimizer for ShardedOptimizer {
    fn step(&mut self) -> Result<()> {
        let _g = tch::no_grad_guard();
        // bucket b's gather runs while bucket b+1 steps
        let mut pending = VecDeque::new();
        // A rank whose own step fails still takes part in every gather (with its shard as it is), so
        // the others are not left waiting; then every rank learns of the failure at once.
        let mut local = Ok(());
        let prepared = self.prepared == Some(self.backwards.get());
        for (b, s) in self.shards.iter_mut().enumerate() {
            if local.is_ok() {
                local = s.step_local(prepared);
            }
            let _l = crate::flight::label(format!("ZeRO gather, bucket {b}"));
            s.params.all_gather(&self.pg, b, &mut pending, flat::GATHERS_IN_FLIGHT)?;
        }
        for w in pending.into_iter().flatten() {
            w.wait()?;
        }
        self.prepared = None;
        self.pg.meta().outcome("ZeRO step", local)
    }

    /// Drops the parameters' gradients (set to none, as every optimizer here) and zeroes what the next
    /// step reads: DDP's buckets (stage 1) or the shards (stage 2). A step with no backward since then
    /// steps on zero gradients (weight decay, momentum and moments still move the parameters), where an
    /// unsharded optimizer would skip them.
    fn zero_grad(&mut self) -> Result<()> {
        let _g = tch::no_grad_guard();
        hooks::drop_grads(&self.params)?;
        for g in &self.full_grads {
            let _ = g.shallow_clone().f_zero_()?;
        }
        for s in &self.shards {
            if s.master {
                hooks::set_grad(&s.stepped, None)?;
            }
        }
        self.prepared = None;
        Ok(())
    }

    /// Clips the gradients this rank steps (its shards) so that the whole model's gradient has at most
    /// `max_norm` (see [`GradNorm`](optim::GradNorm)): each shard's placement (its pieces of the
    /// variables, over the group and any they were split over already) says where its norm is summed.
    /// Returns the whole model's norm before clipping. Collective; after backward, before the step.
    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<Tensor> {
        self.prepare()?;
        // every shard, empty ones too: each rank then names the same groups
        let stepped: Vec<Tensor> = self.shards.iter().map(|s| s.stepped.shallow_clone()).collect();
        optim::GradNorm::new(norm_type).parameters(&stepped).clip(max_norm)
    }

    fn gradients(&mut self) -> Result<Vec<Tensor>> {
        self.prepare()?;
        Ok(self.shards.iter().filter(|s| s.params.own > 0).map(|s| s.stepped.grad()).collect())
    }

    /// Each shard's inner state under `zero.{bucket}.`, and master weights as `zero.{bucket}.master`.
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (b, sh) in self.shards.iter().enumerate() {
            out.extend(sh.opt.state_dict().into_iter().map(|(k, t)| (format!("zero.{b}.{k}"), t)));
            if sh.master {
                out.push((format!("zero.{b}.master"), sh.stepped.detach()));
            }
        }
        out
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        for (b, sh) in self.shards.iter_mut().enumerate() {
            let prefix = format!("zero.{b}.");
            if sh.master {
                let saved = optim::find(state, &format!("{prefix}master"), &sh.stepped)?;
                if saved.data_ptr() != sh.stepped.data_ptr() {
                    sh.stepped.detach().f_copy_(saved)?;
                }
            }
            let mine: Vec<(String, Tensor)> = state
                .iter()
                .filter_map(|(k, t)| k.strip_prefix(&prefix).map(|rest| (rest.to_string(), t.shallow_clone())))
                .collect();
            sh.opt.load_state_dict(&mine)?;
        }
        Ok(())
    }

    /// Each shard's stepped tensor, keyed under `zero.{bucket}.`; its placement names the parameter
    /// slices it holds.
    fn stepped(&self) -> Vec<optim::Stepped> {
        let mut out = Vec::new();
        for (b, sh) in self.shards.iter().enumerate() {
            for inner in sh.opt.stepped() {
                out.push(optim::Stepped {
                    tensor: sh.stepped.shallow_clone(),
                    prefix: format!("zero.{b}.{}", inner.prefix),
                    master_key: sh.master.then(|| format!("zero.{b}.master")),
                });
            }
        }
        out
    }

    fn memory(&self) -> OptimizerMemory {
        let mut m = OptimizerMemory::default();
        for s in &self.shards {
            m.state += s.opt.memory().state;
        }
        m.master = self.shards.iter().filter(|s| s.master).map(|s| optim::bytes(&s.stepped)).sum();
        if self.stage == ZeroStage::Two {
            m.gradient_shards = self.shards.iter().map(|s| optim::bytes(&s.grad)).sum();
        }
        m.owned_elements = self.shards.iter().map(|s| placement::held_elements(&s.stepped)).sum();
        m
    }
}

impl std::fmt::Debug for ShardedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ShardedOptimizer({:?}, {} buckets, {} elements owned)",
            self.stage,
            self.shards.len(),
            self.shard_numel()
        )
    }
}
