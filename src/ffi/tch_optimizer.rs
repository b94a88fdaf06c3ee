//! Safe wrapper of libtorch's C++ optimizer inside a tch `nn::Optimizer` (tch-dist-sys/csrc/tch_optim.cpp):
//! its kind, its parameters, and each parameter's state read and written.
use std::ffi::c_void;
use std::ptr::NonNull;

use tch::{nn, Tensor};

use super::check;
use crate::error::{Error, Result};

const WHAT: &str = "TchOptimizer";

/// tch's optimizer and the `torch::optim::Optimizer` it owns: the handle is valid as long as the borrow.
pub(crate) struct CppOptimizer<'o> {
    opt: &'o mut nn::Optimizer,
    raw: NonNull<c_void>,
}

/// Which of libtorch's optimizers it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CppKind {
    Adam,
    AdamW,
    Sgd,
    RmsProp,
    Other,
}

impl<'o> CppOptimizer<'o> {
    /// The C++ optimizer of `opt`, which `vs` built; `trainable`: `vs`'s count of trainable variables.
    pub(crate) fn new(opt: &'o mut nn::Optimizer, vs: &nn::VarStore, trainable: usize) -> Result<Self> {
        let raw = find(opt, vs, trainable)?;
        Ok(CppOptimizer { opt, raw })
    }

    /// tch's step. (Only its step and zero_grad are reachable: replacing the optimizer would free the
    /// C++ one under `raw`.)
    pub(crate) fn step(&mut self) {
        self.opt.step()
    }

    pub(crate) fn zero_grad(&mut self) {
        self.opt.zero_grad()
    }

    pub(crate) fn kind(&self) -> Result<CppKind> {
        let mut code = 0;
        // SAFETY: `raw` is the optimizer `opt` owns, alive while `opt` is borrowed.
        check(unsafe { super::tdx_optim_kind(self.raw.as_ptr(), &mut code) }, Default::default(), || WHAT.into())?;
        Ok(match code {
            super::TDX_OPTIM_ADAM => CppKind::Adam,
            super::TDX_OPTIM_ADAMW => CppKind::AdamW,
            super::TDX_OPTIM_SGD => CppKind::Sgd,
            super::TDX_OPTIM_RMSPROP => CppKind::RmsProp,
            _ => CppKind::Other,
        })
    }

    /// Its parameters across its param groups, in order.
    pub(crate) fn params(&self) -> Result<Vec<Tensor>> {
        let what = || format!("{WHAT}: its parameters");
        let mut n = 0;
        // SAFETY: `raw` is alive while `opt` is borrowed; with cap 0 nothing is written to outs.
        check(
            unsafe { super::tdx_optim_params(self.raw.as_ptr(), std::ptr::null_mut(), 0, &mut n) },
            Default::default(),
            what,
        )?;
        let mut outs: Vec<super::tdx_tensor> = vec![std::ptr::null_mut(); n];
        // SAFETY: as above; `outs` has room for n handles.
        check(
            unsafe { super::tdx_optim_params(self.raw.as_ptr(), outs.as_mut_ptr(), n, &mut n) },
            Default::default(),
            what,
        )?;
        // SAFETY: each handle is a tensor the shim made for this call, adopted once.
        outs.into_iter().map(|p| unsafe { super::adopt(p, WHAT) }).collect()
    }

    /// Parameter `i`'s state: its step count and up to three tensors, in the shim's order (`None` where
    /// it has no state yet).
    pub(crate) fn state(&self, i: usize) -> Result<Option<(i64, Vec<Option<Tensor>>)>> {
        let (mut has, mut step) = (0, 0i64);
        let mut outs: [super::tdx_tensor; 3] = [std::ptr::null_mut(); 3];
        // SAFETY: `raw` is alive while `opt` is borrowed; `outs` has room for the three tensors.
        let code = unsafe { super::tdx_optim_state_get(self.raw.as_ptr(), i, &mut has, &mut step, outs.as_mut_ptr()) };
        check(code, Default::default(), || format!("{WHAT}: the state of parameter {i}"))?;
        // SAFETY: each non-null handle is a tensor the shim made for this call, adopted once.
        let tensors: Vec<Option<Tensor>> = outs
            .iter()
            .map(|&p| (!p.is_null()).then(|| unsafe { super::adopt(p, WHAT) }).transpose())
            .collect::<Result<_>>()?;
        Ok((has != 0).then_some((step, tensors)))
    }

    /// Sets parameter `i`'s state (`has`: whether it has any), its tensors in the shim's order.
    pub(crate) fn set_state(&mut self, i: usize, has: bool, step: i64, tensors: [Option<&Tensor>; 3]) -> Result<()> {
        let ins = tensors.map(|t| t.map_or(std::ptr::null_mut(), super::handle));
        // SAFETY: `raw` is alive while `opt` is borrowed; `ins` holds null or tensors alive for the call
        // (the shim keeps its own references).
        let code = unsafe { super::tdx_optim_state_set(self.raw.as_ptr(), i, has as i32, step, ins.as_ptr()) };
        check(code, Default::default(), || format!("{WHAT}: setting the state of parameter {i}"))
    }
}

/// Finds the C++ optimizer's pointer inside tch's `nn::Optimizer`, which keeps it private. That struct is
/// three words: its `COptimizer` (the pointer), the `Arc` of the VarStore's variables and the count of
/// variables it holds. The Arc's word is the one just below `Arc::as_ptr` (its two counters lie before
/// the value), the count is the small one; the pointer is what is left. Anything else is refused.
fn find(opt: &nn::Optimizer, vs: &nn::VarStore, trainable: usize) -> Result<NonNull<c_void>> {
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
