//! tch's own optimizers (`nn::Adam`, `nn::AdamW`, `nn::Sgd`, `nn::RmsProp`) seen as an [`Optimizer`], so
//! that their state (libtorch's C++ optimizer's, per parameter) goes into sharded checkpoints and comes
//! back under any layout. The tch optimizer keeps stepping as it did; this only reads and writes its state.
use std::ffi::c_void;
use std::ptr::NonNull;

use tch::{nn, Tensor};

use super::{grads_of, memory_of, stepped_params, Optimizer, OptimizerMemory, Stepped};
use crate::error::{check, Error, Result};
use crate::ffi;

/// A tch `nn::Optimizer` as an [`Optimizer`]: its step and zero_grad are tch's, its state is read from and
/// written to libtorch's C++ optimizer. Built from the optimizer and the `VarStore` it was built on.
///
/// ```no_run
/// # fn run(ck: &mut tch_dist::checkpoint::Checkpointer) -> Result<(), Box<dyn std::error::Error>> {
/// use tch::nn::{self, OptimizerConfig};
/// use tch_dist::checkpoint::StateDict;
/// use tch_dist::optim::TchOptimizer;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// // ... the model on vs (under FSDP: after `finish`) ...
/// let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;
/// let mut state = TchOptimizer::new(&mut opt, &vs)?;
/// ck.save(100, StateDict::new().var_store("model", &vs).optimizer("optim", &mut state))?;
/// # Ok(())
/// # }
/// ```
pub struct TchOptimizer<'o> {
    opt: &'o mut nn::Optimizer,
    /// libtorch's `torch::optim::Optimizer` that `opt` owns.
    raw: NonNull<c_void>,
    kind: Kind,
    /// Its parameters across its param groups, in order.
    params: Vec<Tensor>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Adam,
    AdamW,
    Sgd,
    RmsProp,
}

impl Kind {
    /// Its state tensors' names, in the shim's order; `step`: whether it counts steps.
    fn fields(self) -> (&'static [&'static str], bool) {
        match self {
            Kind::Adam | Kind::AdamW => (&["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], true),
            Kind::Sgd => (&["momentum_buffer"], false),
            Kind::RmsProp => (&["square_avg", "momentum_buffer", "grad_avg"], true),
        }
    }
}

const WHAT: &str = "TchOptimizer";

impl<'o> TchOptimizer<'o> {
    /// `opt`, which `vs` built (`OptimizerConfig::build(&vs, lr)`). Build the optimizer once the model's
    /// variables are all there (under FSDP, after `finish`): tch adds variables created later only at its
    /// next step, and this refuses an optimizer that does not hold them all yet.
    pub fn new(opt: &'o mut nn::Optimizer, vs: &nn::VarStore) -> Result<TchOptimizer<'o>> {
        let trainable = vs.trainable_variables().len();
        let raw = libtorch_optimizer(opt, vs, trainable)?;
        let mut code = 0;
        // SAFETY: `raw` is the torch::optim::Optimizer* that `opt` owns (libtorch_optimizer), alive while
        // `opt` is borrowed.
        check(unsafe { ffi::tdx_optim_kind(raw.as_ptr(), &mut code) }, Default::default(), || WHAT.into())?;
        let kind = match code {
            ffi::TDX_OPTIM_ADAM => Kind::Adam,
            ffi::TDX_OPTIM_ADAMW => Kind::AdamW,
            ffi::TDX_OPTIM_SGD => Kind::Sgd,
            ffi::TDX_OPTIM_RMSPROP => Kind::RmsProp,
            _ => return Err(Error::invalid(WHAT, "an optimizer other than tch's Adam, AdamW, Sgd and RmsProp")),
        };
        let params = params_of(raw)?;
        if params.len() != trainable {
            return Err(Error::invalid(
                WHAT,
                format!(
                    "the optimizer holds {} of the VarStore's {trainable} trainable variables: tch adds variables \
                     created after `build` only at its next step; build the optimizer after the model (under FSDP, \
                     after `finish`)",
                    params.len()
                ),
            ));
        }
        Ok(TchOptimizer { opt, raw, kind, params })
    }

    fn state_of(&self, i: usize) -> Result<Option<(i64, Vec<Option<Tensor>>)>> {
        let (mut has, mut step) = (0, 0i64);
        let mut outs: [ffi::tdx_tensor; 3] = [std::ptr::null_mut(); 3];
        // SAFETY: `raw` is alive while `opt` is borrowed; `outs` has room for the three tensors.
        let code = unsafe { ffi::tdx_optim_state_get(self.raw.as_ptr(), i, &mut has, &mut step, outs.as_mut_ptr()) };
        check(code, Default::default(), || format!("{WHAT}: the state of parameter {i}"))?;
        // SAFETY: each non-null handle is a tensor the shim made for this call, adopted once.
        let tensors: Vec<Option<Tensor>> = outs
            .iter()
            .map(|&p| (!p.is_null()).then(|| unsafe { ffi::adopt(p, WHAT) }).transpose())
            .collect::<Result<_>>()?;
        Ok((has != 0).then_some((step, tensors)))
    }
}

/// Finds the C++ optimizer's pointer inside tch's `nn::Optimizer`, which keeps it private. That struct is
/// three words: its `COptimizer` (the pointer), the `Arc` of the VarStore's variables and the count of
/// variables it holds. The Arc's word is the one just below `Arc::as_ptr` (its two counters lie before
/// the value), the count is the small one; the pointer is what is left. Anything else is refused.
fn libtorch_optimizer(opt: &nn::Optimizer, vs: &nn::VarStore, trainable: usize) -> Result<NonNull<c_void>> {
    const WORDS: usize = 3;
    let layout_changed =
        || Error::invalid(WHAT, "this version of tch lays out nn::Optimizer differently: its state cannot be read");
    if std::mem::size_of::<nn::Optimizer>() != WORDS * std::mem::size_of::<usize>() {
        return Err(layout_changed());
    }
    // SAFETY: the size was checked; the words are read as pointers (keeping their provenance), none is
    // dereferenced here.
    let ptrs: [*mut c_void; WORDS] = unsafe { std::mem::transmute_copy(opt) };
    let words = ptrs.map(|p| p as usize);
    let data = std::sync::Arc::as_ptr(&vs.variables_) as usize;
    let is_arc = |w: usize| w < data && data - w <= 64;
    let arcs = words.iter().filter(|&&w| is_arc(w)).count();
    let counts = words.iter().filter(|&&w| w <= trainable).count();
    if arcs != 1 {
        return Err(Error::invalid(
            WHAT,
            "this optimizer was not built on this VarStore (give the VarStore it was built on)",
        ));
    }
    match ptrs.iter().zip(words).find(|(_, w)| !is_arc(*w) && *w > trainable) {
        Some((&p, w)) if counts == 1 && w % std::mem::align_of::<usize>() == 0 => {
            NonNull::new(p).ok_or_else(layout_changed)
        }
        _ => Err(layout_changed()),
    }
}

fn params_of(raw: NonNull<c_void>) -> Result<Vec<Tensor>> {
    let mut n = 0;
    // SAFETY: `raw` is a live C++ optimizer; with cap 0 nothing is written to outs.
    check(unsafe { ffi::tdx_optim_params(raw.as_ptr(), std::ptr::null_mut(), 0, &mut n) }, Default::default(), || {
        format!("{WHAT}: its parameters")
    })?;
    let mut outs: Vec<ffi::tdx_tensor> = vec![std::ptr::null_mut(); n];
    // SAFETY: `outs` has room for n handles.
    check(unsafe { ffi::tdx_optim_params(raw.as_ptr(), outs.as_mut_ptr(), n, &mut n) }, Default::default(), || {
        format!("{WHAT}: its parameters")
    })?;
    // SAFETY: each handle is a tensor the shim made for this call, adopted once.
    outs.into_iter().map(|p| unsafe { ffi::adopt(p, WHAT) }).collect()
}

/// A step count saved as any scalar (ours: int64 of shape [1]; PyTorch's: a float32 scalar).
fn step_value(t: &Tensor) -> Result<i64> {
    Ok(t.f_reshape([-1])?.f_double_value(&[0])?.round() as i64)
}

impl Optimizer for TchOptimizer<'_> {
    fn step(&mut self) -> Result<()> {
        self.opt.step();
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.opt.zero_grad();
        Ok(())
    }

    /// `tch.{i}.{field}`: `step` (where the optimizer counts them) and its state tensors, for each
    /// parameter that has state (none before its first step).
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let (names, counts) = self.kind.fields();
        let mut out = Vec::new();
        for i in 0..self.params.len() {
            // reading fails only for an index past the parameters or another optimizer kind, both ruled
            // out by `new`: nothing is left out
            let Ok(Some((step, tensors))) = self.state_of(i) else { continue };
            if counts {
                out.push((format!("tch.{i}.step"), Tensor::from_slice(&[step])));
            }
            for (name, t) in names.iter().zip(tensors) {
                if let Some(t) = t {
                    out.push((format!("tch.{i}.{name}"), t));
                }
            }
        }
        out
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let (names, counts) = self.kind.fields();
        for (i, p) in self.params.iter().enumerate() {
            let prefix = format!("tch.{i}.");
            let field = |f: &str| state.iter().find(|(k, _)| k.strip_prefix(&prefix) == Some(f)).map(|(_, t)| t);
            let current = self.state_of(i)?;
            let mut ins: [ffi::tdx_tensor; 3] = [std::ptr::null_mut(); 3];
            let mut kept = Vec::new();
            for (j, name) in names.iter().enumerate() {
                let Some(saved) = field(name) else { continue };
                if saved.size() != p.size() {
                    return Err(Error::mismatch(
                        format!("{WHAT}: load_state_dict"),
                        format!("{prefix}{name}: saved {:?}, the parameter is {:?}", saved.size(), p.size()),
                    ));
                }
                let now = current.as_ref().and_then(|(_, ts)| ts[j].as_ref());
                // libtorch keeps state in the parameter's dtype and device
                let t = super::restore(now, &saved.f_to_device(p.device())?.f_to_kind(p.kind())?)?;
                ins[j] = t.as_ptr() as ffi::tdx_tensor;
                kept.push(t);
            }
            let step = match field("step") {
                Some(s) if counts => step_value(s)?,
                _ => 0,
            };
            let has = !kept.is_empty() || (counts && field("step").is_some());
            // SAFETY: `raw` is alive; `ins` holds null or tensors alive for the call (the shim keeps its own
            // references).
            let code = unsafe { ffi::tdx_optim_state_set(self.raw.as_ptr(), i, has as i32, step, ins.as_ptr()) };
            check(code, Default::default(), || format!("{WHAT}: setting the state of parameter {i}"))?;
        }
        Ok(())
    }

    fn gradients(&mut self) -> Result<Vec<Tensor>> {
        Ok(grads_of(&self.params))
    }

    fn memory(&self) -> OptimizerMemory {
        memory_of(&self.state_dict(), &self.params)
    }

    fn stepped(&self) -> Vec<Stepped> {
        stepped_params("tch", &self.params)
    }
}
