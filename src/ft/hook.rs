//! The cross-replica reductions of a fault-tolerant replica: DDP's communication hook (each bucket summed
//! over the replica's own ranks, then over the replicas of the step, and divided by the ranks that took
//! part) and HSDP's replicas (each reduce-scattered chunk summed over the replicas of the step). A
//! failure of the cross-replica part is recorded for
//! [`Manager::should_commit`](super::Manager::should_commit), not raised: backward ends normally, the
//! step is discarded and run again by the survivors.
use std::sync::Arc;

use crate::ddp::comm_hook::{CommHook, GradBucket, HookFuture};
use crate::error::Result;
use crate::fsdp::Replicas;
use crate::group::{ProcessGroup, ReduceOp};
use crate::work::Work;

use super::manager::Shared;

#[derive(Clone)]
pub(crate) struct ReplicateHook {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for ReplicateHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplicateHook")
    }
}

/// A cross-replica sum under way: into a copy of the bucket, so that a sum given up on (a replica lost)
/// can never write into the gradients of a later step.
struct Posted {
    work: Work,
    wire: tch::Tensor,
}

impl ReplicateHook {
    /// Starts the cross-replica sum of `t` (nothing to start when this step already failed, or when this
    /// replica is alone).
    fn post(shared: &Shared, t: &tch::Tensor) -> Result<Option<Posted>> {
        if shared.failed() || shared.participants.load(std::sync::atomic::Ordering::SeqCst) <= 1 {
            return Ok(None);
        }
        let Some(g) = shared.group() else {
            // the step was not started (or its group was given up): never a local gradient passed as the
            // replicas' mean
            shared.fail(crate::error::Error::PeerGone {
                op: "fault tolerance".into(),
                msg: "no replicate group for this step (call Manager::start_step before backward)".into(),
            });
            return Ok(None);
        };
        let mut wire = t.f_detach_copy()?;
        match g.allreduce_unverified(&mut wire, ReduceOp::Sum) {
            Ok(work) => Ok(Some(Posted { work, wire })),
            Err(e) => {
                shared.fail(e);
                Ok(None)
            }
        }
    }

    /// Waits for a posted sum and copies it into `t`, unless the step has failed.
    fn land(shared: &Shared, posted: Option<Posted>, t: &tch::Tensor) -> Result<()> {
        if let Some(p) = posted {
            // once the step has failed, later buckets are not waited for: their sums may never end
            if shared.failed() {
                return Ok(());
            }
            match p.work.wait() {
                Ok(()) => {
                    t.shallow_clone().f_copy_(&p.wire)?;
                }
                Err(e) => shared.fail(e),
            }
        }
        Ok(())
    }

    fn finish(shared: &Shared, posted: Option<Posted>, t: &mut tch::Tensor, ranks: usize) -> Result<()> {
        Self::land(shared, posted, t)?;
        if !shared.failed() {
            let n = shared.participants.load(std::sync::atomic::Ordering::SeqCst).max(1) * ranks;
            let _ = t.f_div_scalar_(n as f64)?;
        }
        Ok(())
    }
}

impl CommHook for ReplicateHook {
    fn run(&self, inner: &Arc<ProcessGroup>, bucket: &GradBucket) -> Result<HookFuture> {
        let shared = self.shared.clone();
        let mut t = bucket.buffer().shallow_clone();
        let ranks = inner.size();
        if ranks == 1 {
            // one rank per replica: the cross-replica sum starts now and overlaps the rest of backward
            let posted = Self::post(&shared, &t)?;
            return Ok(HookFuture::ready().then(move || Self::finish(&shared, posted, &mut t, 1)));
        }
        // a failure of the replica's own ranks is this replica's end, raised as it is
        let work = inner.allreduce_unverified(&mut t.shallow_clone(), ReduceOp::Sum)?;
        Ok(HookFuture::after(work).then(move || {
            let posted = Self::post(&shared, &t)?;
            Self::finish(&shared, posted, &mut t, ranks)
        }))
    }

    /// A replica that just joined is at its first iteration while the others are not: buckets must not
    /// depend on it.
    fn fixed_layout(&self) -> bool {
        true
    }
}

/// HSDP's replicate dimension under fault tolerance: FSDP divides by the step's participants
/// ([`Replicas::count`]) times its shard group, and sums each reduced chunk here.
#[derive(Clone)]
pub(crate) struct FsdpReplicas {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for FsdpReplicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FsdpReplicas")
    }
}

impl Replicas for FsdpReplicas {
    fn count(&self) -> usize {
        self.shared.participants.load(std::sync::atomic::Ordering::SeqCst).max(1)
    }
    fn all_reduce_sum(&self, t: &tch::Tensor) -> Result<()> {
        let posted = ReplicateHook::post(&self.shared, t)?;
        ReplicateHook::land(&self.shared, posted, t)
    }
}
