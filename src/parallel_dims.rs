//! The parallel layout as one value of degrees (torchtitan's `ParallelDims`), and what every part of a
//! training program derives from it: the mesh, the groups by purpose, which rows of the batch a rank
//! reads, where the loss is averaged, which rank reports, and the data parallelism of a [`Plan`] or of a
//! pipeline's stages.
//!
//! ```no_run
//! use tch_dist::parallel_dims::{ParallelDims, REST};
//! let world = tch_dist::ProcessGroup::from_env()?;
//! // 8 ranks: 2 tensor-parallel, the rest (4) sharding the parameters (FSDP)
//! let dims = ParallelDims { tp: 2, dp_shard: REST, ..Default::default() }.build(&world)?;
//! let rows = dims.rows(32)?; // this rank's rows of a global batch of 32
//! assert_eq!(rows.end - rows.start, 8);
//! let plan = dims.plan(); // tensor parallel over "tp", FSDP over "dp_shard"; add the styles
//! # Ok::<(), tch_dist::Error>(())
//! ```
use std::ops::Range;
use std::sync::Arc;

use crate::ddp::DdpOptions;
use crate::error::{Error, Result};
use crate::fsdp::FsdpOptions;
use crate::group::{ProcessGroup, ReduceOp};
use crate::mesh::DeviceMesh;
use crate::parallelize::data_parallelism::DataParallelism;
use crate::parallelize::Plan;

/// A degree meaning "whatever the world leaves" once the others are set (torchtitan's `-1`); at most
/// one degree may be it.
pub const REST: usize = 0;

/// The parallel degrees of a layout. Each is 1 by default (that parallelism off); their product, `ep`
/// aside, is the world size. The mesh is laid out outermost first as torchtitan's:
/// `pp`, `dp_replicate`, `dp_shard`, `cp`, `tp` (tensor-parallel ranks adjacent, on one node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelDims {
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel replicas: DDP, or with `dp_shard` above 1 the replicas of HSDP.
    pub dp_replicate: usize,
    /// Ranks the parameters are sharded over (FSDP; with `dp_replicate`, HSDP).
    pub dp_shard: usize,
    /// Context-parallel ranks: each sequence split over them.
    pub cp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Expert-parallel ranks, borrowed from the data-parallel ones (`dp_replicate` x `dp_shard`, which it
    /// divides): consecutive ranks of the batch group each hold their share of the experts.
    pub ep: usize,
}

impl Default for ParallelDims {
    fn default() -> Self {
        ParallelDims { pp: 1, dp_replicate: 1, dp_shard: 1, cp: 1, tp: 1, ep: 1 }
    }
}

/// The degrees as they are written on a command line or in a config: `name=degree` pairs joined by
/// commas, in any order, each name a field (`"dp_shard=rest,tp=2"`; `rest` or `-1` is [`REST`]); the
/// degrees left out are 1, and `"1"` (or nothing) is one process. `Display` writes the same form, the
/// degrees above 1 only, so a `ParallelDims` is a clap argument as it is:
/// `#[arg(long, default_value_t)] parallel: ParallelDims` takes `--parallel dp_shard=2,tp=2`.
impl std::str::FromStr for ParallelDims {
    type Err = Error;

    fn from_str(s: &str) -> Result<ParallelDims> {
        let mut d = ParallelDims::default();
        let bad = |why: String| Error::invalid("ParallelDims", format!("{s:?}: {why}"));
        if s.trim() == "1" {
            return Ok(d);
        }
        let mut seen: Vec<&str> = Vec::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (name, value) = entry
                .split_once('=')
                .ok_or_else(|| bad(format!("{entry:?} is not name=degree (names: {}, ep)", DIMS.join(", "))))?;
            let degree = match value.trim() {
                "rest" | "-1" => REST,
                v => match v.parse::<usize>() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(bad(format!("{name}={v}: a degree is a positive whole number, or rest"))),
                },
            };
            let name = name.trim();
            if seen.contains(&name) {
                return Err(bad(format!("{name} is given twice")));
            }
            seen.push(name);
            let field = match name {
                "pp" => &mut d.pp,
                "dp_replicate" => &mut d.dp_replicate,
                "dp_shard" => &mut d.dp_shard,
                "cp" => &mut d.cp,
                "tp" => &mut d.tp,
                "ep" => &mut d.ep,
                other => return Err(bad(format!("no degree is named {other:?} (names: {}, ep)", DIMS.join(", ")))),
            };
            *field = degree;
        }
        Ok(d)
    }
}

impl std::fmt::Display for ParallelDims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = self;
        let all =
            [("pp", d.pp), ("dp_replicate", d.dp_replicate), ("dp_shard", d.dp_shard), ("cp", d.cp), ("tp", d.tp)];
        let set: Vec<String> = all
            .iter()
            .chain(&[("ep", d.ep)])
            .filter(|(_, v)| *v != 1)
            .map(|(n, v)| if *v == REST { format!("{n}=rest") } else { format!("{n}={v}") })
            .collect();
        if set.is_empty() {
            f.write_str("1")
        } else {
            f.write_str(&set.join(","))
        }
    }
}

/// The mesh dimensions' names, outermost first.
pub const DIMS: [&str; 5] = ["pp", "dp_replicate", "dp_shard", "cp", "tp"];

impl ParallelDims {
    /// The degrees with [`REST`] filled in for a world of `world` ranks, checked: they must multiply to
    /// `world`, and `ep` must divide the data-parallel ranks.
    pub fn resolve(&self, world: usize) -> Result<ParallelDims> {
        let mut d = *self;
        let fields =
            [("pp", d.pp), ("dp_replicate", d.dp_replicate), ("dp_shard", d.dp_shard), ("cp", d.cp), ("tp", d.tp)];
        let rest: Vec<&str> = fields.iter().filter(|(_, v)| *v == REST).map(|(n, _)| *n).collect();
        let set: usize = fields.iter().map(|(_, v)| *v).filter(|&v| v != REST).product();
        let bad = |why: String| Err(Error::invalid("ParallelDims", format!("{self:?} on {world} ranks: {why}")));
        match rest[..] {
            [] if set != world => return bad(format!("the degrees multiply to {set}, not the world size {world}")),
            [] => {}
            [one] => {
                if !world.is_multiple_of(set) {
                    return bad(format!("the set degrees multiply to {set}, which does not divide {world}: no {one}"));
                }
                let n = world / set;
                match one {
                    "pp" => d.pp = n,
                    "dp_replicate" => d.dp_replicate = n,
                    "dp_shard" => d.dp_shard = n,
                    "cp" => d.cp = n,
                    _ => d.tp = n,
                }
            }
            _ => return bad(format!("{} are all REST; at most one degree may be", rest.join(" and "))),
        }
        let dp = d.dp_replicate * d.dp_shard;
        if d.ep == REST {
            return bad("ep borrows from the data-parallel ranks: give it a degree, not REST".into());
        }
        if !dp.is_multiple_of(d.ep) {
            return bad(format!("ep {} does not divide dp_replicate x dp_shard = {dp}", d.ep));
        }
        Ok(d)
    }

    /// Data-parallel ranks: replicas times shards (the ranks that read different rows of the batch).
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// The mesh over `world` (every rank calls it with the same degrees) and this rank's groups, all
    /// formed here, in one order on every rank.
    pub fn build(&self, world: &ProcessGroup) -> Result<ParallelMesh> {
        let d = self.resolve(world.size())?;
        let degrees = [d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp];
        let dims: Vec<(&str, usize)> = DIMS.iter().copied().zip(degrees).collect();
        let mesh = DeviceMesh::new(world, &dims)?;
        // torchtitan's flattened meshes: "dp" (the batch), "dp_cp" (the loss), "dp_shard_cp" (FSDP's
        // shards: context-parallel ranks hold other tokens, so their gradients are averaged too)
        // a flattening whose dimensions above 1 are another's is that group: each set is formed once
        let mut formed: Vec<(Vec<&str>, Arc<ProcessGroup>)> = Vec::new();
        let mut flat = |names: &[&'static str]| -> Result<Arc<ProcessGroup>> {
            let wide: Vec<&str> = names.iter().copied().filter(|n| mesh.size(n).is_ok_and(|s| s > 1)).collect();
            if let Some((_, g)) = formed.iter().find(|(w, _)| *w == wide) {
                return Ok(g.clone());
            }
            let g = mesh.flatten(world, names)?;
            formed.push((wide, g.clone()));
            Ok(g)
        };
        let batch = flat(&["dp_replicate", "dp_shard"])?;
        let loss = flat(&["dp_replicate", "dp_shard", "cp"])?;
        let shard = flat(&["dp_shard", "cp"])?;
        let (experts, expert_replicas) = expert_groups(&batch, d.ep)?;
        let dim = |name: &str| mesh.group(name);
        let (pp, tp, cp, replicate) = (dim("pp")?, dim("tp")?, dim("cp")?, dim("dp_replicate")?);
        let rank = world.rank();
        Ok(ParallelMesh { dims: d, rank, pp, tp, cp, replicate, mesh, batch, loss, shard, experts, expert_replicas })
    }
}

/// The expert-parallel group (`ep` consecutive ranks of `batch`) and the group of the ranks at the same
/// place in each (which hold the same experts): none where `ep` is 1; the batch group itself, with no
/// replicas, where `ep` is all of it.
#[allow(clippy::type_complexity)]
fn expert_groups(
    batch: &Arc<ProcessGroup>,
    ep: usize,
) -> Result<(Option<Arc<ProcessGroup>>, Option<Arc<ProcessGroup>>)> {
    let n = batch.size();
    if ep == 1 {
        return Ok((None, None));
    }
    if ep == n {
        return Ok((Some(batch.clone()), None));
    }
    let r = batch.rank();
    let own: Vec<usize> = (r / ep * ep..r / ep * ep + ep).collect();
    let same: Vec<usize> = (r % ep..n).step_by(ep).collect();
    let part = |ranks: &[usize], name: &str| -> Result<Arc<ProcessGroup>> {
        let g = batch.new_partition_subgroup(ranks, name)?;
        Ok(Arc::new(g.ok_or_else(|| Error::invalid("ParallelDims", "this rank is not in its own expert group"))?))
    };
    Ok((Some(part(&own, "ep")?), Some(part(&same, "ep_replicas")?)))
}

/// A layout built over the world: its mesh, this rank's groups by purpose, and the facts the training
/// loop needs ([`ParallelDims::build`]).
pub struct ParallelMesh {
    dims: ParallelDims,
    rank: usize,
    pp: Arc<ProcessGroup>,
    tp: Arc<ProcessGroup>,
    cp: Arc<ProcessGroup>,
    replicate: Arc<ProcessGroup>,
    mesh: DeviceMesh,
    batch: Arc<ProcessGroup>,
    loss: Arc<ProcessGroup>,
    shard: Arc<ProcessGroup>,
    experts: Option<Arc<ProcessGroup>>,
    expert_replicas: Option<Arc<ProcessGroup>>,
}

impl ParallelMesh {
    /// The degrees, [`REST`] filled in.
    pub fn dims(&self) -> &ParallelDims {
        &self.dims
    }

    /// The mesh, dimensions named as [`DIMS`].
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// This rank's rank in the world the mesh was built over.
    pub fn rank(&self) -> usize {
        self.rank
    }

    fn at(&self, name: &str) -> usize {
        self.mesh.coordinate(name).unwrap_or_else(|_| unreachable!("mesh dimension {name}"))
    }

    /// The ranks holding the other pipeline stages of this rank's (the pipeline's group).
    pub fn pp_group(&self) -> &Arc<ProcessGroup> {
        &self.pp
    }

    /// The tensor-parallel group.
    pub fn tp_group(&self) -> &Arc<ProcessGroup> {
        &self.tp
    }

    /// The context-parallel group (the ranks splitting one sequence).
    pub fn cp_group(&self) -> &Arc<ProcessGroup> {
        &self.cp
    }

    /// The ranks reading different rows of the global batch: `dp_replicate` x `dp_shard`.
    pub fn batch_group(&self) -> &Arc<ProcessGroup> {
        &self.batch
    }

    /// This rank's place among the [`batch_group`](Self::batch_group)'s ranks.
    pub fn batch_rank(&self) -> usize {
        self.at("dp_replicate") * self.dims.dp_shard + self.at("dp_shard")
    }

    /// The rows of a global batch of `global_batch` rows this rank reads: an equal share for each
    /// data-parallel rank, in batch-rank order (tensor-, context- and pipeline-parallel ranks read the
    /// same rows as their peers).
    pub fn rows(&self, global_batch: i64) -> Result<Range<i64>> {
        let dp = self.dims.dp() as i64;
        if global_batch <= 0 || global_batch % dp != 0 {
            return Err(Error::invalid(
                "ParallelMesh::rows",
                format!(
                    "a global batch of {global_batch} rows does not split over dp_replicate x dp_shard = {dp} ranks"
                ),
            ));
        }
        let per = global_batch / dp;
        let first = self.batch_rank() as i64 * per;
        Ok(first..first + per)
    }

    /// Where the loss is averaged: the data- and context-parallel ranks (`dp_replicate` x `dp_shard` x
    /// `cp`), whose losses are over different tokens.
    pub fn loss_group(&self) -> &Arc<ProcessGroup> {
        &self.loss
    }

    /// The mean of `loss` (a scalar) over the [`loss_group`](Self::loss_group), on its device: every
    /// rank of the group calls this (under a pipeline, the last stage's ranks, which have the loss; an
    /// earlier stage's call is refused, as its loss would be a placeholder). Nothing is read on the host:
    /// `double_value` it where it is logged (torchtitan's `dist_mean`, then `.item()` at the log step).
    pub fn average_loss(&self, loss: &tch::Tensor) -> Result<tch::Tensor> {
        // every rank of an earlier stage's loss group is refused alike, before any collective
        if self.at("pp") + 1 != self.dims.pp {
            return Err(crate::Error::invalid(
                "ParallelMesh::average_loss",
                format!(
                    "this rank is on pipeline stage {} of {}, which has no loss: only the last stage's ranks \
                     average it (where RankReport::loss is Some)",
                    self.at("pp"),
                    self.dims.pp
                ),
            ));
        }
        if loss.numel() != 1 {
            return Err(crate::Error::invalid(
                "ParallelMesh::average_loss",
                format!("the loss must be a scalar, not {:?}", loss.size()),
            ));
        }
        let _call = self.loss.enter_call("ParallelMesh::average_loss");
        // a rank that calls it alone is named at it: "(in \"ParallelMesh::average_loss\")"
        let _l = crate::flight::label("ParallelMesh::average_loss");
        let _g = tch::no_grad_guard();
        // a copy in float32 (the allreduce writes into it, not into the caller's)
        let mut t = loss.f_detach()?.f_reshape([1])?.f_to_dtype(tch::Kind::Float, false, true)?;
        self.loss.allreduce(&mut t, ReduceOp::Sum)?;
        Ok(t.f_div_scalar(self.loss.size() as f64)?.f_reshape([])?)
    }

    /// Whether this rank reports (prints, writes the loss): the last pipeline stage's first rank in every
    /// other dimension.
    pub fn is_reporter(&self) -> bool {
        self.at("pp") + 1 == self.dims.pp && DIMS[1..].iter().all(|d| self.at(d) == 0)
    }

    /// The group FSDP shards over: `dp_shard` x `cp` (torchtitan's `dp_shard_cp`).
    pub fn fsdp_group(&self) -> &Arc<ProcessGroup> {
        &self.shard
    }

    /// The replicas of HSDP, or DDP's ranks without context parallelism: `dp_replicate`.
    pub fn replicate_group(&self) -> &Arc<ProcessGroup> {
        &self.replicate
    }

    /// The expert-parallel group, when `ep` is above 1.
    pub fn expert_group(&self) -> Option<&Arc<ProcessGroup>> {
        self.experts.as_ref()
    }

    /// The ranks holding the same experts as this one (the same place in each expert-parallel group),
    /// when `ep` is above 1 and below the data-parallel ranks.
    pub fn expert_replica_group(&self) -> Option<&Arc<ProcessGroup>> {
        self.expert_replicas.as_ref()
    }

    /// `opts` over DDP's ranks: every data- and context-parallel rank (the [`loss_group`](Self::loss_group);
    /// `dp_replicate` x `cp` in a layout that does not shard).
    pub fn ddp(&self, opts: DdpOptions) -> DdpOptions {
        opts.process_group(self.loss.clone())
    }

    /// `opts` over FSDP's ranks here (`dp_shard` x `cp`), replicated over `dp_replicate` (HSDP) when it
    /// is above 1.
    pub fn fsdp(&self, opts: FsdpOptions) -> FsdpOptions {
        let opts = opts.process_group(self.shard.clone());
        if self.dims.dp_shard > 1 && self.dims.dp_replicate > 1 {
            opts.replicate_group(self.replicate.clone())
        } else {
            opts
        }
    }

    /// The plan: tensor parallel over "tp" (add its styles), data parallel as the degrees say (DDP over
    /// the [`loss_group`](Self::loss_group), FSDP over the [`fsdp_group`](Self::fsdp_group), HSDP across
    /// `dp_replicate`), with default options. The same plan builds a model
    /// ([`Plan::build`]) or each chunk of a pipeline
    /// ([`PipelineConfig::plan`](crate::pipeline::PipelineConfig::plan)).
    pub fn plan(&self) -> Plan {
        self.plan_with(DdpOptions::default(), FsdpOptions::default())
    }

    /// [`plan`](Self::plan), DDP or FSDP with the caller's options, whichever the degrees choose (their
    /// groups are the mesh's).
    pub fn plan_with(&self, ddp: DdpOptions, fsdp: FsdpOptions) -> Plan {
        // FSDP where dp_shard is above 1 (HSDP with dp_replicate too), DDP where only dp_replicate (or
        // cp) is, none otherwise
        let d = &self.dims;
        let dp = match (d.dp_replicate, d.dp_shard, d.cp) {
            (1, 1, 1) => DataParallelism::None,
            (_, 1, _) => DataParallelism::Replicate(self.ddp(ddp), None),
            _ => DataParallelism::Shard(self.fsdp(fsdp)),
        };
        Plan::over_group(self.tp.clone()).with_data_parallelism(dp)
    }
}

#[cfg(test)]
mod tests {
    use super::{ParallelDims, REST};

    #[test]
    fn degrees_read_from_text_and_write_back_the_same() {
        let d: ParallelDims = "dp_shard=rest, tp=2".parse().unwrap();
        assert_eq!(d, ParallelDims { dp_shard: REST, tp: 2, ..Default::default() });
        assert_eq!(d.to_string(), "dp_shard=rest,tp=2");
        for s in ["1", "", "pp=2,dp_replicate=2,dp_shard=2,cp=2,tp=2,ep=2"] {
            let d: ParallelDims = s.parse().unwrap();
            assert_eq!(d.to_string().parse::<ParallelDims>().unwrap(), d, "{s}");
        }
        assert_eq!(ParallelDims::default().to_string(), "1");
        let err = |s: &str| s.parse::<ParallelDims>().unwrap_err().to_string();
        assert!(err("fsdp=2").contains("no degree is named \"fsdp\""), "{}", err("fsdp=2"));
        assert!(err("tp=0").contains("tp=0"), "{}", err("tp=0"));
        assert!(err("tp").contains("name=degree"), "{}", err("tp"));
        assert!(err("tp=2,tp=4").contains("tp is given twice"), "{}", err("tp=2,tp=4"));
        assert!(err("tp=2,1").contains("\"1\" is not name=degree"), "{}", err("tp=2,1"));
    }

    #[test]
    fn the_rest_is_what_the_world_leaves_and_wrong_degrees_are_named() {
        let d = ParallelDims { tp: 2, dp_shard: REST, ..Default::default() }.resolve(8).unwrap();
        assert_eq!((d.dp_shard, d.tp, d.dp()), (4, 2, 4));
        let e = ParallelDims { tp: 3, dp_shard: REST, ..Default::default() }.resolve(8).unwrap_err().to_string();
        assert!(e.contains("does not divide 8") && e.contains("dp_shard"), "{e}");
        let e = ParallelDims { tp: 2, ..Default::default() }.resolve(4).unwrap_err().to_string();
        assert!(e.contains("multiply to 2, not the world size 4"), "{e}");
        let e = ParallelDims { tp: REST, pp: REST, ..Default::default() }.resolve(4).unwrap_err().to_string();
        assert!(e.contains("pp and tp are all REST"), "{e}");
        let e = ParallelDims { dp_replicate: 4, ep: 3, ..Default::default() }.resolve(4).unwrap_err().to_string();
        assert!(e.contains("ep 3 does not divide dp_replicate x dp_shard = 4"), "{e}");
        assert_eq!(ParallelDims::default().resolve(1).unwrap(), ParallelDims::default());
    }
}
