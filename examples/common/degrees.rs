//! The data- and tensor-parallel degrees the GPT examples take as flags (`#[command(flatten)]`); the
//! layout itself is the library's `ParallelDims`.
use clap::Args;
use tch_dist::parallel_dims::ParallelDims;

/// `--dp`, `--fsdp`, `--hsdp RxS` and `--tp`.
#[derive(Args, Clone, Debug)]
pub struct Degrees {
    /// Data-parallel replicas: DDP, or with --fsdp the replicas of HSDP (`dp_replicate`).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Ranks the parameters are sharded over: FSDP (`dp_shard`).
    #[arg(long, default_value_t = 1)]
    pub fsdp: usize,
    /// HSDP as REPLICASxSHARDS: --dp REPLICAS --fsdp SHARDS.
    #[arg(long)]
    pub hsdp: Option<String>,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
}

impl Degrees {
    /// The flags as degrees (the others 1).
    pub fn dims(&self) -> Result<ParallelDims, String> {
        let (mut dp, mut fsdp) = (self.dp, self.fsdp);
        if let Some(spec) = &self.hsdp {
            let bad = || format!("--hsdp {spec}: expected REPLICASxSHARDS, e.g. 2x2");
            let (r, s) = spec.split_once('x').ok_or_else(bad)?;
            (dp, fsdp) = (r.parse().map_err(|_| bad())?, s.parse().map_err(|_| bad())?);
        }
        Ok(ParallelDims { dp_replicate: dp, dp_shard: fsdp, tp: self.tp, ..Default::default() })
    }
}
