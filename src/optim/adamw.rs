//! AdamW (`torch.optim.AdamW`): decoupled weight decay, bias correction. By default the single-tensor
//! path's floats, bit for bit (on the CPU in two passes over memory where they were shown to give them,
//! else its ATen calls in chunks); [`AdamW::fused`] runs ATen's fused kernel, as `fused=True` does.
use tch::{Kind, Tensor};

use super::{find, Optimizer};
use crate::error::{check, Result};
use crate::ffi;

/// AdamW's settings, as tch's `nn::AdamW` (an options struct with `Default`): PyTorch's defaults, betas
/// (0.9, 0.999), eps 1e-8, weight decay 0.01, the default (unfused) path.
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
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, fused: false }
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

    /// One fused update of the parameters at `idx` (their moments exist, their steps are counted).
    fn step_fused(&mut self, idx: &[usize], grads: &[Tensor]) -> Result<()> {
        let steps = idx
            .iter()
            .map(|&i| Tensor::f_full([], self.step[i] as f64, (Kind::Float, self.params[i].device())))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let ptr = |t: &Tensor| t.as_ptr() as ffi::tdx_tensor;
        let params: Vec<_> = idx.iter().map(|&i| ptr(&self.params[i])).collect();
        let grads: Vec<_> = grads.iter().map(ptr).collect();
        let mut m = Vec::with_capacity(idx.len());
        let mut v = Vec::with_capacity(idx.len());
        for &i in idx {
            if let (Some(a), Some(b)) = (&self.exp_avg[i], &self.exp_avg_sq[i]) {
                m.push(ptr(a));
                v.push(ptr(b));
            }
        }
        if m.len() != idx.len() {
            return Err(crate::Error::invalid("AdamW", "a fused step over parameters without moments"));
        }
        let step_ptrs: Vec<_> = steps.iter().map(ptr).collect();
        let (b1, b2) = (self.config.beta1, self.config.beta2);
        // SAFETY: every handle points to a tensor alive for the call (self's, `grads`' and `steps`'), and
        // each list has idx.len() entries.
        let code = unsafe {
            ffi::tdx_fused_adamw(
                params.as_ptr(),
                grads.as_ptr(),
                m.as_ptr(),
                v.as_ptr(),
                step_ptrs.as_ptr(),
                idx.len(),
                self.lr,
                b1,
                b2,
                self.config.weight_decay,
                self.config.eps,
            )
        };
        check(code, std::time::Duration::ZERO, || format!("fused AdamW step over {} parameters", idx.len()))
    }
}

/// Parameters one fused call updates: (device, dtype), their indices, their gradients.
type FusedGroup = ((tch::Device, Kind), Vec<usize>, Vec<Tensor>);

/// Which variant of the shim's two-pass CPU update gave ATen's floats at its first use (0-3), or `None`
/// where none did (or the CPU lacks AVX2 and FMA) and the default path runs ATen's calls instead. Runs the
/// check on first use.
#[doc(hidden)]
pub fn two_pass_variant() -> Option<i32> {
    // SAFETY: no arguments; the shim catches everything.
    let v = unsafe { ffi::tdx_adamw_two_pass_variant() };
    (v >= 0).then_some(v)
}

/// Elements updated at a time. On the CPU few enough that the update's tensors stay in a core's L2 cache
/// across its passes (with two processes on two cores, about 2x faster than 2^18); elsewhere enough to
/// keep kernel launches few while still bounding the temporaries.
const CPU_CHUNK: i64 = 1 << 16;
const CHUNK: i64 = 1 << 18;

/// One AdamW update of `p` in place, as torch.optim.AdamW's single-tensor path (in the shim: its ATen
/// calls and scalars, chunk by chunk).
fn update(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, lr: f64, c: &AdamWConfig, step: i64) -> Result<()> {
    let chunk = if p.device() == tch::Device::Cpu { CPU_CHUNK } else { CHUNK };
    let ptr = |t: &Tensor| t.as_ptr() as ffi::tdx_tensor;
    // SAFETY: the four handles point to tensors alive for the call.
    let code = unsafe {
        ffi::tdx_adamw_step(ptr(p), ptr(g), ptr(m), ptr(v), lr, c.beta1, c.beta2, c.weight_decay, c.eps, step, chunk)
    };
    check(code, std::time::Duration::ZERO, || format!("AdamW step of a {:?} {:?} parameter", p.size(), p.kind()))
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        let _s = crate::timeline::span("optimizer", || "AdamW step".into());
        let _g = tch::no_grad_guard();
        let mut fused: Vec<FusedGroup> = Vec::new();
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
            // the kernel walks flat memory, and takes one device and dtype per call (as PyTorch groups)
            if self.config.fused && p.numel() > 0 && g.kind() == p.kind() && p.is_contiguous() && g.is_contiguous() {
                self.step[i] += 1;
                let group = (p.device(), p.kind());
                match fused.iter_mut().find(|(k, _, _)| *k == group) {
                    Some((_, idx, grads)) => {
                        idx.push(i);
                        grads.push(g);
                    }
                    None => fused.push((group, vec![i], vec![g])),
                }
                continue;
            }
            let (Some(m), Some(v)) = (&self.exp_avg[i], &self.exp_avg_sq[i]) else { continue };
            self.step[i] += 1;
            update(&p, &g, m, v, self.lr, &self.config, self.step[i])?;
        }
        for (_, idx, grads) in fused {
            self.step_fused(&idx, &grads)?;
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
