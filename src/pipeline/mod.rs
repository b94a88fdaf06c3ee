//! Model splits across devices and pipeline parallelism.
//!
//! - [`LayerList`] + [`Partition`]: a layer list cut into stages, by hand or balanced by cost.
//! - [`split`]: the manual split (the forum's `MyModel` on `cuda:0` and `cuda:1`).
//! - [`schedule`]: GPipe, 1F1B and interleaved 1F1B as plain per-stage action lists, simulated in tests.
//! - [`Pipeline`]: runs a schedule on stage threads (channels) or stage processes (send/recv), with
//!   optional activation recomputation, and timelines ([`trace`]).
//!
//! ```
//! use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
//! use tch_dist::pipeline::{LayerList, Partition, Pipeline, PipelineConfig, schedule::ScheduleKind};
//! let layers = LayerList::new()
//!     .add("fc1", |p| nn::linear(p, 8, 16, Default::default()))
//!     .add_fn("tanh", |x| x.tanh())
//!     .add("fc2", |p| nn::linear(p, 16, 4, Default::default()));
//! let cfg = PipelineConfig { schedule: ScheduleKind::OneFOneB, microbatches: 4, ..Default::default() };
//! let mut pipe = Pipeline::new(&layers, &Partition::sizes(&[2, 1], 3)?, &[Device::Cpu, Device::Cpu], cfg)?;
//! let mut opts: Vec<_> = pipe.var_stores().iter().map(|vs| nn::Sgd::default().build(vs, 0.1).unwrap()).collect();
//! let (x, y) = (Tensor::randn([8, 8], (Kind::Float, Device::Cpu)), Tensor::zeros([8, 4], (Kind::Float, Device::Cpu)));
//! let report = pipe.step(&x, &y, &|out, y| out.mse_loss(y, tch::Reduction::Mean))?;
//! opts.iter_mut().for_each(|o| o.step());
//! pipe.zero_grad()?;
//! println!("loss {:.4}, bubble {:.2}", report.loss, report.bubble_fraction);
//! # Ok::<(), tch_dist::Error>(())
//! ```
pub mod layers;
pub(crate) mod microbatch;
pub mod partition;
pub(crate) mod plan;
pub(crate) mod runtime;
pub mod schedule;
pub mod split;
pub mod trace;
pub(crate) mod transport;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{nn, Device, Tensor};

pub use layers::{LayerList, Stage};
pub use partition::Partition;
pub use runtime::{LossFn, RankReport};
use schedule::Schedule;
pub use schedule::ScheduleKind;
pub use trace::ActionSpan;

use crate::dist_module::DistModule;
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::parallelize::data_parallelism::DataParallelism;
use crate::parallelize::Plan;

/// A step's outcome.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Mean loss over the batch (the microbatch losses' mean).
    pub loss: f64,
    pub spans: Vec<ActionSpan>,
    /// Measured idle share of the stages between the first start and the last end.
    pub bubble_fraction: f64,
    /// Per stage, most microbatch-chunks held at once.
    pub max_in_flight: Vec<usize>,
    pub seconds: f64,
}

/// A model cut into `p` stages (× `v` chunks each for interleaving) and the schedule that runs it.
pub struct Pipeline {
    /// `ranks[s][c]`: chunk `c` of stage `s`, i.e. virtual stage `c * p + s`.
    ranks: Vec<Vec<Stage>>,
    schedule: Schedule,
    recompute: bool,
    timeout: Duration,
}

impl Pipeline {
    /// Builds all stages in this process. `partition` has `p * v` parts (`v` = `cfg.chunks`), in
    /// virtual-stage order; `devices[s]` is stage `s`'s device (`cfg.device` is a [`PipelineRank`]'s).
    /// The stages are whole: data and tensor parallelism across processes are [`PipelineRank`]'s.
    pub fn new(layers: &LayerList, partition: &Partition, devices: &[Device], cfg: PipelineConfig) -> Result<Pipeline> {
        if cfg.plan.data_parallelism().is_some() || cfg.plan.tp_group().is_some() {
            return Err(Error::invalid(
                "Pipeline::new",
                format!(
                    "the config's plan is parallel ({:?}), but a Pipeline runs its stages as threads of this \
                     process, each whole: build one PipelineRank per process with it",
                    cfg.plan
                ),
            ));
        }
        let (p, chunks) = (devices.len(), cfg.chunks);
        let schedule = plan("Pipeline::new", layers, partition, cfg.schedule, p, cfg.microbatches, chunks)?;
        let vdevices: Vec<Device> = (0..p * chunks).map(|k| devices[k % p]).collect();
        let mut built: Vec<Option<Stage>> = layers.build(partition, &vdevices)?.into_iter().map(Some).collect();
        let ranks = (0..p)
            .map(|s| (0..chunks).map(|c| built[c * p + s].take().expect("each virtual stage once")).collect())
            .collect();
        Ok(Pipeline { ranks, schedule, recompute: cfg.recompute, timeout: crate::group::DEFAULT_TIMEOUT })
    }

    /// How long a stage waits for a tensor before failing.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The variable stores, one per virtual stage (build one optimizer per store).
    pub fn var_stores(&self) -> Vec<&nn::VarStore> {
        self.ranks.iter().flat_map(|r| r.iter().map(|s| &s.vs)).collect()
    }

    pub fn stages(&self) -> &[Vec<Stage>] {
        &self.ranks
    }

    /// Drops every stage's gradients (PyTorch's `zero_grad()`, `set_to_none=True`): their memory is free
    /// until the next backward, so the next step's forwards do not run beside last step's gradients.
    pub fn zero_grad(&self) -> Result<()> {
        zero_grads(&self.ranks.iter().flatten().collect::<Vec<_>>())
    }

    /// One training step on the batch (`x`, `y`), one thread per stage. Gradients accumulate in the
    /// stages' variables; step the optimizers afterwards.
    pub fn step(&mut self, x: &Tensor, y: &Tensor, loss: &LossFn) -> Result<StepReport> {
        let m = self.schedule.microbatches;
        let inputs = microbatch::split(x, m, "inputs")?;
        let targets = microbatch::split(y, m, "targets")?;
        let start = Instant::now();
        let reports = runtime::run_threads(
            &self.schedule,
            &mut self.ranks,
            &inputs,
            &targets,
            loss,
            self.recompute,
            self.timeout,
        )?;
        Ok(summarise(&self.schedule, reports, start.elapsed().as_secs_f64()))
    }
}

/// The schedule for `p` stages, checking that the partition has one part per virtual stage.
fn plan(
    what: &str,
    layers: &LayerList,
    partition: &Partition,
    kind: schedule::ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
) -> Result<Schedule> {
    // every layer in exactly one stage: a partition of fewer layers would train a shorter model silently
    let covered = partition.ranges().last().map_or(0, |r| r.end);
    if covered != layers.len() {
        return Err(Error::invalid(
            what.to_string(),
            format!(
                "the partition covers {covered} layers, the layer list has {}: each layer goes to exactly one stage",
                layers.len()
            ),
        ));
    }
    let schedule = Schedule::new(kind, p, m, v)?;
    if schedule.splits_backward() {
        return Err(Error::invalid(
            what.to_string(),
            format!("{kind:?} is schedule data for simulation: this runtime does not split backward into input and weight gradients yet (use 1F1B or interleaved 1F1B)"),
        ));
    }
    if partition.stages() != p * v {
        return Err(Error::invalid(
            what.to_string(),
            format!("{} parts for {p} stages x {v} chunks (need {})", partition.stages(), p * v),
        ));
    }
    Ok(schedule)
}

fn zero_grads(stages: &[&Stage]) -> Result<()> {
    stages.iter().try_for_each(|s| s.zero_grad())
}

fn summarise(schedule: &Schedule, reports: Vec<runtime::RankReport>, seconds: f64) -> StepReport {
    // the threads' step reads it: its report is for printing
    let loss = reports.iter().filter_map(|r| r.loss.as_ref()).map(|l| l.double_value(&[])).sum();
    let max_in_flight = reports.iter().map(|r| r.max_in_flight).collect();
    let spans: Vec<ActionSpan> = reports.into_iter().flat_map(|r| r.spans).collect();
    let bubble_fraction = trace::bubble_fraction(&spans, schedule.stages);
    StepReport { loss, spans, bubble_fraction, max_in_flight, seconds }
}

/// How a [`PipelineRank`] runs (tch's Config-struct idiom: start from `Default`).
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// Where this rank's chunks live and compute.
    pub device: Device,
    pub schedule: schedule::ScheduleKind,
    /// Microbatches per step (the batch is split into this many).
    pub microbatches: usize,
    /// Chunks (virtual stages) per rank: more than one for interleaved schedules.
    pub chunks: usize,
    /// Keep only each chunk's input per microbatch and recompute its forward in backward.
    pub recompute: bool,
    /// Each chunk built through this plan ([`PipelineRank`] only): its data parallelism across the ranks
    /// that hold the same stage (DDP, FSDP or HSDP; [`ParallelMesh::plan`](crate::parallel_dims::ParallelMesh::plan)
    /// derives it from the degrees) and its tensor-parallel styles for layers built with
    /// `tch_dist::nn::linear` and the rest. The plan's ZeRO-1/2 is refused: shard with FSDP.
    pub plan: Plan,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            device: Device::Cpu,
            schedule: schedule::ScheduleKind::OneFOneB,
            microbatches: 1,
            chunks: 1,
            recompute: false,
            plan: Plan::new(),
        }
    }
}

/// One stage of a pipeline whose stages are processes: this process is `pg.rank()` and holds that
/// stage's chunks. Activations and gradients travel by the group's send/recv.
///
/// ```no_run
/// use tch::nn;
/// use tch_dist::pipeline::{LayerList, Partition, PipelineConfig, PipelineRank};
/// use tch_dist::prelude::*;
/// let world = tch_dist::ProcessGroup::from_env()?;
/// let mesh = ParallelDims { pp: 2, dp_replicate: 2, ..Default::default() }.build(&world)?;
/// let layers = LayerList::new()
///     .add("fc1", |p| nn::linear(p, 8, 16, Default::default()))
///     .add_fn("tanh", |x| x.tanh())
///     .add("fc2", |p| nn::linear(p, 16, 4, Default::default()));
/// // each chunk under DDP across the two ranks holding its stage, as the degrees say
/// let cfg = PipelineConfig { microbatches: 4, plan: mesh.plan(), ..Default::default() };
/// let stage = PipelineRank::build(mesh.pp_group().clone(), &layers, &Partition::sizes(&[2, 1], 3)?, cfg)?;
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub struct PipelineRank {
    chunks: Vec<Stage>,
    schedule: Schedule,
    pg: Arc<ProcessGroup>,
    recompute: bool,
    /// Kept from step to step: it remembers the shapes each transfer carried.
    net: transport::GroupTransport,
}

impl PipelineRank {
    /// Builds this rank's chunks only (virtual stages `c * p + rank`, `cfg.chunks` of them), each through
    /// `cfg.plan`. `partition` has `p * v` parts.
    pub fn build(
        pg: Arc<ProcessGroup>,
        layers: &LayerList,
        partition: &Partition,
        cfg: PipelineConfig,
    ) -> Result<PipelineRank> {
        cfg.plan.mark_applied();
        let p = pg.size();
        let schedule = plan("PipelineRank::build", layers, partition, cfg.schedule, p, cfg.microbatches, cfg.chunks)?;
        if let DataParallelism::Replicate(_, Some(stage)) = cfg.plan.data_parallelism() {
            // ZeRO's optimizer steps DDP's buckets: one model's, not a rank's several chunks
            return Err(Error::invalid(
                "PipelineRank::build",
                format!(
                    "the plan runs ZeRO-{} over DDP, which pipeline chunks do not take: shard them with FSDP \
                     (dp_shard), or replicate without ZeRO",
                    stage.number()
                ),
            ));
        }
        let ranges = partition.ranges();
        let chunks = (0..cfg.chunks)
            .map(|c| layers.build_stage_with(ranges[c * p + pg.rank()].clone(), cfg.device, &cfg.plan))
            .collect::<Result<Vec<_>>>()?;
        // the other ranks hold the other stages' variables: a norm over the model sums over the group
        // (the modules' variables and what the optimizer steps, which are FSDP's shards)
        for s in &chunks {
            for t in s.vs.variables().into_values().chain(s.parameters()) {
                crate::placement::record_along(&t, &pg, crate::placement::Placement::Stage)?;
            }
        }
        let net = transport::GroupTransport::new(pg.clone(), cfg.device);
        Ok(PipelineRank { chunks, schedule, pg, recompute: cfg.recompute, net })
    }

    pub fn var_stores(&self) -> Vec<&nn::VarStore> {
        self.chunks.iter().map(|s| &s.vs).collect()
    }

    /// This rank's chunks.
    pub fn chunks(&self) -> &[Stage] {
        &self.chunks
    }

    /// What the optimizer steps, chunk by chunk: the trainable variables (this rank's shards under FSDP).
    pub fn parameters(&self) -> Vec<Tensor> {
        self.chunks.iter().flat_map(|s| s.parameters()).collect()
    }

    /// Drops this rank's gradients, as [`Pipeline::zero_grad`].
    pub fn zero_grad(&self) -> Result<()> {
        zero_grads(&self.chunks.iter().collect::<Vec<_>>())
    }

    /// This rank's chunks' values by VarStore name (FSDP's gathered: a collective over each chunk's
    /// data-parallel ranks). A pipeline rank is not a [`DistModule`]: its forwards and
    /// backwards run inside [`step`](Self::step), microbatch by microbatch.
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut all = Vec::new();
        for c in &self.chunks {
            all.extend(c.state_dict()?);
        }
        Ok(all)
    }

    /// Gradient synchronisation of every chunk on or off ([`DistModule::set_requires_gradient_sync`]).
    pub fn set_requires_gradient_sync(&self, on: bool) {
        self.chunks.iter().for_each(|c| c.set_requires_gradient_sync(on))
    }

    /// One training step. Every rank passes the same full batch (only the first stage reads `x`, only the
    /// last reads `y`). Returns this rank's report; the loss is known on the rank holding the last stage.
    pub fn step(&mut self, x: &Tensor, y: &Tensor, loss: &LossFn) -> Result<runtime::RankReport> {
        let m = self.schedule.microbatches;
        let inputs = microbatch::split(x, m, "inputs")?;
        let targets = microbatch::split(y, m, "targets")?;
        let step = runtime::RankStep {
            rank: self.pg.rank(),
            schedule: &self.schedule,
            chunks: &self.chunks,
            inputs: &inputs,
            targets: &targets,
            loss,
            recompute: self.recompute,
        };
        runtime::run_rank(&step, &mut self.net)
    }
}
