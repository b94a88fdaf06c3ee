//! Fully sharded data parallelism (ZeRO stage 3; PyTorch's FSDP2 `fully_shard`): each rank keeps 1/N of
//! every parameter, of its gradient and (so) of the optimizer state. A unit's parameters are gathered
//! just before its forward and freed after it, gathered again just before its backward, and their
//! gradients are reduce-scattered into the owners' shards as soon as the unit's backward is done.
//!
//! Wrap each layer or block as a unit, then the whole model as the root, which takes the parameters no
//! unit took (`fully_shard(layer)` for each layer, then `fully_shard(model)`, in PyTorch's words). Units
//! are chosen by the [`nn::Path`] their variables were created under, the way tch names variables:
//!
//! ```no_run
//! use tch_dist::prelude::*;
//! use std::sync::Arc;
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! use tch_dist::fsdp::{FsdpBuilder, FsdpOptions};
//! use tch_dist::optim::{AdamW, Optimizer};
//! let pg = Arc::new(tch_dist::ProcessGroup::from_env()?);
//! let vs = nn::VarStore::new(Device::Cpu);
//! let fsdp = FsdpBuilder::new(&vs, FsdpOptions::default().process_group(pg))?;
//! let mut net = nn::seq();
//! for i in 0..24 {
//!     let path = vs.root() / format!("layer{i}");
//!     let layer = nn::linear(&path, 1024, 1024, Default::default());
//!     net = net.add(fsdp.fully_shard(&path, layer)?).add_fn(|x| x.relu()); // sharded at once
//! }
//! let model = fsdp.finish(net)?;
//! let mut opt = AdamW::new(model.parameters(), 1e-3); // this rank's shards
//! let x = Tensor::randn([16, 1024], (Kind::Float, Device::Cpu));
//! model.backward(&model.forward(&x).square().mean(Kind::Float))?;
//! opt.step()?;
//! model.zero_grad()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! - **Optimizer**: [`parameters`](FullyShardedDataParallel::parameters) are this rank's shards, one flat
//!   tensor per parameter (FSDP2's per-parameter sharding), with `.grad` set after a synchronised
//!   backward: any optimizer over tensors steps them. [`finish`](FsdpBuilder::finish) also puts them in
//!   the VarStore's trainable variables, in their optimizer groups, so tch's own optimizers built over
//!   the VarStore after it (`nn::AdamW::default().build(&vs, lr)`, weight-decay groups included) step
//!   them too; clip with [`crate::optim::clip_grad_norm`] over them, not tch's.
//! - **Mixed precision** ([`FsdpOptions::param_dtype`]): units compute in bfloat16 or float16 while the
//!   shards, their gradients and the optimizer state stay float32.
//! - **Memory**: per rank, 16Ψ/N bytes with AdamW (4 for the shard, 4 its gradient, 8 the moments), plus
//!   the units gathered at once (the one computing and up to `prefetch` ahead), one unit's gradients, and
//!   the activations. `scripts/bench-memory.sh` measures it next to PyTorch's FSDP2.
//! - **Rules**: every rank builds the same units in the same order and runs them in the same order; a
//!   parameter belongs to one unit (tie weights inside one); a unit's parameters share a dtype and device,
//!   and are all trainable or all frozen.
mod flat_param;
mod memory;
mod replicas;
mod runtime;
mod state_dict;
mod unit;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tch::{nn, Device, Kind, Tensor};

pub use memory::FsdpMemory;
pub use replicas::Replicas;
pub use unit::FsdpUnit;

use crate::dist_module::{DistModule, WithTrain};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::hooks::{self, GradHook};
use crate::mesh::DeviceMesh;
use flat_param::FlatParam;
use runtime::{Config, Role, Runtime};

/// Options of FSDP, named after PyTorch's `fully_shard` arguments where they exist.
#[derive(Clone, Debug)]
pub struct FsdpOptions {
    /// Free each unit's gathered parameters after its forward and gather them again for its backward
    /// (default true, as FSDP2); false keeps them from forward to backward: one all-gather fewer per
    /// unit, the whole model's parameters at the peak. The root keeps them either way.
    pub reshard_after_forward: bool,
    /// The dtype units compute in (FSDP2's `MixedPrecisionPolicy.param_dtype`); `None`: the parameters'.
    pub param_dtype: Option<Kind>,
    /// The dtype gradients are reduce-scattered in; `None`: the compute dtype (FSDP2's default).
    pub reduce_dtype: Option<Kind>,
    /// Units gathered ahead of the one computing, in forward and in backward (default 1; 0: none).
    pub prefetch: usize,
    /// Where the shards, their gradients and so the optimizer state live, when not with the parameters:
    /// e.g. `Device::Cpu` while the units compute on a GPU (DeepSpeed's `offload_optimizer`).
    pub offload: Option<Device>,
    /// Start every rank from rank 0's parameters: one broadcast per unit when it is built (default true).
    pub sync_module_states: bool,
    /// Parameters with fewer elements than this, in a unit that also holds larger ones, leave it for one
    /// unit of small parameters that is gathered once per iteration, at the model's forward, kept until
    /// the end of backward, and reduce-scattered then. Where a unit's parameters travel one collective
    /// each (Gloo), a linear layer then costs one all-gather, not one for its weight and one for its
    /// bias, and its backward one reduce-scatter: each is a round trip however small. They stay sharded
    /// between iterations, with their gradients and optimizer state; the cost is the small parameters
    /// gathered through the iteration (a few per layer). `None` (the default): 2^14 where parameters
    /// travel one by one, 0 (off) under NCCL's rules, where a unit is one collective already and the
    /// small unit would only add its own. `Some(0)` turns it off. DeepSpeed's
    /// `stage3_param_persistence_threshold` (there they are not sharded at all).
    pub gather_once_below: Option<usize>,
    /// The group the parameters are sharded over; `None` uses the default one
    /// ([`crate::init_process_group`]).
    pub process_group: Option<Arc<ProcessGroup>>,
    /// HSDP (hybrid sharding): the group of replicas, each holding the same shards, whose gradients are
    /// summed after the reduce-scatter. `None`: plain FSDP. Set both with [`FsdpOptions::mesh`].
    pub replicate_group: Option<Arc<ProcessGroup>>,
    /// HSDP across replicas that are not one fixed group: fault tolerance's
    /// [`Manager::fsdp_replicas`](crate::ft::Manager::fsdp_replicas), whose members change from step to
    /// step. Set this or `replicate_group`, not both.
    pub replicas: Option<Arc<dyn Replicas>>,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            reshard_after_forward: true,
            param_dtype: None,
            reduce_dtype: None,
            prefetch: 1,
            offload: None,
            sync_module_states: true,
            gather_once_below: None,
            process_group: None,
            replicate_group: None,
            replicas: None,
        }
    }
}

impl FsdpOptions {
    pub fn reshard_after_forward(mut self, on: bool) -> Self {
        self.reshard_after_forward = on;
        self
    }
    pub fn param_dtype(mut self, kind: Kind) -> Self {
        self.param_dtype = Some(kind);
        self
    }
    pub fn reduce_dtype(mut self, kind: Kind) -> Self {
        self.reduce_dtype = Some(kind);
        self
    }
    pub fn prefetch(mut self, units: usize) -> Self {
        self.prefetch = units;
        self
    }
    pub fn offload(mut self, device: Device) -> Self {
        self.offload = Some(device);
        self
    }
    pub fn sync_module_states(mut self, on: bool) -> Self {
        self.sync_module_states = on;
        self
    }
    pub fn gather_once_below(mut self, numel: usize) -> Self {
        self.gather_once_below = Some(numel);
        self
    }
    pub fn process_group(mut self, pg: Arc<ProcessGroup>) -> Self {
        self.process_group = Some(pg);
        self
    }
    pub fn replicate_group(mut self, pg: Arc<ProcessGroup>) -> Self {
        self.replicate_group = Some(pg);
        self
    }
    pub fn replicas(mut self, replicas: Arc<dyn Replicas>) -> Self {
        self.replicas = Some(replicas);
        self
    }

    /// The groups from mesh dimensions, as PyTorch's `fully_shard(mesh=...)`: one dimension shards over
    /// it (FSDP); two, `[replicate, shard]`, shard within the second and replicate across the first
    /// (HSDP).
    ///
    /// ```no_run
    /// # use tch_dist::{fsdp::FsdpOptions, mesh::DeviceMesh, ProcessGroup};
    /// let world = ProcessGroup::from_env()?;
    /// let mesh = DeviceMesh::new(&world, &[("replicate", 2), ("shard", 4)])?;
    /// let opts = FsdpOptions::default().mesh(&mesh, &["replicate", "shard"])?;
    /// # Ok::<(), tch_dist::Error>(())
    /// ```
    pub fn mesh(mut self, mesh: &DeviceMesh, dims: &[&str]) -> Result<Self> {
        match dims {
            [shard] => {
                self.process_group = Some(mesh.group(shard)?);
                self.replicate_group = None;
            }
            [replicate, shard] if replicate != shard => {
                self.process_group = Some(mesh.group(shard)?);
                self.replicate_group = Some(mesh.group(replicate)?);
            }
            _ => {
                return Err(Error::invalid(
                    "FsdpOptions::mesh",
                    format!("{dims:?}: name one mesh dimension to shard over, or two, [replicate, shard]"),
                ))
            }
        }
        Ok(self)
    }
}

/// Shards a model unit by unit as it is built (see the module docs).
pub struct FsdpBuilder {
    rt: Arc<Runtime>,
    vars: Arc<Mutex<nn::Variables>>,
    opts: FsdpOptions,
    /// Variables already in a unit, by name.
    claimed: Mutex<HashSet<String>>,
    /// Where each of them is in the VarStore's list of trainable variables, for its shard to take its
    /// place there when the model is finished.
    places: Mutex<Vec<(String, usize)>>,
    /// Parameters the units left for the units of small parameters ([`FsdpOptions::gather_once_below`]),
    /// sharded when the model is finished.
    small: Mutex<Vec<(String, Tensor)>>,
}

fn floating(k: Kind) -> bool {
    matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}

impl FsdpBuilder {
    pub fn new(vs: &nn::VarStore, opts: FsdpOptions) -> Result<FsdpBuilder> {
        let pg = match opts.process_group.clone().or_else(crate::init::default_group) {
            Some(pg) => pg,
            None => {
                return Err(Error::invalid(
                    "FsdpBuilder::new",
                    "no process group: pass FsdpOptions::process_group or call init_process_group first",
                ))
            }
        };
        for (what, k) in [("param_dtype", opts.param_dtype), ("reduce_dtype", opts.reduce_dtype)] {
            if let Some(k) = k.filter(|&k| !floating(k)) {
                return Err(Error::invalid("FsdpOptions", format!("{what} {k:?} is not a floating-point dtype")));
            }
        }
        let replicate: Option<Arc<dyn Replicas>> = match (&opts.replicate_group, &opts.replicas) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "FsdpOptions",
                    "both replicate_group and replicas are set: HSDP reduces across one or the other",
                ))
            }
            (Some(g), None) => Some(Arc::new(replicas::ReplicateGroup(g.clone()))),
            (None, r) => r.clone(),
        };
        if let Some(r) = &opts.replicate_group {
            if Arc::ptr_eq(r, &pg) {
                return Err(Error::invalid(
                    "FsdpOptions::replicate_group",
                    "is the shard group itself: HSDP replicates across a group apart from the one it shards over",
                ));
            }
            // replicas hold the same shards only if each has this rank's place in a shard group of this size
            let mine = [pg.rank() as i64, pg.size() as i64];
            r.meta().agree("HSDP: the replicas' places in their shard groups", &mine, |rows| {
                let listing = crate::group::meta::by_rank(rows, |v| format!("rank {} of {}", v[0], v[1]), "; ");
                format!(
                    "the replicate group's ranks must hold the same place in shard groups of one size, as a \
                     mesh's [replicate, shard] dimensions give (FsdpOptions::mesh): {listing}"
                )
            })?;
        }
        let cfg = Config {
            reshard_after_forward: opts.reshard_after_forward,
            prefetch: opts.prefetch,
            reduce_dtype: opts.reduce_dtype,
        };
        Ok(FsdpBuilder {
            rt: Arc::new(Runtime::new(pg, replicate, cfg)),
            vars: vs.variables_.clone(),
            opts,
            claimed: Mutex::new(HashSet::new()),
            places: Mutex::new(Vec::new()),
            small: Mutex::new(Vec::new()),
        })
    }

    /// The trainable variables (frozen ones included, buffers not) under `prefixes` (all of them when
    /// `None`) that no unit has taken yet, sorted by name.
    fn take(&self, prefixes: Option<&[String]>) -> Vec<(String, Tensor)> {
        let vars = self.vars.lock().unwrap_or_else(|e| e.into_inner());
        let mut claimed = self.claimed.lock().unwrap_or_else(|e| e.into_inner());
        let trainable: Vec<&Tensor> = vars.trainable_variables.iter().map(|v| &v.tensor).collect();
        let is_param = |t: &Tensor| trainable.iter().any(|p| p.data_ptr() == t.data_ptr() && p.size() == t.size());
        let under = |name: &str| match prefixes {
            None => true,
            Some(ps) => ps.iter().any(|p| name == p || name.starts_with(&format!("{p}."))),
        };
        let mut out: Vec<(String, Tensor)> = vars
            .named_variables
            .iter()
            .filter(|(n, t)| under(n) && !claimed.contains(*n) && is_param(t))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        claimed.extend(out.iter().map(|(n, _)| n.clone()));
        let mut places = self.places.lock().unwrap_or_else(|e| e.into_inner());
        let mut placed: HashSet<usize> = places.iter().map(|p| p.1).collect();
        for (n, t) in &out {
            let at = vars.trainable_variables.iter().enumerate().position(|(k, v)| {
                v.tensor.data_ptr() == t.data_ptr() && v.tensor.size() == t.size() && !placed.contains(&k)
            });
            if let Some(k) = at {
                placed.insert(k);
                places.push((n.clone(), k));
            }
        }
        out
    }

    /// Shards the variables in `named` as one unit; returns its index and the hooks on its parameters.
    fn add_unit(&self, name: &str, named: Vec<(String, Tensor)>, role: Role) -> Result<(usize, Vec<GradHook>)> {
        let pg = &self.rt.pg;
        let numel: i64 = named.iter().map(|(_, t)| t.numel() as i64).sum();
        // one collective per unit under NCCL's rules (FSDP2's), else one per parameter unless they are
        // small (rings of sends straight into place, without the copies in and out of one buffer)
        let coalesced = role == Role::Small || named.first().is_some_and(|(_, t)| pg.nccl_rules(t.device()));
        let mine = [named.len() as i64, numel, coalesced as i64];
        // over the replicas too (HSDP): their reductions pair chunk by chunk, and every rank posts the
        // same collectives (one ranks's strict mode or engine apart would pair one message with many)
        for g in std::iter::once(pg).chain(self.rt.replicate.as_ref().and_then(|r| r.group())) {
            g.meta().agree(&format!("FSDP unit {name}"), &mine, |rows| {
                let show = |r: &[i64]| {
                    let how = if r[2] == 1 { "one collective" } else { "a collective per parameter" };
                    format!("{} parameters, {} elements, {how}", r[0], r[1])
                };
                let listing = crate::group::meta::by_rank(rows, show, "; ");
                format!("ranks built different units here ({listing}){}", crate::group::meta::odd_ones_out(g, rows))
            })?;
        }
        let settings = flat_param::Settings {
            compute: self.opts.param_dtype,
            shard_device: self.opts.offload,
            sync: self.opts.sync_module_states,
            coalesced,
            replicate: self.rt.replicate.clone(),
        };
        let flat = FlatParam::new(pg, name, named, settings)?;
        let params: Vec<Tensor> = flat.slots.iter().map(|s| s.param.shallow_clone()).collect();
        let id = self.rt.add_unit(name.to_string(), flat, role)?;
        // registered while the parameters have their shapes and compute dtype (their accumulators keep them)
        let hooks = unit::grad_hooks(&self.rt, id, &params)?;
        // the root too (FSDP2's root is sharded until its first forward): only the small parameters'
        // units stay gathered from the start
        if role != Role::Small {
            self.rt.reshard(id)?;
        }
        Ok((id, hooks))
    }

    /// PyTorch's `fully_shard(module)`: the trainable variables under `path` (not in a unit yet) become
    /// one unit, sharded at once. Build a layer, shard it, build the next: the full model never exists.
    pub fn fully_shard<M>(&self, path: &nn::Path, module: M) -> Result<FsdpUnit<M>> {
        let prefix: Vec<&str> = path.components().collect();
        self.fully_shard_paths(&[prefix.join(".")], module)
    }

    /// [`fully_shard`](Self::fully_shard) of a module whose variables lie under several prefixes
    /// (variable names as the VarStore has them, e.g. `"blocks.3"`).
    pub fn fully_shard_paths<M>(&self, prefixes: &[String], module: M) -> Result<FsdpUnit<M>> {
        let name = prefixes.join("+");
        if prefixes.iter().any(|p| p.is_empty()) {
            return Err(Error::invalid("fully_shard", "an empty path is the whole model: use FsdpBuilder::finish"));
        }
        let named = self.take(Some(prefixes));
        if named.is_empty() {
            return Err(Error::invalid(
                "fully_shard",
                format!("no parameters under {name} (none were created there, or another unit has them)"),
            ));
        }
        // one collective per unit already under NCCL's rules: a small unit would only add its own
        let one_message = named.first().is_some_and(|(_, t)| self.rt.pg.nccl_rules(t.device()));
        let below = self.opts.gather_once_below.unwrap_or(if one_message { 0 } else { 1 << 14 });
        let (small, big): (Vec<_>, Vec<_>) = named.into_iter().partition(|(_, t)| t.numel() < below);
        let named = if big.is_empty() {
            small // a unit of small parameters only stays as it is
        } else {
            self.small.lock().unwrap_or_else(|e| e.into_inner()).extend(small);
            big
        };
        let (id, hooks) = self.add_unit(&name, named, Role::Layer)?;
        Ok(FsdpUnit::new(module, self.rt.clone(), id, hooks))
    }

    /// Whether this builder shards the variables of `vs`.
    pub(crate) fn shards(&self, vs: &nn::VarStore) -> bool {
        Arc::ptr_eq(&self.vars, &vs.variables_)
    }

    /// Refuses a tch optimizer built over the VarStore before the model is finished. tch's
    /// `OptimizerConfig::build` keeps a handle on the VarStore's variables (the only holder besides the
    /// VarStore and this builder) and gives libtorch's optimizer the tensors there at that moment: the
    /// modules' own parameters, which FSDP leaves without gradients, so it would silently train nothing.
    /// Built after `finish`, it steps the shards. (One built over a VarStore still empty would work too;
    /// it is refused alike, as nothing tells the two apart.)
    pub(crate) fn check_no_optimizer_yet(&self, what: &str) -> Result<()> {
        let holders = Arc::strong_count(&self.vars).saturating_sub(2);
        if holders > 0 {
            return Err(Error::invalid(
                what,
                format!(
                    "{holders} other handle(s) on the VarStore's variables, as an nn::Optimizer built before the \
                     model is finished keeps: such an optimizer steps the modules' own parameters, which FSDP \
                     leaves without gradients, and nothing would train. Build it after finish (it then steps \
                     this rank's shards, in their optimizer groups)"
                ),
            ));
        }
        Ok(())
    }

    /// Groups consecutive layers into units of at least `min_numel` parameters (PyTorch's size-based
    /// auto-wrap policy), for models built as a sequence.
    pub fn auto_wrap(&self, min_numel: i64) -> AutoWrap<'_> {
        AutoWrap { fsdp: self, min_numel, seq: nn::seq(), group: nn::seq(), prefixes: Vec::new(), numel: 0 }
    }

    /// PyTorch's `fully_shard(model)` on the whole model: the variables no unit took form the root unit,
    /// whose parameters stay gathered from forward to backward. Returns the model to train.
    ///
    /// The small parameters units left ([`FsdpOptions::gather_once_below`]) form units of their own here,
    /// named `small` (`small.1`, ... when they differ in dtype, device or trainability), before the root.
    pub fn finish<M>(self, module: M) -> Result<FullyShardedDataParallel<M>> {
        self.check_no_optimizer_yet("FsdpBuilder::finish")?;
        let mut hooks = Vec::new();
        let small = std::mem::take(&mut *self.small.lock().unwrap_or_else(|e| e.into_inner()));
        for (i, group) in group_alike(small).into_iter().enumerate() {
            let name = if i == 0 { "small".to_string() } else { format!("small.{i}") };
            let (_, h) = self.add_unit(&name, group, Role::Small)?;
            hooks.extend(h);
        }
        let rest = self.take(None);
        let root = if rest.is_empty() {
            None
        } else {
            let (id, h) = self.add_unit("root", rest, Role::Root)?;
            hooks.extend(h);
            Some(id)
        };
        if self.rt.len() == 0 {
            return Err(Error::invalid("FsdpBuilder::finish", "the VarStore has no trainable variables"));
        }
        self.publish_shards();
        self.rt.record_placements()?;
        self.rt.mark_finished();
        Ok(FullyShardedDataParallel { _hooks: hooks, module, rt: self.rt, root, vars: self.vars })
    }

    /// As FSDP2's parameters after `fully_shard`: the VarStore's trainable variables become this rank's
    /// shards, each keeping its optimizer group, so that an optimizer built over the VarStore from now on
    /// (tch's `nn::AdamW::default().build(&vs, lr)`, its weight-decay groups included) steps what the
    /// reductions fill. The named variables (`vs.variables()`) stay the modules' own parameters, which
    /// are empty between uses.
    fn publish_shards(&self) {
        let shards: std::collections::HashMap<String, Tensor> = self.rt.shards().into_iter().collect();
        let places = std::mem::take(&mut *self.places.lock().unwrap_or_else(|e| e.into_inner()));
        let mut vars = self.vars.lock().unwrap_or_else(|e| e.into_inner());
        for (name, k) in places {
            if let (Some(shard), Some(var)) = (shards.get(&name), vars.trainable_variables.get_mut(k)) {
                var.tensor = shard.shallow_clone();
            }
        }
    }
}

/// `named` in groups that can share a unit (one dtype, device and trainability), in order of first
/// appearance, each sorted by name.
fn group_alike(named: Vec<(String, Tensor)>) -> Vec<Vec<(String, Tensor)>> {
    type Key = (Kind, Device, bool);
    let mut groups: Vec<(Key, Vec<(String, Tensor)>)> = Vec::new();
    for (n, t) in named {
        let key = (t.kind(), t.device(), t.requires_grad());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push((n, t)),
            None => groups.push((key, vec![(n, t)])),
        }
    }
    groups
        .into_iter()
        .map(|(_, mut g)| {
            g.sort_by(|a, b| a.0.cmp(&b.0));
            g
        })
        .collect()
}

/// A sequence of layers grouped into units by size (see [`FsdpBuilder::auto_wrap`]).
pub struct AutoWrap<'a> {
    fsdp: &'a FsdpBuilder,
    min_numel: i64,
    seq: nn::Sequential,
    group: nn::Sequential,
    prefixes: Vec<String>,
    numel: i64,
}

impl AutoWrap<'_> {
    /// Adds a layer whose variables lie under `path`.
    pub fn add<M: nn::Module + 'static>(mut self, path: &nn::Path, layer: M) -> Result<Self> {
        let prefix = path.components().collect::<Vec<_>>().join(".");
        let vars = self.fsdp.vars.lock().unwrap_or_else(|e| e.into_inner());
        self.numel += vars
            .named_variables
            .iter()
            .filter(|(n, _)| n.starts_with(&format!("{prefix}.")))
            .map(|(_, t)| t.numel() as i64)
            .sum::<i64>();
        drop(vars);
        self.prefixes.push(prefix);
        self.group = self.group.add(layer);
        if self.numel >= self.min_numel {
            self.close()?;
        }
        Ok(self)
    }

    /// Adds a function without parameters (an activation).
    pub fn add_fn(mut self, f: impl Fn(&Tensor) -> Tensor + Send + 'static) -> Self {
        self.group = self.group.add_fn(f);
        self
    }

    fn close(&mut self) -> Result<()> {
        let group = std::mem::replace(&mut self.group, nn::seq());
        let prefixes = std::mem::take(&mut self.prefixes);
        self.numel = 0;
        let seq = std::mem::replace(&mut self.seq, nn::seq());
        self.seq =
            if prefixes.is_empty() { seq.add(group) } else { seq.add(self.fsdp.fully_shard_paths(&prefixes, group)?) };
        Ok(())
    }

    /// The sequence; layers left over form a last unit.
    pub fn build(mut self) -> Result<nn::Sequential> {
        self.close()?;
        Ok(self.seq)
    }
}

/// A model trained with fully sharded data parallelism (see the module docs).
pub struct FullyShardedDataParallel<M> {
    _hooks: Vec<GradHook>,
    module: M,
    rt: Arc<Runtime>,
    root: Option<usize>,
    vars: Arc<Mutex<nn::Variables>>,
}

impl<M> FullyShardedDataParallel<M> {
    /// Runs `f` on the model as a forward of this iteration (for models that are not an `nn::Module`).
    pub fn forward_with(&self, x: &Tensor, f: impl FnOnce(&M, &Tensor) -> Tensor) -> Result<Tensor> {
        let _s = crate::timeline::span("forward", || "FSDP forward".into());
        self.rt.begin_iteration()?;
        let y = match self.root {
            Some(id) => unit::forward(&self.rt, id, x, |x| f(&self.module, x))?,
            None => f(&self.module, x),
        };
        if !y.requires_grad() {
            // no backward will wait for the shards' copies to the GPU before a host optimizer, or a
            // load, writes the shards: the host waits now (with pinned offload only)
            self.rt.wait_for_pinned_copies()?;
            return Ok(y);
        }
        let weak = std::sync::Arc::downgrade(&self.rt);
        let (y, _) = hooks::backward_marker(&y, "FsdpBeginBackward", move || match weak.upgrade() {
            Some(rt) => rt.begin_backward(),
            None => Err(Error::invalid("FSDP backward", "the FSDP model was dropped before its backward")),
        })?;
        Ok(y)
    }

    /// This rank's shards ([`DistModule::parameters`]).
    pub(crate) fn shards(&self) -> Vec<Tensor> {
        self.rt.shards().into_iter().map(|(_, t)| t).collect()
    }

    /// [`DistModule::parameters`] with their parameters' VarStore names (for per-parameter
    /// optimizer options, e.g. no weight decay on biases).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.rt.shards()
    }

    /// Drops the gradients (shards' and, after `no_sync`, the parameters' own): PyTorch's
    /// `zero_grad(set_to_none=True)`, the memory back until the next backward.
    pub(crate) fn drop_grads(&self) -> Result<()> {
        self.rt.for_each(|_, _, fp| {
            for s in &fp.slots {
                hooks::set_grad(&s.shard, None)?;
                hooks::set_grad(&s.param, None)?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Gradient reduction on or off ([`DistModule::set_requires_gradient_sync`]).
    pub(crate) fn set_sync(&self, on: bool) {
        self.rt.set_sync(on);
    }

    /// Whether a backward frees the units it gathered (default true). Off, they stay gathered for the
    /// forwards and backwards that follow, with no step between them: a pipeline step's microbatches
    /// (FSDP2's `set_reshard_after_backward`; pipelining turns it off until the last backward). A
    /// backward that reduces frees its units anyway, as its reduction takes their buffers; turning it
    /// on again frees the rest at the next forward.
    pub fn set_reshard_after_backward(&self, on: bool) {
        self.rt.set_reshard_after_backward(on);
    }

    pub fn reshard_after_backward(&self) -> bool {
        self.rt.reshard_after_backward()
    }

    /// Frees every gathered unit now (after a forward without backward, e.g. in evaluation, the root keeps
    /// its parameters until the next forward).
    pub fn reshard(&self) -> Result<()> {
        for u in 0..self.rt.len() {
            self.rt.reshard(u)?;
        }
        Ok(())
    }

    pub fn module(&self) -> &M {
        &self.module
    }

    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.rt.pg
    }

    /// The units' names (their path prefixes; "root" for the rest), in the order of
    /// [`DistModule::parameters`].
    pub fn units(&self) -> Vec<String> {
        self.rt.unit_names()
    }
}

impl<M: nn::Module> FullyShardedDataParallel<M> {
    /// The model's forward, errors returned (tch's `f_` convention).
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, |m, x| m.forward(x))
    }
}

impl<M: nn::ModuleT> FullyShardedDataParallel<M> {
    /// The model's forward with a train flag, errors returned (tch's `f_` convention).
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with(x, |m, x| m.forward_t(x, train))
    }

    /// [`f_forward_t`](Self::f_forward_t), panicking on error as tch's infallible methods do.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(x, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::Module> nn::Module for FullyShardedDataParallel<M> {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.f_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: std::fmt::Debug> std::fmt::Debug for FullyShardedDataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShardedDataParallel")
            .field("group", &self.rt.pg)
            .field("units", &self.rt.unit_names())
            .field("module", &self.module)
            .finish()
    }
}

impl<M: nn::ModuleT> nn::ModuleT for FullyShardedDataParallel<WithTrain<M>> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M> DistModule for FullyShardedDataParallel<M> {
    /// This rank's shards of the parameters, unit by unit in the order units were built: what the
    /// optimizer steps. Each is a flat tensor (this rank's 1/N of one parameter, possibly empty); after a
    /// synchronised backward it has its `.grad`, this rank's part of the averaged gradient.
    fn parameters(&self) -> Vec<Tensor> {
        self.shards()
    }
    /// Whether the next backwards reduce-scatter gradients (default true); false accumulates them
    /// unsharded (FSDP2's `set_requires_gradient_sync`).
    fn set_requires_gradient_sync(&self, on: bool) {
        self.set_sync(on)
    }
    fn requires_gradient_sync(&self) -> bool {
        self.rt.sync()
    }
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        self.gathered_state_dict()
    }
    /// The shards' gradients and, after `no_sync`, the parameters' own.
    fn zero_grad(&self) -> Result<()> {
        self.drop_grads()
    }
    /// Every gradient is reduce-scattered into its shard when it returns.
    fn backward(&self, loss: &Tensor) -> Result<()> {
        let _s = crate::timeline::span("backward", || "FSDP backward".into());
        loss.f_backward()?;
        Ok(())
    }
}
