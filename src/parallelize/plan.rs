//! The plan: a tensor-parallel group and a style per path pattern, and the model's data parallelism.
use std::sync::{Arc, Mutex};

use tch::nn;

use super::data_parallelism::DataParallelism;
use super::layers::{BatchNorm, Embedding, Linear};
use super::parallel::{Parallel, Unit};
use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::error::{Error, Result};
use crate::fsdp::{FsdpBuilder, FsdpOptions};
use crate::group::ProcessGroup;
use crate::mesh::DeviceMesh;
use crate::names::closest;
use crate::optim::Optimizer;
use crate::tp::layers::dotted;
use crate::tp::VocabParallelEmbedding;
use crate::tp::{ColumnParallelConfig, ColumnParallelLinear, RowParallelConfig, RowParallelLinear};
use crate::zero::ZeroStage;

/// How a layer is split over the tensor-parallel group (PyTorch's `ParallelStyle`).
#[derive(Clone, Copy, Debug)]
pub enum Style {
    /// A linear layer's output features split ([`ColumnParallelLinear`]). Its `linear` field is not
    /// read: the model's own `nn::LinearConfig` is.
    Colwise(ColumnParallelConfig),
    /// A linear layer's input features split ([`RowParallelLinear`]); on an embedding, its rows, i.e.
    /// the vocabulary ([`VocabParallelEmbedding`]), as PyTorch's `RowwiseParallel` on `nn.Embedding`.
    Rowwise(RowParallelConfig),
}

impl Style {
    fn name(&self) -> &'static str {
        match self {
            Style::Colwise(_) => "column-wise",
            Style::Rowwise(_) => "row-wise",
        }
    }

    /// Columns split, each rank keeping its output features (for a row-wise layer after it, or a
    /// vocabulary-parallel loss).
    pub fn colwise() -> Style {
        Style::Colwise(Default::default())
    }

    /// Rows split, the input already split (after a column-wise layer), the output summed.
    pub fn rowwise() -> Style {
        Style::Rowwise(Default::default())
    }

    /// Column-wise, for a fused projection: the output features are `parts` equal blocks side by side
    /// (a fused QKV: 3; SwiGLU's fused gate and up: 2), each split on its own as Megatron lays them out.
    /// Each rank's output holds its slice of every block in order, so the model's own
    /// `qkv.chunk(3, -1)` gives its queries, keys and values (with `-1` heads in their views).
    pub fn colwise_fused(parts: usize) -> Style {
        Style::Colwise(ColumnParallelConfig { parts, ..Default::default() })
    }

    /// Column-wise on a layer whose name looks fused (`qkv`, `c_attn`, ...) but is not: one block.
    pub fn colwise_unfused() -> Style {
        Style::Colwise(ColumnParallelConfig { parts: 1, ..Default::default() })
    }
}

/// How layers come from a plan, for errors that found none built through it.
const NOT_ENTERED: &str = "no layer was built through the plan: build the model inside plan.build(&vs, || ..), or \
    while the plan is entered and its guard held (`let _plan = plan.enter();`; `let _ = plan.enter();` drops it at \
    once), with tch_dist::nn::linear / batch_norm2d / embedding (or plan.linear ..), not tch::nn::linear";

/// Names that fused projections go by (GPT-2's `c_attn`, `qkv`, `in_proj`, GPT-NeoX's
/// `query_key_value`, `gate_up_proj`, `w13`): a plain column-wise split of one mixes its blocks.
fn looks_fused(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path).to_ascii_lowercase();
    ["qkv", "c_attn", "in_proj", "query_key_value", "gate_up", "w13", "fused"].iter().any(|n| last.contains(n))
}

/// Which layer each path gets, and how the whole model is data-parallel (see the module docs). Cheap to
/// clone (the clones share the FSDP units being built); no communication but where FSDP shards.
#[derive(Clone, Default)]
pub struct Plan {
    tp: Option<Arc<ProcessGroup>>,
    styles: Vec<(String, Style)>,
    dp: DataParallelism,
    /// Under FSDP, the units being built (shared by the plan's clones).
    units: Arc<Mutex<Units>>,
    /// The group batch-normalization layers take their statistics over, when they synchronise.
    sync_bn: Option<Arc<ProcessGroup>>,
    /// The dotted paths of the layers built through the plan (shared by its clones): what `finish`
    /// checks every style pattern against.
    built: Arc<Mutex<Vec<String>>>,
    /// Batch norms built through the plan (shared by its clones): `finish` refuses a `sync_batch_norm`
    /// that none took.
    batch_norms: Arc<std::sync::atomic::AtomicUsize>,
    /// A pattern that matches no layer is accepted (one plan for several models).
    unmatched_ok: bool,
    /// Says so when the last clone of a data-parallel plan goes without `finish` having run.
    watch: Arc<Unfinished>,
}

/// Whether a data-parallel plan was finished. A forgotten `finish` leaves DDP's model unwrapped (its
/// gradients never averaged) with no error anywhere: the plan's end says it.
#[derive(Default)]
struct Unfinished {
    data_parallel: std::sync::atomic::AtomicBool,
    finished: std::sync::atomic::AtomicBool,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.data_parallel.load(Relaxed) && !self.finished.load(Relaxed) && !std::thread::panicking() {
            eprintln!(
                "tch-dist: warning: a parallelize::Plan with data parallelism (replicate or fully_shard) ended \
                 without plan.finish(&vs, model) (or plan.build): its model was never wrapped, so its gradients \
                 were never averaged across ranks"
            );
        }
    }
}

/// The warning for an FSDP model whose only unit is the root (no block built as a unit).
fn one_unit_warning(units: &[String]) -> Option<String> {
    (units == ["root"]).then(|| {
        "tch-dist: warning: the plan shards the model (FSDP), but no block went through tch_dist::nn::unit (or \
         plan.unit): the whole model is one unit, gathered whole for every forward and backward, so a rank holds \
         as much as the unsharded model while it computes; build each block as nn::unit(&path, block) \
         (docs/porting.md)"
            .to_string()
    })
}

/// FSDP's units of the plan's model: the builder, made when the plan meets the model's VarStore
/// ([`Plan::fully_shard`], [`Plan::build`], [`Plan::finish`]) and taken by `finish`. The lock is held only
/// to take a handle: never across the builder's collectives.
#[derive(Default)]
enum Units {
    #[default]
    Unbound,
    Building(Arc<FsdpBuilder>),
    Finished,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dp = self.dp.name();
        f.debug_struct("Plan")
            .field("tp", &self.tp)
            .field("styles", &self.styles)
            .field("data_parallel", &dp)
            .field("sync_batch_norm", &self.sync_bn)
            .finish()
    }
}

/// `pattern` against a dotted path: `*` matches any run of characters (dots included), as fnmatch on
/// PyTorch's module names.
fn matches(pattern: &str, path: &str) -> bool {
    let (p, s) = (pattern.as_bytes(), path.as_bytes());
    // classic two-pointer glob with backtracking to the last star
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < s.len() {
        if i < p.len() && p[i] == b'*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if i < p.len() && p[i] == s[j] {
            i += 1;
            j += 1;
        } else if let Some(k) = star {
            i = k + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == b'*')
}

impl Plan {
    /// No parallelism in the layers: every path gets tch's own layer.
    pub fn new() -> Plan {
        Plan::default()
    }

    /// Tensor parallelism over the mesh dimension `dim`.
    pub fn tensor_parallel(mesh: &DeviceMesh, dim: &str) -> Result<Plan> {
        Ok(Plan::over_group(mesh.group(dim)?))
    }

    /// Tensor parallelism over `pg`.
    pub fn over_group(pg: Arc<ProcessGroup>) -> Plan {
        Plan { tp: Some(pg), ..Plan::default() }
    }

    /// Data parallelism by DDP (PyTorch's `replicate`): [`finish`](Self::finish) wraps the model in
    /// [`DistributedDataParallel`] over the options' group. A ZeRO stage set before stays.
    pub fn replicate(mut self, opts: DdpOptions) -> Plan {
        // a ZeRO stage set before stays (a new replicate changes DDP's options only)
        let zero = match &self.dp {
            DataParallelism::Replicate(_, zero) => *zero,
            _ => None,
        };
        self.dp = DataParallelism::Replicate(opts, zero);
        self.watch.data_parallel.store(true, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// ZeRO over the data-parallel ranks (DeepSpeed's `zero_optimization.stage`; see [`ZeroStage`]):
    /// after [`replicate`](Self::replicate), stage 1 or 2 shard the optimizer over DDP's buckets, so the
    /// model is built with its optimizer ([`build_with_optimizer`](Self::build_with_optimizer)); stage 3
    /// is [`fully_shard`](Self::fully_shard), which this names after it. A stage
    /// the chosen data parallelism cannot give is refused, naming the call that gives it.
    pub fn zero(mut self, stage: ZeroStage) -> Result<Plan> {
        let refuse = |why: &str| Err(Error::invalid("Plan::zero", format!("ZeRO-{}: {why}", stage.number())));
        match (&mut self.dp, stage) {
            (DataParallelism::None, _) => return refuse(
                "choose the data parallelism first: Plan::replicate (stages 1 and 2) or Plan::fully_shard (stage 3)",
            ),
            (DataParallelism::Replicate(..), ZeroStage::Three) => {
                return refuse("stage 3 shards the parameters: Plan::fully_shard(FsdpOptions), not replicate")
            }
            (DataParallelism::Replicate(_, zero), _) => *zero = Some(stage),
            (DataParallelism::Shard(_), ZeroStage::Three) => {}
            (DataParallelism::Shard(_), _) => {
                return refuse(
                    "fully_shard shards parameters, gradients and optimizer state (stage 3); stages 1 and 2 \
                     shard over DDP: Plan::replicate",
                )
            }
        }
        Ok(self)
    }

    /// Data parallelism by FSDP, or HSDP with a replicate group (PyTorch's `fully_shard`, e.g. with
    /// [`FsdpOptions::mesh`]), over the variables of the VarStore the model is built in
    /// ([`build`](Self::build) gives it; spelled out, [`bind`](Self::bind)): each block the model passes
    /// to [`unit`](Self::unit) is sharded as soon as it is built, and [`finish`](Self::finish) makes the
    /// rest the root. The VarStore's trainable variables become this rank's shards, so tch's optimizers
    /// built over it after `finish` step them. Given to a pipeline
    /// ([`PipelineConfig::plan`](crate::pipeline::PipelineConfig::plan)), each chunk is sharded so.
    pub fn fully_shard(self, opts: FsdpOptions) -> Result<Plan> {
        if let DataParallelism::Replicate(_, Some(stage)) = &self.dp {
            return Err(Error::invalid(
                "Plan::fully_shard",
                format!(
                    "the plan runs ZeRO-{} over DDP; FSDP is ZeRO-3 (a plan has one data parallelism)",
                    stage.number()
                ),
            ));
        }
        Ok(self.with_data_parallelism(DataParallelism::Shard(opts)))
    }

    /// The plan with `dp` as its data parallelism, nothing of the model built yet.
    pub(crate) fn with_data_parallelism(mut self, dp: DataParallelism) -> Plan {
        if dp.is_some() {
            self.watch.data_parallel.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.dp = dp;
        self.units = Arc::default();
        self
    }

    /// The plan's data parallelism, as a pipeline applies it to each of its chunks.
    pub(crate) fn data_parallelism(&self) -> &DataParallelism {
        &self.dp
    }

    /// The plan was applied (to a pipeline's chunks, each through a plan of its own): its end need not
    /// warn that it was never finished.
    pub(crate) fn mark_applied(&self) {
        self.watch.finished.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The same plan for one more model (a pipeline chunk, in its own VarStore): its styles, groups and
    /// data parallelism, nothing built yet. A style may match layers of other chunks only.
    pub(crate) fn for_another_model(&self) -> Plan {
        Plan {
            tp: self.tp.clone(),
            styles: self.styles.clone(),
            dp: self.dp.clone(),
            sync_bn: self.sync_bn.clone(),
            unmatched_ok: true,
            ..Plan::default()
        }
    }

    /// The VarStore the model is built in, for a plan that shards: [`build`](Self::build) and
    /// [`finish`](Self::finish) give it themselves, and a model built under [`enter`](Self::enter) with
    /// [`unit`](Self::unit)s needs it first. Once per plan (the same VarStore again is no-op); nothing to
    /// do for other plans. With HSDP, a collective over the replicate group.
    pub fn bind(&self, vs: &nn::VarStore) -> Result<()> {
        let DataParallelism::Shard(opts) = &self.dp else { return Ok(()) };
        let held = |units: &Units| match units {
            Units::Unbound => Ok(false),
            Units::Building(b) if b.shards(vs) => Ok(true),
            Units::Building(_) => Err(Error::invalid(
                "Plan",
                "the VarStore is not the one the plan's FSDP shards (the first given to Plan::bind, build or \
                 finish): the model's variables must live there",
            )),
            Units::Finished => Err(finished("Plan::finish")),
        };
        if held(&self.units.lock().unwrap_or_else(|e| e.into_inner()))? {
            return Ok(());
        }
        // made without the lock: with HSDP, FsdpBuilder::new agrees with the replicas (a collective)
        let builder = FsdpBuilder::new(vs, opts.clone())?;
        let mut units = self.units.lock().unwrap_or_else(|e| e.into_inner());
        if !held(&units)? {
            *units = Units::Building(Arc::new(builder));
        }
        Ok(())
    }

    /// A block of the model (a transformer block, as torchtitan shards each): an FSDP unit of the
    /// variables under `path` when the plan shards, else `module` as it is. Call it right after
    /// building the block, so that the whole model never exists on one rank.
    pub fn unit<M>(&self, path: &nn::Path, module: M) -> Result<Unit<M>> {
        if !matches!(self.dp, DataParallelism::Shard(_)) {
            return Ok(Unit::Local(module));
        }
        let builder = match &*self.units.lock().unwrap_or_else(|e| e.into_inner()) {
            Units::Building(b) => b.clone(),
            Units::Finished => return Err(finished("Plan::unit")),
            Units::Unbound => {
                return Err(Error::invalid(
                    "Plan::unit",
                    "the plan shards, but was given no VarStore yet: build the model with plan.build(&vs, || ..), \
                     or call plan.bind(&vs) before entering the plan",
                ))
            }
        };
        Ok(Unit::Sharded(builder.fully_shard(path, module)?))
    }

    /// The model, built in `vs` through this plan, as it trains: under DDP, FSDP or HSDP, as the plan
    /// says, or as it is. Once per plan under FSDP.
    ///
    /// Every style pattern must have matched a layer built through the plan (`plan.linear`,
    /// `plan.embedding`), or this is an error naming the pattern and the closest paths: a pattern that
    /// matches nothing would leave that layer whole on every rank and say nothing.
    ///
    /// With a tensor-parallel group, the variables it does not split must hold the same values on its
    /// ranks (built from one seed), or this is an error naming the first that differs: collective over
    /// that group.
    ///
    /// A plan with ZeRO-1/2 is refused: its optimizer is part of the layout, so the model comes with it
    /// from [`finish_with_optimizer`](Self::finish_with_optimizer).
    pub fn finish<M>(&self, vs: &nn::VarStore, model: M) -> Result<Parallel<M>> {
        self.watch.finished.store(true, std::sync::atomic::Ordering::Relaxed);
        self.check_optimizer_apart("Plan::finish")?;
        self.wrap(vs, model)
    }

    /// [`finish`](Self::finish), and the optimizer for the layout, `make` building it over what it
    /// updates: the parameters (none, DDP), this rank's shard of each of DDP's buckets (ZeRO-1/2: one
    /// optimizer per shard inside a [`ShardedOptimizer`](crate::zero::ShardedOptimizer), sharding
    /// from the first step), or FSDP's shards. Whatever the layout, clip with the optimizer's
    /// [`clip_grad_norm`](crate::optim::Optimizer::clip_grad_norm) and end each step with its
    /// [`zero_grad`](crate::optim::Optimizer::zero_grad).
    pub fn finish_with_optimizer<M>(
        &self,
        vs: &nn::VarStore,
        model: M,
        make: impl Fn(Vec<tch::Tensor>) -> Box<dyn Optimizer + Send>,
    ) -> Result<(Parallel<M>, Box<dyn Optimizer + Send>)> {
        self.watch.finished.store(true, std::sync::atomic::Ordering::Relaxed);
        let model = self.wrap(vs, model)?;
        let opt = model.optimizer(make)?;
        Ok((model, opt))
    }

    /// Under ZeRO-1/2 the optimizer is built with the model: a model wrapped alone would train as
    /// unsharded DDP until one was, and say nothing.
    pub(super) fn check_optimizer_apart(&self, op: &str) -> Result<()> {
        match &self.dp {
            DataParallelism::Replicate(_, Some(stage)) => {
                // the error says what to call: no warning about an unfinished plan after it
                self.watch.finished.store(true, std::sync::atomic::Ordering::Relaxed);
                Err(Error::invalid(
                    op,
                    format!(
                        "the plan shards the optimizer (ZeRO-{}), which is part of the layout: build the model with \
                     it, plan.build_with_optimizer(&vs, || model, |params| Box::new(AdamW::new(params, lr))) \
                     (or finish_with_optimizer)",
                        stage.number()
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// The model under the plan's data parallelism (see [`finish`](Self::finish)).
    fn wrap<M>(&self, vs: &nn::VarStore, model: M) -> Result<Parallel<M>> {
        self.check_styles_matched(vs)?;
        self.check_batch_norms_built()?;
        if let Some(pg) = self.tp_group() {
            super::replicas::check_agree(vs, pg)?;
        }
        match &self.dp {
            DataParallelism::None => {
                let named = crate::var_store::sorted_variables(vs);
                Ok(Parallel::Local { module: model, trainable: vs.trainable_variables(), named })
            }
            DataParallelism::Replicate(opts, zero) => {
                let ddp = DistributedDataParallel::new(vs, model, opts.clone())?;
                Ok(match zero {
                    None => Parallel::Ddp(ddp),
                    Some(stage) => Parallel::Zero { ddp, stage: *stage },
                })
            }
            DataParallelism::Shard(_) => {
                self.bind(vs)?;
                let builder = {
                    // checked before it is taken: a refused call leaves the plan as it was
                    let mut units = self.units.lock().unwrap_or_else(|e| e.into_inner());
                    let held = match std::mem::take(&mut *units) {
                        Units::Building(held) => held,
                        other => {
                            *units = other;
                            return Err(finished("Plan::finish"));
                        }
                    };
                    if let Err(e) = held.check_no_optimizer_yet("Plan::finish") {
                        *units = Units::Building(held);
                        return Err(e);
                    }
                    match Arc::try_unwrap(held) {
                        Ok(builder) => {
                            *units = Units::Finished;
                            builder
                        }
                        Err(shared) => {
                            *units = Units::Building(shared);
                            return Err(Error::invalid(
                                "Plan::finish",
                                "another thread is building a unit of this plan's model",
                            ));
                        }
                    }
                };
                let fsdp = builder.finish(model)?;
                // allowed, as in FSDP2 (fully_shard on the root alone), but rarely meant: said once
                let pg = fsdp.process_group();
                if let Some(w) = one_unit_warning(&fsdp.units()).filter(|_| pg.global_rank(pg.rank()) == Some(0)) {
                    eprintln!("{w}");
                }
                Ok(Parallel::Fsdp(fsdp))
            }
        }
    }

    /// Batch normalization built through the plan takes its training statistics over `pg` (a
    /// [`SyncBatchNorm`](crate::sync_batch_norm::SyncBatchNorm); PyTorch's `convert_sync_batchnorm`), as a
    /// rule the data-parallel group. A group of one rank keeps tch's layer.
    pub fn sync_batch_norm(mut self, pg: Arc<ProcessGroup>) -> Plan {
        self.sync_bn = Some(pg);
        self
    }

    /// tch's `nn::batch_norm1d` / `2d` / `3d` (`nd` = 1, 2, 3) at `path`, or its synchronised form when
    /// the plan says so ([`sync_batch_norm`](Self::sync_batch_norm)); the same variables either way.
    pub fn batch_norm(
        &self,
        path: &nn::Path,
        nd: usize,
        out_dim: i64,
        config: nn::BatchNormConfig,
    ) -> Result<BatchNorm> {
        if !(1..=3).contains(&nd) {
            return Err(Error::invalid(
                "Plan::batch_norm",
                format!("{}: {nd} spatial dimensions (batch norm has 1, 2 or 3)", dotted(path)),
            ));
        }
        self.batch_norms.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(match (&self.sync_bn, nd) {
            (Some(pg), _) if pg.size() > 1 => {
                BatchNorm::Sync(crate::sync_batch_norm::SyncBatchNorm::new(path, nd, out_dim, config, pg.clone()))
            }
            (_, 1) => BatchNorm::Local(nn::batch_norm1d(path, out_dim, config)),
            (_, 2) => BatchNorm::Local(nn::batch_norm2d(path, out_dim, config)),
            (_, _) => BatchNorm::Local(nn::batch_norm3d(path, out_dim, config)),
        })
    }

    /// The layers whose path (VarStore names, dotted: `"block3.mlp.fc"`) matches `pattern` take `style`;
    /// the first pattern that matches a path decides it.
    pub fn style(mut self, pattern: &str, style: Style) -> Plan {
        self.styles.push((pattern.to_string(), style));
        self
    }

    /// Style patterns that match no layer are accepted by [`finish`](Self::finish) (one plan written
    /// for several models); by default each is an error.
    pub fn allow_unmatched_styles(mut self) -> Plan {
        self.unmatched_ok = true;
        self
    }

    /// Every style pattern matched a layer built through the plan (see [`finish`](Self::finish)).
    /// A `sync_batch_norm` that no batch norm took: the model's would use each rank's own statistics.
    fn check_batch_norms_built(&self) -> Result<()> {
        // one plan for several models (allow_unmatched_styles): some have no batch norm
        let syncs = self.sync_bn.as_ref().is_some_and(|pg| pg.size() > 1) && !self.unmatched_ok;
        if syncs && self.batch_norms.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return Err(Error::invalid(
                "Plan::finish",
                format!(
                    "the plan synchronises batch norms (sync_batch_norm), but no batch norm was built through it, so \
                     the model's would normalise with each rank's own statistics; {NOT_ENTERED}"
                ),
            ));
        }
        Ok(())
    }

    fn check_styles_matched(&self, vs: &nn::VarStore) -> Result<()> {
        if self.unmatched_ok {
            return Ok(());
        }
        let built = self.built.lock().unwrap_or_else(|e| e.into_inner()).clone();
        // the layers the VarStore has (its variables' paths less their last name), whether or not the plan
        // built them: a pattern that matches one the plan did not build names a layer made another way
        let mut layers: Vec<String> =
            vs.variables().into_keys().filter_map(|n| n.rsplit_once('.').map(|(l, _)| l.to_string())).collect();
        layers.sort();
        layers.dedup();
        // every pattern that matched nothing, each with the paths it may have meant
        let unmatched: Vec<(String, String)> = self
            .styles
            .iter()
            .filter(|(pattern, _)| !built.iter().any(|path| matches(pattern, path)))
            .map(|(pattern, style)| {
                let near = match layers.iter().find(|l| matches(pattern, l)) {
                    Some(l) => format!(
                        "the VarStore has a layer at {l}, not built through the plan: made by hand or with tch's \
                         nn::linear, where tch_dist::nn::linear (or plan.linear) would split it"
                    ),
                    None => format!("the closest layer paths are {}", closest(pattern, &built).join(", ")),
                };
                (format!("{pattern:?} ({})", style.name()), near)
            })
            .collect();
        let what = match &unmatched[..] {
            [] => return Ok(()),
            [(one, _)] => {
                format!(
                    "the style pattern {one} matched no layer built through the plan, so tensor parallelism would \
                     leave that layer whole on every rank"
                )
            }
            many => format!(
                "{} style patterns ({}) matched no layer built through the plan, so tensor parallelism would leave \
                 those layers whole on every rank",
                many.len(),
                many.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>().join(", ")
            ),
        };
        let hint = if built.is_empty() {
            NOT_ENTERED.to_string()
        } else {
            let near: Vec<String> = unmatched.iter().map(|(p, c)| format!("for {p}: {c}")).collect();
            near.join("; ")
        };
        Err(Error::invalid(
            "Plan::finish",
            format!(
                "{what}; {hint} (patterns match dotted VarStore paths, `*` any run of characters; \
                 Plan::allow_unmatched_styles accepts this)"
            ),
        ))
    }

    /// [`style`](Self::style) for each pattern of `patterns`, in order.
    pub fn styles(self, patterns: &[&str], style: Style) -> Plan {
        patterns.iter().fold(self, |plan, p| plan.style(p, style))
    }

    /// The tensor-parallel group, when it has more than one rank.
    pub fn tp_group(&self) -> Option<&Arc<ProcessGroup>> {
        self.tp.as_ref().filter(|g| g.size() > 1)
    }

    /// Ranks in the tensor-parallel group (1 without one).
    pub fn tp_size(&self) -> usize {
        self.tp_group().map_or(1, |g| g.size())
    }

    /// The style for `path` and the group it splits over, when the layer is split.
    fn style_of(&self, path: &nn::Path) -> Option<(Style, Arc<ProcessGroup>)> {
        let name = dotted(path);
        self.built.lock().unwrap_or_else(|e| e.into_inner()).push(name.clone());
        let pg = self.tp_group()?;
        self.styles.iter().find(|(p, _)| matches(p, &name)).map(|(_, s)| (*s, pg.clone()))
    }

    /// `nn::linear(path, in_dim, out_dim, config)`, split as the plan says for `path`: with the same
    /// values on the whole as tch's layer after the same seed.
    pub fn linear(&self, path: &nn::Path, in_dim: i64, out_dim: i64, config: nn::LinearConfig) -> Result<Linear> {
        Ok(match self.style_of(path) {
            None => Linear::Local(nn::linear(path, in_dim, out_dim, config)),
            Some((Style::Colwise(c), _)) if c.parts == 0 && looks_fused(&dotted(path)) => {
                return Err(Error::invalid(
                    "Plan::linear",
                    format!(
                        "{}: the name says a fused projection, and a plain column-wise split would give each rank a \
                         mix of its blocks (for a fused QKV: some rows of q, k and v, not its heads of each); use \
                         Style::colwise_fused(3) for queries, keys and values side by side (2 for a fused gate and \
                         up), or Style::colwise_unfused() if the layer is not fused",
                        dotted(path)
                    ),
                ));
            }
            Some((Style::Colwise(c), pg)) => Linear::Column(ColumnParallelLinear::new(
                path,
                in_dim,
                out_dim,
                pg,
                ColumnParallelConfig { linear: config, ..c },
            )?),
            Some((Style::Rowwise(c), pg)) => Linear::Row(RowParallelLinear::new(
                path,
                in_dim,
                out_dim,
                pg,
                RowParallelConfig { linear: config, ..c },
            )?),
        })
    }

    /// `nn::embedding(path, num, dim, config)`, split as the plan says for `path` (row-wise: the
    /// vocabulary).
    pub fn embedding(&self, path: &nn::Path, num: i64, dim: i64, config: nn::EmbeddingConfig) -> Result<Embedding> {
        Ok(match self.style_of(path) {
            None => Embedding::Local(nn::embedding(path, num, dim, config)),
            Some((Style::Rowwise(_), pg)) => Embedding::Vocab(VocabParallelEmbedding::new(path, num, dim, pg, config)?),
            Some((Style::Colwise(_), _)) => {
                return Err(Error::invalid(
                    "Plan::embedding",
                    format!("{}: an embedding splits row-wise (its vocabulary), not column-wise", dotted(path)),
                ));
            }
        })
    }

    /// Per-token cross-entropy of logits from a column-wise layer (each rank's slice of the vocabulary,
    /// [`crate::tp::vocab_parallel_cross_entropy`]); without tensor parallelism, of whole logits.
    pub fn cross_entropy(&self, logits: &tch::Tensor, targets: &tch::Tensor) -> Result<tch::Tensor> {
        match self.tp_group() {
            Some(pg) => crate::tp::vocab_parallel_cross_entropy(logits, targets, pg),
            None => {
                let v = logits.size().last().copied().unwrap_or(0);
                let flat = logits.f_reshape([-1, v])?;
                let loss = flat.f_cross_entropy_loss::<tch::Tensor>(
                    &targets.f_reshape([-1])?,
                    None,
                    tch::Reduction::None,
                    -100,
                    0.0,
                )?;
                Ok(loss.f_reshape(targets.size())?)
            }
        }
    }
}

fn finished(what: &str) -> Error {
    Error::invalid(what, "the plan's FSDP model is finished already: build a new plan for another model")
}

#[cfg(test)]
mod tests {
    use super::{matches, one_unit_warning};
    use crate::names::closest;

    #[test]
    fn a_model_that_is_one_unit_is_warned_about() {
        assert!(one_unit_warning(&["root".to_string()]).is_some_and(|w| w.contains("nn::unit(&path, block)")));
        assert!(one_unit_warning(&["h.0".to_string(), "root".to_string()]).is_none());
        assert!(one_unit_warning(&["h.0".to_string()]).is_none());
    }

    #[test]
    fn the_closest_paths_come_first() {
        let built: Vec<String> = ["tok", "block0.attn.q", "block0.attn.k", "block1.attn.q", "block0.mlp.fc", "head"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(closest("*.attn.wq", &built)[..2], ["block0.attn.q", "block0.attn.k"]);
        assert_eq!(closest("*.mlp.w1", &built)[0], "block0.mlp.fc");
        assert_eq!(closest("heads", &built)[0], "head");
    }

    #[test]
    fn patterns_match_as_fnmatch() {
        assert!(matches("*.attn.q", "block0.attn.q"));
        assert!(matches("*.attn.q", "model.block12.attn.q"));
        assert!(!matches("*.attn.q", "block0.attn.qkv"));
        assert!(matches("block*.mlp.*", "block3.mlp.fc"));
        assert!(matches("embed.tok", "embed.tok"));
        assert!(!matches("embed.tok", "embed.tok2"));
        assert!(matches("*", "anything.at.all"));
        assert!(!matches("head", "embed.head"));
    }
}
