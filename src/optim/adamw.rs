//! AdamW (`torch.optim.AdamW`): decoupled weight decay, bias correction. Three paths, as PyTorch's: the
//! multi-tensor one (`foreach`, a few ATen launches per step for each device and dtype, PyTorch's default on
//! CUDA and ours), the single-tensor one (the default on the CPU: its floats bit for bit, in two passes over
//! memory where they were shown to give them, else its ATen calls in chunks), and ATen's fused kernel
//! ([`AdamW::fused`], as `fused=True`).
use tch::{Kind, Tensor};

use super::{find, Optimizer};
use crate::error::Result;
use crate::ffi::{self, AdamScalars};

/// AdamW's settings, as tch's `nn::AdamW` (an options struct with `Default`): PyTorch's defaults, betas
/// (0.9, 0.999), eps 1e-8, weight decay 0.01, and PyTorch's choice of path (multi-tensor on CUDA,
/// single-tensor on the CPU).
///
/// ```no_run
/// # use tch_dist::optim::AdamWConfig;
/// # let params: Vec<tch::Tensor> = Vec::new();
/// let opt = AdamWConfig { weight_decay: 0.1, fused: true, ..Default::default() }.build(params, 3e-4);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// ATen's fused kernel, as `fused=True` ([`AdamW::fused`]).
    pub fused: bool,
    /// The multi-tensor path, as `foreach=`: `None` (the default) takes it when every parameter is on
    /// CUDA, as PyTorch does; `Some(true)` everywhere; `Some(false)` nowhere ([`AdamW::foreach`]). With
    /// `fused` it is refused at the first step, as PyTorch refuses both.
    pub foreach: Option<bool>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, fused: false, foreach: None }
    }
}

impl AdamWConfig {
    /// The optimizer over `params` (what it steps: a wrapper's `parameters()`) at learning rate `lr`.
    pub fn build(self, params: Vec<Tensor>, lr: f64) -> AdamW {
        let n = params.len();
        AdamW {
            params,
            lr,
            config: self,
            step: vec![0; n],
            exp_avg: (0..n).map(|_| None).collect(),
            exp_avg_sq: (0..n).map(|_| None).collect(),
        }
    }
}

pub struct AdamW {
    params: Vec<Tensor>,
    pub lr: f64,
    /// The settings it was built with (the setters change them).
    pub config: AdamWConfig,
    step: Vec<i64>,
    exp_avg: Vec<Option<Tensor>>,
    exp_avg_sq: Vec<Option<Tensor>>,
}

impl AdamW {
    /// With PyTorch's defaults ([`AdamWConfig::default`]); the setters below change one setting each.
    pub fn new(params: Vec<Tensor>, lr: f64) -> AdamW {
        AdamWConfig::default().build(params, lr)
    }
    pub fn betas(mut self, b1: f64, b2: f64) -> Self {
        (self.config.beta1, self.config.beta2) = (b1, b2);
        self
    }
    pub fn eps(mut self, e: f64) -> Self {
        self.config.eps = e;
        self
    }
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.config.weight_decay = wd;
        self
    }

    /// ATen's fused kernel (PyTorch's `AdamW(fused=True)`): one pass over each parameter, its gradient
    /// and its moments, no temporaries (`scripts/bench-memory.sh` shows the step time). Results equal
    /// PyTorch's fused path, and the default path's within float32 rounding. Floating-point parameters on
    /// CPU or CUDA, a gradient of the parameter's dtype.
    ///
    /// ```no_run
    /// # use tch_dist::optim::AdamW;
    /// # let params: Vec<tch::Tensor> = Vec::new();
    /// let opt = AdamW::new(params, 1e-3).fused(true);
    /// ```
    pub fn fused(mut self, on: bool) -> Self {
        self.config.fused = on;
        self
    }

    /// torch.optim's multi-tensor path (`foreach=True`) on every device, or on none (`false`): each
    /// device and dtype's parameters updated by a few `_foreach_*` launches, where the single-tensor path
    /// launches several per parameter. By default it runs on CUDA only, as PyTorch's. Results equal
    /// PyTorch's `AdamW(foreach=True)`, bit for bit.
    pub fn foreach(mut self, on: bool) -> Self {
        self.config.foreach = Some(on);
        self
    }

    fn scalars(&self) -> AdamScalars {
        let c = &self.config;
        AdamScalars { lr: self.lr, beta1: c.beta1, beta2: c.beta2, weight_decay: c.weight_decay, eps: c.eps }
    }

    /// The moments of the parameters at `idx` (they exist once a step has reached them).
    fn moments(&self, idx: &[usize]) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        idx.iter()
            .map(|&i| match (&self.exp_avg[i], &self.exp_avg_sq[i]) {
                (Some(m), Some(v)) => Ok((m.shallow_clone(), v.shallow_clone())),
                _ => Err(crate::Error::invalid("AdamW", "a multi-tensor step over parameters without moments")),
            })
            .collect::<Result<Vec<_>>>()
            .map(|mv| mv.into_iter().unzip())
    }

    /// One fused or multi-tensor update of the parameters at `idx` (their steps are counted).
    fn step_group(&self, path: Path, idx: &[usize], grads: &[Tensor]) -> Result<()> {
        let params: Vec<Tensor> = idx.iter().map(|&i| self.params[i].shallow_clone()).collect();
        let (m, v) = self.moments(idx)?;
        match path {
            Path::Fused => {
                let steps = idx
                    .iter()
                    .map(|&i| Tensor::f_full([], self.step[i] as f64, (Kind::Float, self.params[i].device())))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                ffi::fused_adamw(&params, grads, &m, &v, &steps, self.scalars())
            }
            Path::Foreach => {
                let steps: Vec<i64> = idx.iter().map(|&i| self.step[i]).collect();
                ffi::foreach_adamw(&params, grads, &m, &v, &steps, self.scalars())
            }
        }
    }
}

/// The two paths that update a group of parameters (one device and dtype) at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Fused,
    Foreach,
}

/// Parameters one fused or multi-tensor call updates: (path, device, dtypes of parameter and gradient),
/// their indices, their gradients.
type Group = ((Path, tch::Device, Kind, Kind), Vec<usize>, Vec<Tensor>);

/// Which variant of the shim's two-pass CPU update gave ATen's floats at its first use (0-3), or `None`
/// where none did (or the CPU lacks AVX2 and FMA) and the default path runs ATen's calls instead. Runs the
/// check on first use.
#[doc(hidden)]
pub fn two_pass_variant() -> Option<i32> {
    ffi::adamw_two_pass_variant()
}

/// Elements updated at a time. On the CPU few enough that the update's tensors stay in a core's L2 cache
/// across its passes (with two processes on two cores, about 2x faster than 2^18); elsewhere enough to
/// keep kernel launches few while still bounding the temporaries.
const CPU_CHUNK: i64 = 1 << 16;
const CHUNK: i64 = 1 << 18;

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        if self.config.fused && self.config.foreach == Some(true) {
            return Err(crate::Error::invalid("AdamW", "fused and foreach cannot both be on (as in PyTorch)"));
        }
        let _s = crate::timeline::span("optimizer", || "AdamW step".into());
        let _g = tch::no_grad_guard();
        let mut groups: Vec<Group> = Vec::new();
        // PyTorch's default: the multi-tensor path when every parameter is on CUDA
        let all_cuda = self.params.iter().all(|p| p.device().is_cuda());
        for i in 0..self.params.len() {
            let p = self.params[i].shallow_clone();
            let g = p.grad();
            if !g.defined() {
                super::skip_without_grad("AdamW::step", &p)?;
                continue;
            }
            if self.exp_avg[i].is_none() {
                self.exp_avg[i] = Some(p.f_zeros_like()?);
                self.exp_avg_sq[i] = Some(p.f_zeros_like()?);
            }
            self.step[i] += 1;
            // the fused kernel walks flat memory and takes the parameter's dtype for its gradient
            let fused =
                self.config.fused && p.numel() > 0 && g.kind() == p.kind() && p.is_contiguous() && g.is_contiguous();
            let path = if fused {
                Some(Path::Fused)
            } else if !self.config.fused && self.config.foreach.unwrap_or(all_cuda) {
                Some(Path::Foreach)
            } else {
                None
            };
            let Some(path) = path else {
                let (Some(m), Some(v)) = (&self.exp_avg[i], &self.exp_avg_sq[i]) else { continue };
                let chunk = if p.device() == tch::Device::Cpu { CPU_CHUNK } else { CHUNK };
                ffi::adamw_step(&p, &g, m, v, self.step[i], chunk, self.scalars())?;
                continue;
            };
            // one call per device and dtype, as PyTorch groups
            let key = (path, p.device(), p.kind(), g.kind());
            match groups.iter_mut().find(|(k, _, _)| *k == key) {
                Some((_, idx, grads)) => {
                    idx.push(i);
                    grads.push(g);
                }
                None => groups.push((key, vec![i], vec![g])),
            }
        }
        for ((path, ..), idx, grads) in groups {
            self.step_group(path, &idx, &grads)?;
        }
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        crate::hooks::drop_grads(&self.params)
    }

    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for i in 0..self.params.len() {
            if let (Some(m), Some(v)) = (&self.exp_avg[i], &self.exp_avg_sq[i]) {
                out.push((format!("adamw.{i}.step"), Tensor::from_slice(&[self.step[i]])));
                out.push((format!("adamw.{i}.exp_avg"), m.shallow_clone()));
                out.push((format!("adamw.{i}.exp_avg_sq"), v.shallow_clone()));
            }
        }
        out
    }

    fn gradients(&mut self) -> Result<Vec<Tensor>> {
        Ok(super::grads_of(&self.params))
    }

    fn memory(&self) -> super::OptimizerMemory {
        super::memory_of(&self.state_dict(), &self.params)
    }

    fn stepped(&self) -> Vec<super::Stepped> {
        super::stepped_params("adamw", &self.params)
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        for i in 0..self.params.len() {
            let p = &self.params[i];
            let key = format!("adamw.{i}.step");
            if let Some((_, s)) = state.iter().find(|(n, _)| *n == key) {
                self.step[i] = s.f_int64_value(&[0])?;
                let m = find(state, &format!("adamw.{i}.exp_avg"), p)?;
                let v = find(state, &format!("adamw.{i}.exp_avg_sq"), p)?;
                self.exp_avg[i] = Some(super::restore(self.exp_avg[i].as_ref(), m)?);
                self.exp_avg_sq[i] = Some(super::restore(self.exp_avg_sq[i].as_ref(), v)?);
            } else {
                self.step[i] = 0;
                self.exp_avg[i] = None;
                self.exp_avg_sq[i] = None;
            }
        }
        Ok(())
    }
}
