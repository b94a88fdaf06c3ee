//! DistributedDataParallel: data parallelism with gradient buckets reduced while backward runs.
//!
//! ```no_run
//! use tch_dist::prelude::*;
//! use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
//! use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
//! use tch_dist::ProcessGroup;
//! use std::sync::Arc;
//!
//! let pg = Arc::new(ProcessGroup::from_env()?);
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::seq().add(nn::linear(vs.root() / "l1", 10, 32, Default::default()))
//!     .add_fn(|x| x.relu()).add(nn::linear(vs.root() / "l2", 32, 1, Default::default()));
//! let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(pg))?;
//! let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
//! let (x, y) = (Tensor::randn([8, 10], (Kind::Float, Device::Cpu)), Tensor::zeros([8, 1], (Kind::Float, Device::Cpu)));
//! let loss = ddp.forward(&x).mse_loss(&y, tch::Reduction::Mean); // DDP is an nn::Module
//! ddp.backward(&loss)?;   // or loss.backward(): the reduction finishes inside it either way
//! opt.step();
//! opt.zero_grad();        // gradients live in DDP's buckets; tch's zero_grad works on them
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Semantics follow PyTorch's `DistributedDataParallel` (see `reducer.rs`), with one default changed:
//! `gradient_as_bucket_view` is on, so gradients live inside the communication buckets and DDP costs one
//! copy of the parameters, not two.
#[cfg(feature = "testing")]
#[doc(hidden)] // the assignment rules, compared with libtorch's by tests
pub mod bucket;
#[cfg(not(feature = "testing"))]
mod bucket;
pub mod comm_hook;
mod grad_sink;
pub mod join;
mod memory;
pub mod powersgd;
mod reducer;
pub(crate) mod sync;

use std::sync::Arc;

use tch::{nn, Tensor};

pub use comm_hook::{CommHook, GradBucket, HookFuture};
pub(crate) use grad_sink::{BackwardCount, GradSink};
pub use join::JoinOptions;
pub use memory::DdpMemory;
pub use powersgd::{PowerSgd, PowerSgdOptions};
#[cfg(feature = "testing")]
pub use reducer::ReducerEvent;

use crate::dist_module::{DistModule, WithTrain};
use crate::error::{Error, Result};
use crate::group::{ProcessGroup, ReduceOp};
use crate::hooks::GradHook;
use reducer::{Config, Reducer};

/// PyTorch's `_DEFAULT_FIRST_BUCKET_BYTES`.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1024 * 1024;
/// PyTorch's default `bucket_cap_mb`.
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;

/// Options of [`DistributedDataParallel`], named as PyTorch's.
#[derive(Clone, Debug)]
pub struct DdpOptions {
    /// Bucket size limit in MiB; `None` is PyTorch's default, 25.
    pub bucket_cap_mb: Option<f64>,
    /// Limit of the first bucket after the rebuild, in bytes: a small first bucket starts communication
    /// early. `None` is PyTorch 2.13's rule: 1 MiB with the default bucket cap, else the cap itself.
    pub first_bucket_bytes: Option<usize>,
    /// Gradients are views into the buckets (default **true**; PyTorch's default is false).
    pub gradient_as_bucket_view: bool,
    /// Broadcast rank 0's buffers (non-trainable variables) before each forward.
    pub broadcast_buffers: bool,
    /// Parameters that get no gradient in a backward are reduced as zeros instead of stalling.
    pub find_unused_parameters: bool,
    /// How buckets are reduced: `None` is DDP's own allreduce; see [`comm_hook`] for the built-ins
    /// (compression, PowerSGD) and your own.
    pub comm_hook: Option<Arc<dyn CommHook>>,
    /// The group; `None` uses the default one ([`crate::init_process_group`]).
    pub process_group: Option<Arc<ProcessGroup>>,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: None,
            first_bucket_bytes: None,
            gradient_as_bucket_view: true,
            broadcast_buffers: true,
            find_unused_parameters: false,
            comm_hook: None,
            process_group: None,
        }
    }
}

impl DdpOptions {
    pub fn bucket_cap_mb(mut self, mb: f64) -> Self {
        self.bucket_cap_mb = Some(mb);
        self
    }
    pub fn first_bucket_bytes(mut self, b: usize) -> Self {
        self.first_bucket_bytes = Some(b);
        self
    }
    pub fn gradient_as_bucket_view(mut self, on: bool) -> Self {
        self.gradient_as_bucket_view = on;
        self
    }
    pub fn broadcast_buffers(mut self, on: bool) -> Self {
        self.broadcast_buffers = on;
        self
    }
    pub fn find_unused_parameters(mut self, on: bool) -> Self {
        self.find_unused_parameters = on;
        self
    }
    /// PyTorch's `register_comm_hook`: e.g. `comm_hook::fp16_compress()` or `Arc::new(PowerSgd::new(..))`.
    pub fn comm_hook(mut self, h: Arc<dyn CommHook>) -> Self {
        self.comm_hook = Some(h);
        self
    }
    pub fn process_group(mut self, pg: Arc<ProcessGroup>) -> Self {
        self.process_group = Some(pg);
        self
    }

    /// Replicates over the mesh dimension `dim` (as [`FsdpOptions::mesh`](crate::fsdp::FsdpOptions::mesh)
    /// shards over its dimensions): that dimension's group of this rank.
    pub fn mesh(self, mesh: &crate::mesh::DeviceMesh, dim: &str) -> Result<Self> {
        Ok(self.process_group(mesh.group(dim)?))
    }
}

/// A model whose gradients are averaged across the ranks of a process group during backward.
pub struct DistributedDataParallel<M> {
    // First, so it drops first (fields drop in declaration order): the autograd hooks are removed
    // before the reducer they point to (through a weak reference) goes.
    _hooks: Vec<GradHook>,
    module: M,
    reducer: Arc<Reducer>,
    buffers: Vec<Tensor>,
    broadcast_buffers: bool,
    /// Every parameter (frozen ones too) and, with `broadcast_buffers`, the buffers: what construction
    /// copies from rank 0, and what `join` copies from the last rank to finish.
    module_states: Vec<Tensor>,
    /// Every variable by name, sorted: the state dict.
    named: Vec<(String, Tensor)>,
}

/// Trainable variables in creation order with their names, and the other variables (buffers) by name.
fn split_vars(vs: &nn::VarStore) -> (Vec<Tensor>, Vec<String>, Vec<Tensor>) {
    let vars = match vs.variables_.lock() {
        Ok(v) => v,
        Err(e) => e.into_inner(),
    };
    let params: Vec<Tensor> = vars.trainable_variables.iter().map(|v| v.tensor.shallow_clone()).collect();
    let mut named: Vec<(&String, &Tensor)> = vars.named_variables.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    let names = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            named
                .iter()
                .find(|(_, t)| t.data_ptr() == p.data_ptr() && t.size() == p.size())
                .map_or_else(|| format!("param{i}"), |(n, _)| n.to_string())
        })
        .collect();
    let buffers = named
        .iter()
        .filter(|(_, t)| !t.requires_grad())
        .filter(|(_, t)| !params.iter().any(|p| p.data_ptr() == t.data_ptr()))
        .map(|(_, t)| t.shallow_clone())
        .collect();
    (params, names, buffers)
}

impl<M> DistributedDataParallel<M> {
    /// Wraps `module`, whose variables live in `vs`. Checks that all ranks hold the same parameters, then
    /// copies rank 0's parameters and buffers to every rank, allocates the buckets and installs the hooks.
    pub fn new(vs: &nn::VarStore, module: M, opts: DdpOptions) -> Result<Self> {
        let (params, names, buffers) = split_vars(vs);
        let mut ddp = Self::from_parameters(names.into_iter().zip(params).collect(), buffers, module, opts)?;
        ddp.named = crate::var_store::sorted_variables(vs);
        Ok(ddp)
    }

    /// As [`new`](Self::new), with the parameters given explicitly, in the order DDP indexes them. The
    /// order decides bucket layouts: to share a group with PyTorch DDP ranks, pass them in the order of
    /// PyTorch's `model.parameters()` (tch creates a Linear's bias before its weight; PyTorch the other way).
    /// Frozen parameters (`requires_grad` false) are copied from rank 0 and otherwise left alone, as
    /// PyTorch's DDP does.
    pub fn from_parameters(
        named: Vec<(String, Tensor)>,
        buffers: Vec<Tensor>,
        module: M,
        opts: DdpOptions,
    ) -> Result<Self> {
        let pg = match opts.process_group.clone().or_else(crate::init::default_group) {
            Some(pg) => pg,
            None => {
                return Err(Error::invalid(
                    "DistributedDataParallel::new",
                    "no process group: pass DdpOptions::process_group or call init_process_group first",
                ))
            }
        };
        let cap_mb = opts.bucket_cap_mb.unwrap_or(DEFAULT_BUCKET_CAP_MB);
        if !(cap_mb > 0.0 && cap_mb.is_finite()) {
            return Err(Error::invalid(
                "DdpOptions::bucket_cap_mb",
                format!("{cap_mb} is not a positive number of MiB"),
            ));
        }
        let bucket_bytes = ((cap_mb * 1024.0 * 1024.0) as usize).max(1);
        let first = match (opts.first_bucket_bytes, opts.bucket_cap_mb) {
            (Some(b), _) => b,
            (None, None) => DEFAULT_FIRST_BUCKET_BYTES,
            (None, Some(_)) => bucket_bytes,
        };
        // As PyTorch: every parameter starts from rank 0's value, but only those that require grad (not
        // frozen) are checked, bucketed and reduced.
        let mut states: Vec<Tensor> = named.iter().map(|(_, p)| p.shallow_clone()).collect();
        let all: Vec<(String, Tensor)> = named
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .chain(buffers.iter().enumerate().map(|(i, b)| (format!("buffer{i}"), b.shallow_clone())))
            .collect();
        // a parameter whose ranks hold different parts over this group (an expert spread over it) is
        // neither checked, broadcast nor bucketed: its layer's collectives sum its gradient over the
        // ranks, and the reducer divides it as the average would
        // Nor is one whose layer named the ranks holding the same part beside another group it is sliced
        // over (experts repeated over data-parallel ranks): its gradient is summed over those ranks at
        // the end of backward, then divided likewise.
        let replicas = |p: &Tensor| crate::placement::of(p).and_then(|l| l.replicas_beside(&pg));
        let partial_here =
            |p: &Tensor| crate::placement::of(p).is_some_and(|l| l.is_partial_over(&pg)) || replicas(p).is_some();
        let (partial, named): (Vec<_>, Vec<_>) = named.into_iter().partition(|(_, p)| partial_here(p));
        let partial: Vec<(String, Tensor)> = partial.into_iter().filter(|(_, p)| p.requires_grad()).collect();
        // by group of replicas: its parameters, named
        type Named = Vec<(String, Tensor)>;
        let mut summed: Vec<(Arc<ProcessGroup>, Named)> = Vec::new();
        for (name, p) in &partial {
            let Some((q, sliced)) = replicas(p) else { continue };
            if q.size() * sliced != pg.size() {
                return Err(Error::invalid(
                    "DistributedDataParallel::new",
                    format!(
                        "{name} is sliced over {sliced} ranks and repeated over the {} of group {}: together {} \
                         ranks, but DDP's group has {}",
                        q.size(),
                        q.name(),
                        q.size() * sliced,
                        pg.size()
                    ),
                ));
            }
            match summed.iter_mut().find(|(g, _)| Arc::ptr_eq(g, &q)) {
                Some((_, ps)) => ps.push((name.clone(), p.shallow_clone())),
                None => summed.push((q, vec![(name.clone(), p.shallow_clone())])),
            }
        }
        if !summed.is_empty() && opts.comm_hook.is_some() {
            return Err(Error::invalid(
                "DistributedDataParallel::new",
                format!(
                    "a communication hook would not see {}'s gradient, which is summed over its replicas apart \
                     from the buckets: leave the hook out",
                    summed[0].1[0].0
                ),
            ));
        }
        let partial: Vec<Tensor> = partial.into_iter().map(|(_, p)| p).collect();
        states.retain(|s| !partial_here(s));
        let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().filter(|(_, p)| p.requires_grad()).unzip();
        if params.is_empty() {
            return Err(Error::invalid(
                "DistributedDataParallel::new",
                "no parameter requires grad: DDP has nothing to synchronise (every parameter is frozen, or the VarStore is empty)",
            ));
        }
        sync::verify_params(&pg, &params, &names)?;
        if opts.broadcast_buffers {
            states.extend(buffers.iter().map(|b| b.shallow_clone()));
        }
        sync::broadcast_coalesced(&pg, &states, sync::BROADCAST_BUCKET_BYTES, 0)?;
        // the ranks that hold the same experts start alike too, and hold them in the same shapes
        for (q, named) in &summed {
            let (names, ps): (Vec<String>, Vec<Tensor>) =
                named.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).unzip();
            sync::verify_params(q, &ps, &names)?;
            sync::broadcast_coalesced(q, &ps, sync::BROADCAST_BUCKET_BYTES, 0)?;
        }
        let summed: Vec<(Arc<ProcessGroup>, Vec<Tensor>)> =
            summed.into_iter().map(|(q, named)| (q, named.into_iter().map(|(_, p)| p).collect())).collect();
        for p in &params {
            crate::placement::record_along(p, &pg, crate::placement::Placement::Replicate)?;
        }
        let cfg = Config {
            world: pg.size(),
            bucket_view: opts.gradient_as_bucket_view,
            find_unused: opts.find_unused_parameters,
            first_bucket_bytes: first.max(1),
            bucket_bytes,
            comm_hook: opts.comm_hook,
        };
        let reducer = Reducer::new(pg, cfg, params, names, partial, summed)?;
        let hooks = reducer.install_hooks()?;
        Ok(DistributedDataParallel {
            _hooks: hooks,
            module,
            reducer,
            buffers,
            broadcast_buffers: opts.broadcast_buffers,
            module_states: states,
            named: all,
        })
    }

    /// Runs `f` on the wrapped module as a forward pass: first finishes the bookkeeping PyTorch does
    /// before forward (bucket rebuild after the first iteration, buffer broadcast).
    pub fn forward_with<T>(&self, f: impl FnOnce(&M) -> T) -> Result<T> {
        let _s = crate::timeline::span("forward", || "DDP forward".into());
        self.prepare_for_forward()?;
        Ok(f(&self.module))
    }

    /// PyTorch's `_pre_forward`, collective for collective (so a joined rank can shadow it, and a PyTorch
    /// rank can share the group): [join: "not joined yet"], bucket rebuild, buffer broadcast, [join:
    /// whether this iteration synchronises].
    fn prepare_for_forward(&self) -> Result<()> {
        let sync = self.reducer.begin_forward()?;
        let join = self.reducer.join_options();
        if let Some(j) = &join {
            let meta = self.pg().meta_as_pytorch(self.device());
            let active = meta.allreduce("DDP join: ranks still training", &[1f32], ReduceOp::Sum)?[0];
            if j.throw_on_early_termination {
                let joined = meta.allreduce("DDP join: early termination", &[0f32], ReduceOp::Sum)?[0];
                if joined > 0.0 {
                    return Err(join::exhausted(self.pg(), "another rank ran out of inputs"));
                }
            }
            let divisor = if j.divide_by_initial_world_size { self.pg().size() as f64 } else { active as f64 };
            self.reducer.set_divisor(divisor);
        }
        self.reducer.check_forward_loop()?;
        self.reducer.rebuild_if_due(false)?;
        self.sync_buffers(join.is_some(), true)?;
        if join.is_some() {
            let meta = self.pg().meta_as_pytorch(self.device());
            meta.allreduce("DDP join: backward sync", &[sync as i32 as f32], ReduceOp::Sum)?;
        }
        self.reducer.set_forward_param_sync(sync);
        Ok(())
    }

    /// Broadcasts the buffers if the previous iteration synchronised (PyTorch's
    /// `require_forward_param_sync`): from rank 0, or in join mode from the highest rank still training.
    pub(crate) fn sync_buffers(&self, joining: bool, training: bool) -> Result<()> {
        if !(self.broadcast_buffers && !self.buffers.is_empty() && self.reducer.forward_param_sync()) {
            return Ok(());
        }
        let root = if joining { join::common_rank(self, training)? } else { 0 };
        sync::broadcast_coalesced(self.pg(), &self.buffers, sync::BROADCAST_BUCKET_BYTES, root)
    }

    fn pg(&self) -> &ProcessGroup {
        &self.reducer.pg
    }

    /// Where the parameters live (PyTorch's DDP keeps its own bookkeeping tensors there).
    fn device(&self) -> tch::Device {
        self.module_states.first().map_or(tch::Device::Cpu, |t| t.device())
    }

    /// Gradient synchronisation on or off ([`DistModule::set_requires_gradient_sync`]).
    pub(crate) fn set_sync(&self, on: bool) {
        self.reducer.set_sync(on);
    }

    pub fn module(&self) -> &M {
        &self.module
    }

    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.reducer.pg
    }

    /// [`DistModule::parameters`].
    pub(crate) fn params(&self) -> Vec<Tensor> {
        self.reducer
            .state
            .lock()
            .map(|s| s.params.iter().chain(&s.partial).map(|p| p.shallow_clone()).collect())
            .unwrap_or_default()
    }

    /// Parameter names per bucket, in bucket (launch) order.
    pub fn bucket_layout(&self) -> Vec<Vec<String>> {
        match self.reducer.state.lock() {
            Ok(s) => s.buckets.iter().map(|b| b.params.iter().map(|&i| s.names[i].clone()).collect()).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// What the reducer did during the last synchronised backward, in order (for tests).
    #[cfg(feature = "testing")]
    pub fn last_events(&self) -> Vec<ReducerEvent> {
        self.reducer.state.lock().map(|s| s.events.clone()).unwrap_or_default()
    }

    /// Whether buckets were rebuilt from the observed gradient order (for tests).
    #[cfg(feature = "testing")]
    pub fn buckets_rebuilt(&self) -> bool {
        self.reducer.state.lock().map(|s| s.rebuilt).unwrap_or(false)
    }
}

impl<M: nn::Module> DistributedDataParallel<M> {
    /// The wrapped module's forward, with DDP's bookkeeping first; errors are returned (tch's `f_`
    /// convention). [`nn::Module::forward`] is the same, panicking on error.
    pub fn f_forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_with(|m| m.forward(xs))
    }
}

impl<M: nn::ModuleT> DistributedDataParallel<M> {
    /// The wrapped module's forward with a train flag, DDP's bookkeeping first, errors returned. Works for
    /// every model, also those that are only `ModuleT` (dropout, batch norm);
    /// [`forward_t`](Self::forward_t) panics instead.
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with(|m| m.forward_t(xs, train))
    }

    /// [`f_forward_t`](Self::f_forward_t), panicking on error as tch's infallible methods do. (For a
    /// model that is a `Module`, the DDP wrapper is a `Module`, and so a `ModuleT`; Rust's coherence rules
    /// forbid implementing `ModuleT` for the `ModuleT`-only models as well, hence this method.)
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// DDP over a `Module` is a `Module` (and, through tch's blanket impl, a `ModuleT`): it goes wherever tch
/// expects one. `forward` panics on error, as tch's infallible methods do; use
/// [`f_forward`](DistributedDataParallel::f_forward) to get the error instead.
impl<M: nn::Module> nn::Module for DistributedDataParallel<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.f_forward(xs).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: std::fmt::Debug> std::fmt::Debug for DistributedDataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (params, buckets) = self.reducer.state.lock().map(|s| (s.params.len(), s.buckets.len())).unwrap_or((0, 0));
        f.debug_struct("DistributedDataParallel")
            .field("group", &self.reducer.pg)
            .field("parameters", &params)
            .field("buckets", &buckets)
            .field("gradient_as_bucket_view", &self.reducer.cfg.bucket_view)
            .field("find_unused_parameters", &self.reducer.cfg.find_unused)
            .field("module", &self.module)
            .finish()
    }
}

impl<M: nn::ModuleT> nn::ModuleT for DistributedDataParallel<WithTrain<M>> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M> DistModule for DistributedDataParallel<M> {
    /// The parameters, in the order DDP indexes them, then those spread over its group (experts), which
    /// it does not bucket.
    fn parameters(&self) -> Vec<Tensor> {
        self.params()
    }
    /// Whether the next backwards reduce gradients (default true); false accumulates them locally
    /// (PyTorch's `require_backward_grad_sync`).
    fn set_requires_gradient_sync(&self, on: bool) {
        self.set_sync(on)
    }
    fn requires_gradient_sync(&self) -> bool {
        self.reducer.sync()
    }
    /// Every variable (parameters and buffers) by its VarStore name, sorted; the same on every rank.
    /// (Through `from_parameters`, buffers are named `buffer0`, `buffer1`, ...)
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.named.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect())
    }
    /// The gradient reduction is finished when it returns.
    fn backward(&self, loss: &Tensor) -> Result<()> {
        let _s = crate::timeline::span("backward", || "DDP backward".into());
        loss.f_backward()?;
        Ok(())
    }
}
