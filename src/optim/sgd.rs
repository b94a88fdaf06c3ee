//! SGD with momentum, dampening, Nesterov and weight decay (`torch.optim.SGD`): its multi-tensor path
//! (`foreach`, PyTorch's default on CUDA and ours) or its single-tensor one (the default on the CPU).
use tch::Tensor;

use super::{find, Optimizer};
use crate::error::{Error, Result};
use crate::ffi::{self, add_scaled};

/// SGD's settings, as tch's `nn::Sgd` (an options struct with `Default`): PyTorch's defaults, no
/// momentum, dampening or weight decay, and PyTorch's choice of path (multi-tensor on CUDA).
///
/// ```no_run
/// # use tch_dist::optim::SgdConfig;
/// # let params: Vec<tch::Tensor> = Vec::new();
/// let opt = SgdConfig { momentum: 0.9, nesterov: true, ..Default::default() }.build(params, 0.1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SgdConfig {
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// The multi-tensor path, as `foreach=`: `None` (the default) takes it when every parameter is on
    /// CUDA, as PyTorch does; `Some(true)` everywhere; `Some(false)` nowhere. (Nesterov momentum needs
    /// momentum above 0 and no dampening, refused at the first step otherwise, as PyTorch refuses it.)
    pub foreach: Option<bool>,
}

impl SgdConfig {
    /// The optimizer over `params` at learning rate `lr`.
    pub fn build(self, params: Vec<Tensor>, lr: f64) -> Sgd {
        let n = params.len();
        Sgd { params, lr, config: self, buffers: (0..n).map(|_| None).collect() }
    }
}

pub struct Sgd {
    params: Vec<Tensor>,
    pub lr: f64,
    /// The settings it was built with (the setters change them).
    pub config: SgdConfig,
    buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    /// With PyTorch's defaults ([`SgdConfig::default`]); the setters below change one setting each.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Sgd {
        SgdConfig::default().build(params, lr)
    }
    pub fn momentum(mut self, m: f64) -> Self {
        self.config.momentum = m;
        self
    }
    pub fn dampening(mut self, d: f64) -> Self {
        self.config.dampening = d;
        self
    }
    pub fn nesterov(mut self, on: bool) -> Self {
        self.config.nesterov = on;
        self
    }
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.config.weight_decay = wd;
        self
    }
    /// torch.optim's multi-tensor path (`foreach=True`) on every device, or on none (`false`); by default
    /// on CUDA only, as PyTorch's. Results equal PyTorch's `SGD(foreach=True)`, bit for bit (with Nesterov
    /// momentum it adds the momentum into the gradients in place, as PyTorch's does).
    pub fn foreach(mut self, on: bool) -> Self {
        self.config.foreach = Some(on);
        self
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let c = self.config;
        if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
            return Err(Error::invalid("Sgd", "Nesterov momentum needs momentum > 0 and zero dampening"));
        }
        let _s = crate::timeline::span("optimizer", || "SGD step".into());
        let _g = tch::no_grad_guard();
        // one multi-tensor call per device and dtypes, as PyTorch groups: (device, kinds), indices
        let mut groups: Vec<((tch::Device, tch::Kind, tch::Kind), Vec<usize>)> = Vec::new();
        // PyTorch's default: the multi-tensor path when every parameter is on CUDA
        let all_cuda = self.params.iter().all(|p| p.device().is_cuda());
        for (i, p) in self.params.iter().enumerate() {
            let g = p.grad();
            if !g.defined() {
                super::skip_without_grad("Sgd::step", p)?;
                continue;
            }
            if c.foreach.unwrap_or(all_cuda) {
                let key = (p.device(), p.kind(), g.kind());
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, idx)) => idx.push(i),
                    None => groups.push((key, vec![i])),
                }
                continue;
            }
            // torch.optim.SGD's single-tensor path, call for call: the same floats
            let buf = &mut self.buffers[i];
            let mut d = if c.weight_decay != 0.0 { add_scaled(&g, p, c.weight_decay, false)? } else { g };
            if c.momentum != 0.0 {
                let b = match buf {
                    Some(b) => {
                        let _ = b.f_mul_scalar_(c.momentum)?;
                        add_scaled(b, &d, 1.0 - c.dampening, true)?
                    }
                    None => buf.insert(d.f_detach_copy()?).shallow_clone(),
                };
                d = if c.nesterov { add_scaled(&d, &b, c.momentum, false)? } else { b };
            }
            let _ = add_scaled(p, &d, -self.lr, true)?;
        }
        for (_, idx) in groups {
            let params: Vec<Tensor> = idx.iter().map(|&i| self.params[i].shallow_clone()).collect();
            let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
            let mut bufs: Vec<Option<Tensor>> = idx.iter().map(|&i| self.buffers[i].take()).collect();
            let r = ffi::foreach_sgd(
                &params,
                &grads,
                &mut bufs,
                self.lr,
                c.momentum,
                c.dampening,
                c.nesterov,
                c.weight_decay,
            );
            for (&i, b) in idx.iter().zip(bufs) {
                self.buffers[i] = b;
            }
            r?;
        }
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        crate::hooks::drop_grads(&self.params)
    }

    fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (format!("sgd.{i}.momentum_buffer"), b.shallow_clone())))
            .collect()
    }

    fn gradients(&mut self) -> Result<Vec<Tensor>> {
        Ok(super::grads_of(&self.params))
    }

    fn memory(&self) -> super::OptimizerMemory {
        super::memory_of(&self.state_dict(), &self.params)
    }

    fn stepped(&self) -> Vec<super::Stepped> {
        super::stepped_params("sgd", &self.params)
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        for (i, p) in self.params.iter().enumerate() {
            let key = format!("sgd.{i}.momentum_buffer");
            self.buffers[i] = if state.iter().any(|(n, _)| *n == key) {
                Some(super::restore(self.buffers[i].as_ref(), find(state, &key, p)?)?)
            } else {
                None
            };
        }
        Ok(())
    }
}
