//! A layer list that can be cut into stages. tch's `nn::Sequential` hides its layers, and a stage's
//! variables must be created on the stage's device, so layers are kept as builders and built per stage,
//! each stage with its own `VarStore`.
//!
//! ```
//! use tch::{nn, Device};
//! use tch_dist::pipeline::{LayerList, Partition};
//! let layers = LayerList::new()
//!     .add("fc1", |p| nn::linear(p, 8, 16, Default::default()))
//!     .add_fn("relu", |x| x.relu())
//!     .add("fc2", |p| nn::linear(p, 16, 4, Default::default()));
//! let stages = layers.build(&Partition::sizes(&[2, 1], 3)?, &[Device::Cpu, Device::Cpu])?;
//! assert_eq!(stages[1].names(), vec!["fc2"]);
//! # Ok::<(), tch_dist::Error>(())
//! ```
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tch::{nn, Device, Kind, Tensor};

use super::partition::Partition;
use crate::dist_module::DistModule;
use crate::error::{Error, Result};
use crate::parallelize::data_parallelism::DataParallelism;
use crate::parallelize::{Parallel, Plan, Unit};

type Builder = Arc<dyn Fn(&nn::Path) -> Box<dyn nn::Module> + Send + Sync>;

/// An ordered list of named layer builders. Layer `i` is built right after `manual_seed(seed + i)`, so
/// its initial values do not depend on how the list is cut (on one kind of device); the generators are
/// put back where they were after each layer is built (`torch.random.fork_rng`), so the program's own
/// draws do not depend on it either. A builder runs while this process's default generators are held
/// (other threads' layer builds wait for it), so it must not wait on another rank.
#[derive(Clone, Default)]
pub struct LayerList {
    layers: Vec<(String, Builder)>,
    seed: i64,
}

/// Consecutive layers built on one device, with their own variables.
pub struct Stage {
    pub vs: nn::VarStore,
    pub device: Device,
    /// Indices of its layers in the list.
    pub range: Range<usize>,
    names: Vec<String>,
    layers: Vec<Box<dyn nn::Module>>,
    /// The plan's data parallelism across the ranks holding the same stage (none for a chunk without
    /// parameters).
    sync: Option<Parallel<()>>,
    /// The user's setting ([`Stage::set_requires_gradient_sync`]): off, no backward of a step reduces.
    requires_sync: AtomicBool,
}

/// See [`Stage::backward_sync`].
pub(crate) struct BackwardSync<'a>(&'a Stage);

/// See [`Stage::keep_gathered`].
pub(crate) struct KeepGathered<'a>(&'a Stage);

impl Drop for KeepGathered<'_> {
    fn drop(&mut self) {
        if let Some(s) = &self.0.sync {
            s.set_reshard_after_backward(true);
        }
    }
}

impl Drop for BackwardSync<'_> {
    fn drop(&mut self) {
        if let Some(s) = &self.0.sync {
            s.set_sync(self.0.requires_gradient_sync());
        }
    }
}

/// A built layer as a module of its own type (for FSDP to wrap).
#[derive(Debug)]
struct Layer(Box<dyn nn::Module>);

impl nn::Module for Layer {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.0.forward(xs)
    }
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stage({:?} on {:?}: {:?})", self.range, self.device, self.names)
    }
}

impl nn::Module for Stage {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.f_forward(xs).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Stage {
    /// The layers in order, inside the stage's DDP or FSDP forward if it has one; errors returned (tch's
    /// `f_` convention).
    pub fn f_forward(&self, xs: &Tensor) -> Result<Tensor> {
        let run = |x: &Tensor| self.layers.iter().fold(x.shallow_clone(), |x, l| l.forward(&x));
        match &self.sync {
            Some(s) => s.chunk_forward(xs, run),
            None => Ok(run(xs)),
        }
    }

    /// For one of the step's backwards: it reduces if it is the `last` and the user allows it; the
    /// user's setting comes back when the guard goes (also when the backward fails).
    pub(crate) fn backward_sync(&self, last: bool) -> BackwardSync<'_> {
        if let Some(s) = &self.sync {
            s.set_sync(last && self.requires_gradient_sync());
            if last {
                s.set_reshard_after_backward(true);
            }
        }
        BackwardSync(self)
    }

    /// For one step: FSDP keeps the units a backward gathered for the microbatches that follow, until
    /// the chunk's last backward ([`backward_sync`](Self::backward_sync)) frees them; the guard turns
    /// resharding back on, also when the step fails, so that the next forward frees what is left.
    pub(crate) fn keep_gathered(&self) -> Result<KeepGathered<'_>> {
        let keep = KeepGathered(self);
        if let Some(s) = &self.sync {
            s.begin_step()?;
        }
        Ok(keep)
    }

    pub fn names(&self) -> Vec<&str> {
        self.names.iter().map(|s| s.as_str()).collect()
    }

    /// Bytes of this stage's trainable variables.
    pub fn param_bytes(&self) -> usize {
        self.vs.trainable_variables().iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }
}

impl LayerList {
    pub fn new() -> Self {
        Self::default()
    }

    /// Base seed for the layers' initial values.
    pub fn seed(mut self, seed: i64) -> Self {
        self.seed = seed;
        self
    }

    /// A layer with variables, created under `path / name`.
    pub fn add<M: nn::Module + 'static>(
        mut self,
        name: &str,
        f: impl Fn(&nn::Path) -> M + Send + Sync + 'static,
    ) -> Self {
        self.layers.push((name.to_string(), Arc::new(move |p: &nn::Path| Box::new(f(p)) as Box<dyn nn::Module>)));
        self
    }

    /// A layer without variables (an activation, a reshape).
    pub fn add_fn(self, name: &str, f: impl Fn(&Tensor) -> Tensor + Send + Sync + Clone + 'static) -> Self {
        self.add(name, move |_| nn::func(f.clone()))
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    pub fn names(&self) -> Vec<&str> {
        self.layers.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Builds layers `range` on `device`.
    pub fn build_stage(&self, range: Range<usize>, device: Device) -> Result<Stage> {
        self.build_stage_with(range, device, &Plan::new())
    }

    /// [`build_stage`](Self::build_stage) through `plan`: its data parallelism across the ranks holding
    /// the same stage, and its tensor-parallel styles for layers built with `tch_dist::nn::linear` (and
    /// the rest). Under FSDP each layer with parameters is sharded as soon as it is built (a unit), so the
    /// whole stage never exists at once.
    pub(crate) fn build_stage_with(&self, range: Range<usize>, device: Device, plan: &Plan) -> Result<Stage> {
        if range.end > self.len() || range.is_empty() {
            return Err(Error::invalid("build_stage", format!("layers {range:?} of a list of {}", self.len())));
        }
        let vs = nn::VarStore::new(device);
        let plan = plan.for_another_model();
        plan.bind(&vs)?;
        // what a builder sees: the plan's styles, no data parallelism (a `tch_dist::nn::unit` inside it
        // stays local: the chunk shards each layer below, outside the generators' hold, as the
        // collectives of sharding wait for other ranks)
        let building = plan.clone().with_data_parallelism(DataParallelism::None);
        let mut layers = Vec::with_capacity(range.len());
        for i in range.clone() {
            let (name, build) = &self.layers[i];
            let path = vs.root() / name.as_str();
            let before = vs.trainable_variables().len();
            let layer = {
                // the process's generators, held from the seed to the last draw (no other thread's draws
                // in between) and put back; sharding below may wait on other ranks, so it runs outside
                let _fork = crate::random::Fork::new()?;
                tch::manual_seed(self.seed + i as i64);
                let _plan = building.enter();
                build(&path)
            };
            layers.push(if vs.trainable_variables().len() > before {
                match plan.unit(&path, Layer(layer))? {
                    Unit::Sharded(u) => Box::new(u) as Box<dyn nn::Module>,
                    Unit::Local(Layer(l)) => l,
                }
            } else {
                layer
            });
        }
        // a chunk of parameter-free layers (activations) has nothing to reduce
        let sync = match vs.trainable_variables().is_empty() {
            true => None,
            false => Some(plan.finish(&vs, ())?),
        };
        let names = self.layers[range.clone()].iter().map(|(n, _)| n.clone()).collect();
        Ok(Stage { vs, device, range, names, layers, sync, requires_sync: AtomicBool::new(true) })
    }

    /// One stage per partition part, stage `s` on `devices[s]`.
    pub fn build(&self, partition: &Partition, devices: &[Device]) -> Result<Vec<Stage>> {
        let total: usize = partition.sizes.iter().sum();
        if total != self.len() {
            return Err(Error::invalid(
                "LayerList::build",
                format!("partition covers {total} layers, the list has {}", self.len()),
            ));
        }
        if devices.len() != partition.stages() {
            return Err(Error::invalid(
                "LayerList::build",
                format!("{} devices for {} stages", devices.len(), partition.stages()),
            ));
        }
        partition.ranges().into_iter().zip(devices).map(|(r, &d)| self.build_stage(r, d)).collect()
    }

    /// Parameter bytes of each layer (built once on the CPU to count).
    pub fn param_bytes(&self) -> Result<Vec<usize>> {
        (0..self.len()).map(|i| Ok(self.build_stage(i..i + 1, Device::Cpu)?.param_bytes())).collect()
    }

    /// Seconds of forward + backward per layer on `sample` (median of `iters` runs), as torchgpipe's
    /// `balance_by_time` profiles: input to cost for [`Partition::balanced`].
    pub fn profile_times(&self, sample: &Tensor, iters: usize) -> Result<Vec<f64>> {
        let stage = self.build_stage(0..self.len(), sample.device())?;
        let mut x = sample.shallow_clone();
        let mut times = Vec::with_capacity(self.len());
        for layer in &stage.layers {
            let inp = x.detach().set_requires_grad(x.is_floating_point());
            let mut runs = Vec::with_capacity(iters.max(1));
            let mut out = Tensor::new();
            for _ in 0..iters.max(1) {
                let t = Instant::now();
                out = layer.forward(&inp);
                if out.requires_grad() {
                    out.f_sum(Kind::Float)?.f_backward()?;
                }
                runs.push(t.elapsed().as_secs_f64());
            }
            runs.sort_by(|a, b| a.total_cmp(b));
            times.push(runs[runs.len() / 2]);
            x = out.detach();
        }
        Ok(times)
    }
}

/// One pipeline chunk, on its own: [`PipelineRank`](super::PipelineRank) drives its data-parallel sync per microbatch.
impl DistModule for Stage {
    /// What the optimizer steps: the trainable variables, which are this rank's shards under FSDP.
    fn parameters(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }
    /// Whether the steps reduce gradients across the stage's data-parallel group, in the last backward
    /// of each (default true; false accumulates them over steps). Nothing to reduce without one.
    fn set_requires_gradient_sync(&self, on: bool) {
        self.requires_sync.store(on, Ordering::Relaxed);
        if let Some(s) = &self.sync {
            s.set_sync(on);
        }
    }
    fn requires_gradient_sync(&self) -> bool {
        self.requires_sync.load(Ordering::Relaxed)
    }
    /// The stage's values by VarStore name, sorted; gathered from the shards under FSDP (collective
    /// then).
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        if let Some(m) = self.sync.as_ref().and_then(Parallel::sharded) {
            return m.gathered_state_dict();
        }
        Ok(crate::var_store::sorted_variables(&self.vs))
    }
    /// Drops the gradients (set to none), the shards' and the parameters' own under FSDP.
    fn zero_grad(&self) -> Result<()> {
        if let Some(m) = self.sync.as_ref().and_then(Parallel::sharded) {
            return m.drop_grads();
        }
        crate::hooks::drop_grads(&self.vs.trainable_variables())
    }
}
