//! Mixed precision, as `torch.amp`: [`autocast`] runs a forward with matmuls and convolutions in a 16-bit
//! type while parameters stay float32, and [`GradScaler`] scales the loss so float16 gradients do not
//! underflow, skipping steps whose gradients overflowed (on every rank alike).
//!
//! For memory, the other form is 16-bit parameters with float32 master weights kept by
//! [`crate::zero::ShardedOptimizer`] (the ZeRO paper's mixed precision: 2 bytes per parameter on every
//! rank, the float32 copy and Adam's state sharded).
//!
//! ```no_run
//! use tch_dist::prelude::*;
//! use tch::{Device, Kind};
//! use tch_dist::amp::{autocast, GradScaler};
//! # fn f(ddp: &tch_dist::ddp::DistributedDataParallel<tch::nn::Linear>, opt: &mut tch_dist::optim::AdamW, x: &tch::Tensor) -> tch_dist::Result<()> {
//! let mut scaler = GradScaler::new().process_group(ddp.process_group().clone());
//! let out = ddp.forward_with(|m| autocast(Device::Cpu, Kind::BFloat16, || tch::nn::Module::forward(m, x)))??;
//! let loss = out.to_kind(Kind::Float).mean(Kind::Float);
//! ddp.backward(&scaler.scale(&loss)?)?;
//! scaler.step(opt)?;   // unscales, skips the step on inf/NaN
//! scaler.update()?;
//! # Ok(()) }
//! ```
mod autocast;
mod scaler;

pub use autocast::{autocast, AutocastGuard};
pub use scaler::{GradScaler, GradScalerConfig};
