//! How a model (or a pipeline chunk) is data-parallel: the one representation, which a [`Plan`](super::Plan)
//! carries, [`ParallelMesh`](crate::parallel_dims::ParallelMesh) derives from the degrees, and a pipeline
//! applies to each of its chunks.
use crate::ddp::DdpOptions;
use crate::fsdp::FsdpOptions;
use crate::zero::ZeroStage;

#[derive(Clone, Debug, Default)]
pub(crate) enum DataParallelism {
    /// Every rank holds and updates the whole model alone.
    #[default]
    None,
    /// DDP over the options' group, with ZeRO-1 or ZeRO-2 sharding the optimizer over its buckets.
    Replicate(DdpOptions, Option<ZeroStage>),
    /// FSDP over the options' group, HSDP with a replicate group (ZeRO-3).
    Shard(FsdpOptions),
}

impl DataParallelism {
    /// Its name in errors and `Debug`.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            DataParallelism::None => "none",
            DataParallelism::Replicate(_, None) => "DDP",
            DataParallelism::Replicate(_, Some(ZeroStage::One)) => "DDP + ZeRO-1",
            DataParallelism::Replicate(_, Some(_)) => "DDP + ZeRO-2",
            DataParallelism::Shard(o) if o.replicate_group.is_some() || o.replicas.is_some() => "HSDP",
            DataParallelism::Shard(_) => "FSDP",
        }
    }

    pub(crate) fn is_some(&self) -> bool {
        !matches!(self, DataParallelism::None)
    }
}
