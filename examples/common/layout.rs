//! The data- and tensor-parallel flags the GPT examples share (`#[command(flatten)]`).
use clap::Args;

/// `--dp`, `--fsdp`, `--hsdp RxS` and `--tp`.
#[derive(Args, Clone, Debug)]
pub struct Layout {
    /// Data-parallel replicas: DDP, or with --fsdp the replicas of HSDP.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Ranks the parameters are sharded over (FSDP).
    #[arg(long, default_value_t = 1)]
    pub fsdp: usize,
    /// HSDP as REPLICASxSHARDS: --dp REPLICAS --fsdp SHARDS.
    #[arg(long)]
    pub hsdp: Option<String>,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
}

impl Layout {
    /// `--hsdp RxS` read into `dp` and `fsdp`.
    pub fn resolve(mut self) -> Result<Layout, String> {
        if let Some(spec) = &self.hsdp {
            let bad = || format!("--hsdp {spec}: expected REPLICASxSHARDS, e.g. 2x2");
            let (r, s) = spec.split_once('x').ok_or_else(bad)?;
            (self.dp, self.fsdp) = (r.parse().map_err(|_| bad())?, s.parse().map_err(|_| bad())?);
        }
        Ok(self)
    }

    /// Data-parallel ranks: replicas times shards.
    pub fn replicas(&self) -> usize {
        self.dp * self.fsdp
    }

    /// `plan` with the data parallelism of the flags over `mesh`'s `dp` and `fsdp` dimensions: DDP, FSDP
    /// or HSDP (none for one replica).
    #[allow(dead_code)] // not every example takes a plan
    pub fn data_parallel(
        &self,
        plan: tch_dist::parallelize::Plan,
        mesh: &tch_dist::mesh::DeviceMesh,
        vs: &tch::nn::VarStore,
    ) -> tch_dist::Result<tch_dist::parallelize::Plan> {
        use tch_dist::{ddp::DdpOptions, fsdp::FsdpOptions};
        Ok(match (self.dp, self.fsdp) {
            (1, 1) => plan,
            (_, 1) => plan.replicate(DdpOptions::default().mesh(mesh, "dp")?),
            (1, _) => plan.fully_shard(vs, FsdpOptions::default().mesh(mesh, &["fsdp"])?)?,
            _ => plan.fully_shard(vs, FsdpOptions::default().mesh(mesh, &["dp", "fsdp"])?)?,
        })
    }
}
