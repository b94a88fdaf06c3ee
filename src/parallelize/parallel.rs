//! What the plan's data parallelism makes of a model: [`Unit`], a block that FSDP shards as one (or the
//! block itself), and [`Parallel`], the whole model under DDP, ZeRO-1/2, FSDP or HSDP (or the model
//! itself), with the optimizer for its layout. Both
//! are tch `nn::ModuleT`s, whatever the plan, so that the model code does not change between layouts.
use tch::{nn, Tensor};

use crate::ddp::DistributedDataParallel;
use crate::dist_module::DistModule;
use crate::error::Result;
use crate::fsdp::{FsdpUnit, FullyShardedDataParallel};
use crate::optim::Optimizer;
use crate::zero::{ShardedOptimizer, ZeroStage};

/// A block of the model: an FSDP unit when the plan shards, else the block as it was built
/// ([`Plan::unit`](super::Plan::unit)).
#[derive(Debug)]
pub enum Unit<M> {
    Local(M),
    Sharded(FsdpUnit<M>),
}

impl<M: nn::ModuleT> nn::ModuleT for Unit<M> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M> Unit<M> {
    /// The block's forward around any call of it, for a block whose forward takes more than the
    /// activations (a rotary table, a mask: captured by `f`); see
    /// [`FsdpUnit::f_forward_with`]. `Unit<Block>` of such a block has no `forward` of its own:
    /// `unit.f_forward_with(&x, |block, x| block.forward(x, &rope))`.
    pub fn f_forward_with(&self, x: &Tensor, f: impl FnOnce(&M, &Tensor) -> Tensor) -> Result<Tensor> {
        match self {
            Unit::Local(m) => Ok(f(m, x)),
            Unit::Sharded(u) => u.f_forward_with(x, f),
        }
    }

    /// [`f_forward_with`](Self::f_forward_with), panicking on error as tch's infallible methods do.
    pub fn forward_with(&self, x: &Tensor, f: impl FnOnce(&M, &Tensor) -> Tensor) -> Tensor {
        self.f_forward_with(x, f).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::ModuleT> Unit<M> {
    /// The block's forward, errors returned (tch's `f_` convention).
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Unit::Local(m) => Ok(m.forward_t(xs, train)),
            Unit::Sharded(u) => u.f_forward_t(xs, train),
        }
    }
}

impl<M: nn::Module> Unit<M> {
    /// The forward of a block that is an `nn::Module`, errors returned.
    pub fn f_forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Unit::Local(m) => Ok(m.forward(xs)),
            Unit::Sharded(u) => u.f_forward(xs),
        }
    }

    /// [`f_forward`](Self::f_forward), panicking on error as tch's infallible methods do.
    pub fn forward(&self, xs: &Tensor) -> Tensor {
        self.f_forward(xs).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The model as the plan runs it ([`Plan::finish`](super::Plan::finish)): an `nn::ModuleT`
/// (`xs.apply_t(&model, train)`) and a [`DistModule`] whatever the layout.
#[derive(Debug)]
pub enum Parallel<M> {
    /// No data parallelism: the model itself, with its VarStore's variables.
    Local {
        module: M,
        trainable: Vec<Tensor>,
        named: Vec<(String, Tensor)>,
    },
    Ddp(DistributedDataParallel<M>),
    /// DDP whose optimizer, built with the model
    /// ([`Plan::build_with_optimizer`](super::Plan::build_with_optimizer)), shards over its buckets
    /// (ZeRO-1 or 2).
    Zero {
        ddp: DistributedDataParallel<M>,
        stage: ZeroStage,
    },
    Fsdp(FullyShardedDataParallel<M>),
}

impl<M> Parallel<M> {
    /// The optimizer for this layout, `make` building it over the tensors it updates: the parameters
    /// (no data parallelism, DDP), this rank's shard of each of DDP's buckets (the plan's ZeRO-1 or 2,
    /// one inner optimizer per shard, inside a [`ShardedOptimizer`]), or FSDP's shards (ZeRO-3); what
    /// [`Plan::build_with_optimizer`](super::Plan::build_with_optimizer) returns beside the model.
    pub(crate) fn optimizer(
        &self,
        make: impl Fn(Vec<Tensor>) -> Box<dyn Optimizer + Send>,
    ) -> Result<Box<dyn Optimizer + Send>> {
        Ok(match self {
            Parallel::Local { trainable, .. } => make(trainable.iter().map(|t| t.shallow_clone()).collect()),
            Parallel::Ddp(d) => make(d.params()),
            Parallel::Zero { ddp, stage } => Box::new(ShardedOptimizer::new(ddp, *stage, make)?),
            Parallel::Fsdp(f) => make(f.shards()),
        })
    }
}

impl<M: nn::ModuleT> Parallel<M> {
    /// The model's forward, errors returned (tch's `f_` convention).
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Parallel::Local { module, .. } => Ok(module.forward_t(xs, train)),
            Parallel::Ddp(d) => d.f_forward_t(xs, train),
            Parallel::Zero { ddp, .. } => ddp.f_forward_t(xs, train),
            Parallel::Fsdp(f) => f.f_forward_t(xs, train),
        }
    }
}

impl<M: nn::ModuleT> nn::ModuleT for Parallel<M> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::Module> Parallel<M> {
    /// The forward of a model that is an `nn::Module`, errors returned.
    pub fn f_forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Parallel::Local { module, .. } => Ok(module.forward(xs)),
            Parallel::Ddp(d) => d.f_forward(xs),
            Parallel::Zero { ddp, .. } => ddp.f_forward(xs),
            Parallel::Fsdp(f) => f.f_forward(xs),
        }
    }

    /// [`f_forward`](Self::f_forward), panicking on error as tch's infallible methods do.
    pub fn forward(&self, xs: &Tensor) -> Tensor {
        self.f_forward(xs).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::ModuleT> DistModule for Parallel<M> {
    fn parameters(&self) -> Vec<Tensor> {
        match self {
            Parallel::Local { trainable, .. } => trainable.iter().map(|t| t.shallow_clone()).collect(),
            Parallel::Ddp(d) | Parallel::Zero { ddp: d, .. } => DistModule::parameters(d),
            Parallel::Fsdp(f) => DistModule::parameters(f),
        }
    }

    /// Without data parallelism there is nothing to reduce in backward (tensor parallelism's
    /// collectives run inside forward and backward either way).
    fn set_requires_gradient_sync(&self, on: bool) {
        match self {
            Parallel::Local { .. } => {}
            Parallel::Ddp(d) | Parallel::Zero { ddp: d, .. } => d.set_requires_gradient_sync(on),
            Parallel::Fsdp(f) => f.set_requires_gradient_sync(on),
        }
    }

    fn requires_gradient_sync(&self) -> bool {
        match self {
            Parallel::Local { .. } => true,
            Parallel::Ddp(d) | Parallel::Zero { ddp: d, .. } => d.requires_gradient_sync(),
            Parallel::Fsdp(f) => f.requires_gradient_sync(),
        }
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        match self {
            Parallel::Local { named, .. } => Ok(named.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()),
            Parallel::Ddp(d) | Parallel::Zero { ddp: d, .. } => DistModule::state_dict(d),
            Parallel::Fsdp(f) => DistModule::state_dict(f),
        }
    }

    fn zero_grad(&self) -> Result<()> {
        match self {
            Parallel::Fsdp(f) => DistModule::zero_grad(f),
            _ => crate::hooks::drop_grads(&self.parameters()),
        }
    }
}

/// A pipeline chunk's data parallelism, its layers kept by the chunk: what the pipeline drives per
/// microbatch (the plan's ZeRO-1/2 is refused for chunks before one is built).
impl Parallel<()> {
    /// `f`, the chunk's layers, on `x` inside this wrapper's forward.
    pub(crate) fn chunk_forward(&self, x: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> Result<Tensor> {
        match self {
            Parallel::Local { .. } => Ok(f(x)),
            Parallel::Ddp(d) | Parallel::Zero { ddp: d, .. } => d.forward_with(|_| f(x)),
            Parallel::Fsdp(m) => m.forward_with(x, |_, x| f(x)),
        }
    }

    /// Whether the next backward reduces the gradients.
    pub(crate) fn set_sync(&self, on: bool) {
        match self {
            Parallel::Local { .. } => {}
            Parallel::Ddp(d) | Parallel::Zero { ddp: d, .. } => d.set_sync(on),
            Parallel::Fsdp(m) => m.set_sync(on),
        }
    }

    /// FSDP's units stay gathered after a backward (off) or are freed (on); nothing to keep otherwise.
    pub(crate) fn set_reshard_after_backward(&self, on: bool) {
        if let Parallel::Fsdp(m) = self {
            m.set_reshard_after_backward(on);
        }
    }

    /// A step begins: FSDP frees what an earlier forward left gathered (the optimizer may have stepped
    /// since), then keeps what the step's backwards gather.
    pub(crate) fn begin_step(&self) -> Result<()> {
        if let Parallel::Fsdp(m) = self {
            m.reshard()?;
            m.set_reshard_after_backward(false);
        }
        Ok(())
    }

    /// The chunk's FSDP, when it shards.
    pub(crate) fn sharded(&self) -> Option<&FullyShardedDataParallel<()>> {
        match self {
            Parallel::Fsdp(m) => Some(m),
            _ => None,
        }
    }
}
