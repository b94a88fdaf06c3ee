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
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{nn, Tensor};

use crate::error::{check, Error, Result};
use crate::ffi;
use crate::hooks::write_error;

type ForwardFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

unsafe extern "C" fn forward_drop(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<ForwardFn> handed to the shim, which frees it once.
    drop(unsafe { Box::from_raw(ctx as *mut ForwardFn) });
}

unsafe extern "C" fn forward_trampoline(
    ctx: *mut c_void,
    inputs: *const ffi::tdx_tensor,
    n: libc::size_t,
    out: *mut ffi::tdx_tensor,
    err: *mut libc::c_char,
    errlen: libc::size_t,
) -> libc::c_int {
    // SAFETY: ctx is the live Box<ForwardFn>; inputs holds n live at::Tensor* borrowed for the call, and
    // clone_from_ptr makes handles of our own.
    let f = unsafe { &*(ctx as *const ForwardFn) };
    let xs: Vec<Tensor> =
        (0..n).map(|i| unsafe { Tensor::clone_from_ptr(*inputs.add(i) as *mut torch_sys::C_tensor) }).collect();
    let msg = match catch_unwind(AssertUnwindSafe(|| f(&xs))) {
        Ok(Ok(y)) => {
            let mut y = std::mem::ManuallyDrop::new(y);
            // SAFETY: the handle's ownership passes to the shim, which deletes it (as tch's Drop would).
            unsafe { *out = y.as_mut_ptr() as ffi::tdx_tensor };
            return 0;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => "the checkpointed block panicked".to_string(),
    };
    write_error(&msg, err, errlen);
    1
}

unsafe extern "C" fn collect(ctx: *mut c_void, t: ffi::tdx_tensor) {
    // SAFETY: ctx is the &mut Vec<Tensor> passed for the call; t is a new handle we now own.
    let v = unsafe { &mut *(ctx as *mut Vec<Tensor>) };
    v.push(unsafe { Tensor::from_ptr(t as *mut torch_sys::C_tensor) });
}

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
    let forward: ForwardFn = Box::new(move |xs: &[Tensor]| (lock(&f))(&xs[0]));
    let ctx = Box::into_raw(Box::new(forward));
    let given: Vec<ffi::tdx_tensor> =
        params.unwrap_or_default().iter().map(|p| p.as_ptr() as ffi::tdx_tensor).collect();
    let input = [x.as_ptr() as ffi::tdx_tensor];
    let mut found: Vec<Tensor> = Vec::new();
    let mut out: ffi::tdx_tensor = std::ptr::null_mut();
    // SAFETY: x and the params are live for the call; the shim owns ctx from here on (freed through
    // forward_drop on every path); `found` outlives the call, during which the sink pushes into it.
    let code = unsafe {
        ffi::tdx_checkpoint(
            forward_trampoline,
            forward_drop,
            ctx as *mut c_void,
            input.as_ptr(),
            1,
            given.as_ptr(),
            given.len(),
            params.is_none() as libc::c_int,
            collect,
            &mut found as *mut Vec<Tensor> as *mut c_void,
            c"CheckpointBackward".as_ptr(),
            &mut out,
        )
    };
    check(code, std::time::Duration::ZERO, || format!("checkpointed forward of {:?}", x.size()))?;
    if out.is_null() {
        return Err(Error::invalid("checkpoint", "shim returned no tensor"));
    }
    // SAFETY: out is a new at::Tensor* whose ownership passes to Rust.
    let y = unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) };
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
