//! Dynamic loss scaling, as `torch.amp.GradScaler`: the loss is multiplied by a scale before backward so
//! that small float16 gradients survive; before the step they are divided back. A step whose gradients
//! hold inf or NaN is skipped and the scale shrinks; after `growth_interval` good steps in a row it grows.
//! With a process group, ranks agree on skipping (a MAX-allreduce of the flag): under ZeRO-2 each rank
//! sees only its gradient shard, so one rank's overflow must stop every rank's step.
use std::sync::Arc;

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::{ProcessGroup, ReduceOp};
use crate::optim::Optimizer;

pub struct GradScaler {
    scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u32,
    growth_tracker: u32,
    pg: Option<Arc<ProcessGroup>>,
    /// Set by unscaling, cleared by `update`: whether this step's gradients overflowed on any rank.
    found_inf: Option<bool>,
    stepped: bool,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

impl GradScaler {
    /// PyTorch's defaults: scale 2^16, growth ×2 every 2000 good steps, backoff ×0.5.
    pub fn new() -> GradScaler {
        GradScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            growth_tracker: 0,
            pg: None,
            found_inf: None,
            stepped: false,
        }
    }
    pub fn init_scale(mut self, s: f64) -> Self {
        self.scale = s;
        self
    }
    pub fn growth_factor(mut self, f: f64) -> Self {
        self.growth_factor = f;
        self
    }
    pub fn backoff_factor(mut self, f: f64) -> Self {
        self.backoff_factor = f;
        self
    }
    pub fn growth_interval(mut self, n: u32) -> Self {
        self.growth_interval = n;
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
        let mut local = false;
        for g in opt.gradients()? {
            if g.kind() == Kind::Half {
                return Err(Error::invalid(
                    "GradScaler::unscale",
                    "gradients are float16: keep float32 parameters under autocast, or float32 master weights (ShardedOptimizer over float16 parameters)",
                ));
            }
            let _ = g.shallow_clone().f_mul_scalar_(inv)?;
            if !local {
                local = g.f_isfinite()?.f_all()?.f_int64_value(&[])? == 0;
            }
        }
        let found = match &self.pg {
            Some(pg) => pg.meta().allreduce("GradScaler overflow flag", &[local as i32], ReduceOp::Max)?[0] != 0,
            None => local,
        };
        self.found_inf = Some(found);
        Ok(())
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
        if self.found_inf == Some(true) {
            return Ok(false);
        }
        opt.step()?;
        Ok(true)
    }

    /// Adjusts the scale after a step: ×backoff after an overflow, ×growth after `growth_interval` good
    /// steps in a row (PyTorch's `_amp_update_scale_`).
    pub fn update(&mut self) -> Result<()> {
        let found = self.found_inf.take().ok_or_else(|| {
            Error::invalid("GradScaler::update", "no gradients were unscaled since the last update (call step first)")
        })?;
        self.stepped = false;
        if found {
            self.scale = (self.scale * self.backoff_factor) as f32 as f64;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                let grown = (self.scale * self.growth_factor) as f32 as f64;
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
        self.found_inf
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
