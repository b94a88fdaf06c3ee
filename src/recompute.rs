//! Activation checkpointing for any model (PyTorch's `torch.utils.checkpoint`, Megatron's activation
//! recomputation): a block's forward keeps none of its activations; backward runs the forward again, with
//! the random numbers (dropout) and autocast state of the first run, and goes back through it.
//!
//! The backward is an autograd node in the shim (`tch-dist-sys/csrc/recompute.cpp`). Its gradient edges lead to the
//! block's input and to the block's parameters, so parameter gradients arrive from the backward the user
//! started: DDP's, ZeRO's and FSDP's hooks fire as without checkpointing, and it composes with all of
//! them, and with tensor-parallel layers inside the block. The parameters are found on the first forward
//! (one extra forward with grad, its graph freed at once) and checked on every recomputation.
//!
//! ```no_run
//! use tch::{nn, nn::Module, Device};
//! use tch_dist::recompute::Checkpointed;
//! let vs = nn::VarStore::new(Device::Cpu);
//! let block = nn::seq().add(nn::linear(vs.root() / "a", 64, 256, Default::default())).add_fn(|x| x.gelu("none"))
//!     .add(nn::linear(vs.root() / "b", 256, 64, Default::default()));
//! let net = nn::seq().add(Checkpointed::new(block)).add(nn::linear(vs.root() / "head", 64, 1, Default::default()));
//! let y = net.forward(&tch::Tensor::randn([8, 64], (tch::Kind::Float, Device::Cpu)));
//! y.sum(tch::Kind::Float).backward(); // the block's activations are recomputed here
//! ```
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{nn, Tensor};

use crate::error::Result;
use crate::ffi;

/// Runs `f(x)` checkpointed: no activations kept, recomputed in backward. `params`: the leaves `f` uses
/// whose gradients it produces, or `None` to find them with one extra forward (returned, to pass next
/// time). A recomputation that uses a parameter missing from the list fails the backward, naming its
/// shape: its gradient would otherwise be lost.
///
/// `f` runs under a lock of its own (tensors are not `Sync`, so neither is a closure holding one): a
/// forward and a recomputation never run at once, and `f` must not call itself.
pub fn checkpoint_with(
    x: &Tensor,
    params: Option<&[Tensor]>,
    f: impl Fn(&Tensor) -> Result<Tensor> + Send + 'static,
) -> Result<(Tensor, Vec<Tensor>)> {
    let f = Mutex::new(f);
    let forward: ffi::recompute::ForwardFn = Box::new(move |xs: &[Tensor]| (lock(&f))(&xs[0]));
    let (y, found) = ffi::recompute::checkpoint(x, params, forward)?;
    let params = match params {
        Some(p) => p.iter().map(|t| t.shallow_clone()).collect(),
        None => found,
    };
    Ok((y, params))
}

struct Shared<M> {
    module: M,
    /// Found on the first forward.
    params: Option<Vec<Tensor>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking block poisons the lock; the module itself is still whole.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A module whose activations are recomputed in backward instead of kept (see the module docs). Not
/// re-entrant: the block must not contain itself.
pub struct Checkpointed<M> {
    // Arc: the autograd graph holds the block too, for the recomputation. Mutex: the module is not Sync.
    shared: Arc<Mutex<Shared<M>>>,
}

impl<M: Send + 'static> Checkpointed<M> {
    pub fn new(module: M) -> Self {
        Checkpointed { shared: Arc::new(Mutex::new(Shared { module, params: None })) }
    }

    fn run(&self, x: &Tensor, f: impl Fn(&M, &Tensor) -> Tensor + Send + 'static) -> Result<Tensor> {
        let known: Option<Vec<Tensor>> =
            lock(&self.shared).params.as_ref().map(|v| v.iter().map(|t| t.shallow_clone()).collect());
        let shared = self.shared.clone();
        let (y, found) = checkpoint_with(x, known.as_deref(), move |x| Ok(f(&lock(&shared).module, x)))?;
        if known.is_none() {
            lock(&self.shared).params = Some(found);
        }
        Ok(y)
    }

    /// The parameters the block was seen to use (after its first forward with grad).
    pub fn parameters(&self) -> Vec<Tensor> {
        lock(&self.shared).params.as_ref().map(|v| v.iter().map(|t| t.shallow_clone()).collect()).unwrap_or_default()
    }
}

impl<M: nn::Module + 'static> Checkpointed<M> {
    /// The forward, errors returned (tch's `f_` convention).
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, |m, x| m.forward(x))
    }
}

impl<M: nn::ModuleT + 'static> Checkpointed<M> {
    /// The forward with a train flag (dropout is recomputed with the same mask), errors returned.
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.run(x, move |m, x| m.forward_t(x, train))
    }

    /// [`f_forward_t`](Self::f_forward_t), panicking on error as tch's infallible methods do.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(x, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: nn::Module + 'static> nn::Module for Checkpointed<M> {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.f_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M: std::fmt::Debug> std::fmt::Debug for Checkpointed<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointed").field("module", &lock(&self.shared).module).finish()
    }
}
