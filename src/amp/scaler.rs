//! Dynamic loss scaling, as `torch.amp.GradScaler`: the loss is multiplied by a scale before backward so
//! that small float16 gradients survive; before the step they are divided back. A step whose gradients
//! hold inf or NaN is skipped and the scale shrinks; after `growth_interval` good steps in a row it grows.
//! With a process group, ranks agree on skipping (a MAX-allreduce of the flag): under ZeRO-2 each rank
//! sees only its gradient shard, so one rank's overflow must stop every rank's step.
//!
//! As PyTorch's, unscaling runs ATen's foreach kernel on the gradients' device into a device flag, and
//! the ranks' flags are reduced there too (on NCCL for CUDA gradients); the flag is read on the host once
//! per step, by [`step`](GradScaler::step).
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::ffi;
use crate::group::{ProcessGroup, ReduceOp};
use crate::optim::Optimizer;

/// [`GradScaler`]'s settings (an options struct with `Default`): PyTorch's defaults, scale 2^16, growth
/// ×2 after 2000 steps without overflow, backoff ×0.5.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

impl GradScalerConfig {
    /// The scaler; [`GradScaler::process_group`] makes the ranks of a group skip steps together.
    pub fn build(self) -> GradScaler {
        GradScaler {
            scale: self.init_scale,
            config: self,
            growth_tracker: 0,
            pg: None,
            found_inf: None,
            stepped: false,
        }
    }
}

pub struct GradScaler {
    scale: f64,
    /// The settings it was built with (the setters change them); the scale moves from `init_scale`.
    pub config: GradScalerConfig,
    growth_tracker: u32,
    pg: Option<Arc<ProcessGroup>>,
    /// Set by unscaling, cleared by `update`: 1 where this step's gradients overflowed on some rank (on the
    /// gradients' device), and its value once read.
    found_inf: Option<(Tensor, Option<bool>)>,
    stepped: bool,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

impl GradScaler {
    /// With PyTorch's defaults ([`GradScalerConfig::default`]); the setters below change one each.
    pub fn new() -> GradScaler {
        GradScalerConfig::default().build()
    }
    pub fn init_scale(mut self, s: f64) -> Self {
        self.config.init_scale = s;
        self.scale = s;
        self
    }
    pub fn growth_factor(mut self, f: f64) -> Self {
        self.config.growth_factor = f;
        self
    }
    pub fn backoff_factor(mut self, f: f64) -> Self {
        self.config.backoff_factor = f;
        self
    }
    pub fn growth_interval(mut self, n: u32) -> Self {
        self.config.growth_interval = n;
        self
    }
    /// Ranks of `pg` skip steps together.
    pub fn process_group(mut self, pg: Arc<ProcessGroup>) -> Self {
        self.pg = Some(pg);
        self
    }

    /// The current scale (float32, as PyTorch keeps it).
    pub fn get_scale(&self) -> f64 {
        self.scale as f32 as f64
    }

    /// `loss × scale`; backward from this.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.f_mul_scalar(self.get_scale())?)
    }

    /// Divides the optimizer's gradients by the scale in place and records whether any is inf or NaN on
    /// any rank. Called by [`step`](Self::step) if not before (call it first to clip unscaled gradients).
    pub fn unscale(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        if self.found_inf.is_some() {
            return Err(Error::invalid("GradScaler::unscale", "already called since the last update()"));
        }
        let _g = tch::no_grad_guard();
        // PyTorch computes 1/scale in double and rounds it to float32
        let inv = (1.0 / self.scale) as f32 as f64;
        // ATen's kernel takes the gradients of one device at a time
        let mut by_device: Vec<(Device, Vec<Tensor>)> = Vec::new();
        for g in opt.gradients()? {
            if g.kind() == Kind::Half {
                return Err(Error::invalid(
                    "GradScaler::unscale",
                    "gradients are float16: keep float32 parameters under autocast, or float32 master weights (ShardedOptimizer over float16 parameters)",
                ));
            }
            match by_device.iter_mut().find(|(d, _)| *d == g.device()) {
                Some((_, gs)) => gs.push(g),
                None => by_device.push((g.device(), vec![g])),
            }
        }
        // one device on every rank, whatever gradients a rank holds: the group's GPU when it has NCCL
        let home = match &self.pg {
            Some(pg) => pg.scalar_device(),
            None => by_device.first().map_or(Device::Cpu, |(d, _)| *d),
        };
        let mut found = Tensor::f_zeros([1], (Kind::Float, home))?;
        for (device, gs) in &by_device {
            let flag = Tensor::f_zeros([1], (Kind::Float, *device))?;
            let inv_t = Tensor::f_full([1], inv, (Kind::Float, *device))?;
            ffi::amp_unscale(gs, &flag, &inv_t)
                .map_err(|e| e.in_op(format!("GradScaler::unscale of {} gradients on {device:?}", gs.len())))?;
            // (a copy between devices only where the gradients span several: offload)
            found = found.f_maximum(&flag.f_to_device(home)?)?;
        }
        if let Some(pg) = &self.pg {
            let _l = crate::flight::label("GradScaler overflow flag");
            pg.allreduce_unverified(&mut found, ReduceOp::Max)?.wait()?;
        }
        self.found_inf = Some((found, None));
        Ok(())
    }

    /// Whether this step's gradients overflowed on some rank: the flag read once.
    fn overflowed(&mut self) -> Result<Option<bool>> {
        let Some((flag, read)) = &mut self.found_inf else { return Ok(None) };
        if read.is_none() {
            *read = Some(flag.f_double_value(&[0])? != 0.0);
        }
        Ok(*read)
    }

    /// Unscales (if not done) and steps `opt` unless a gradient overflowed; returns whether it stepped.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<bool> {
        if self.stepped {
            return Err(Error::invalid("GradScaler::step", "called twice without update()"));
        }
        if self.found_inf.is_none() {
            self.unscale(opt)?;
        }
        self.stepped = true;
        if self.overflowed()? == Some(true) {
            return Ok(false);
        }
        opt.step()?;
        Ok(true)
    }

    /// Adjusts the scale after a step: ×backoff after an overflow, ×growth after `growth_interval` good
    /// steps in a row (PyTorch's `_amp_update_scale_`).
    pub fn update(&mut self) -> Result<()> {
        let found = self.overflowed()?.ok_or_else(|| {
            Error::invalid("GradScaler::update", "no gradients were unscaled since the last update (call step first)")
        })?;
        self.found_inf = None;
        self.stepped = false;
        if found {
            self.scale = (self.scale * self.config.backoff_factor) as f32 as f64;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.config.growth_interval {
                let grown = (self.scale * self.config.growth_factor) as f32 as f64;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            }
        }
        Ok(())
    }

    /// Whether the last unscaled step found inf or NaN on some rank (`None` before unscaling).
    pub fn found_inf(&self) -> Option<bool> {
        let (flag, read) = self.found_inf.as_ref()?;
        read.or_else(|| flag.f_double_value(&[0]).ok().map(|v| v != 0.0))
    }

    /// (scale, growth tracker), for checkpoints.
    pub fn state(&self) -> (f64, u32) {
        (self.scale, self.growth_tracker)
    }

    pub fn load_state(&mut self, scale: f64, growth_tracker: u32) {
        self.scale = scale;
        self.growth_tracker = growth_tracker;
    }
}
