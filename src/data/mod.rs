//! Data for data parallelism: [`DistributedSampler`] gives each rank its share of a dataset's indices,
//! as PyTorch's `torch.utils.data.DistributedSampler` (the same indices for the same arguments), and
//! [`Batches`] cuts a rank's share of tensors into batches.
//!
//! ```no_run
//! use tch_dist::data::{Batches, DistributedSampler, SamplerOptions};
//! # let (pg, xs, ys) = (tch_dist::ProcessGroup::from_env()?, tch::Tensor::zeros([100, 8], tch::kind::FLOAT_CPU), tch::Tensor::zeros([100], tch::kind::INT64_CPU));
//! let mut sampler = DistributedSampler::for_group(xs.size()[0] as usize, &pg, SamplerOptions::default())?;
//! for epoch in 0..10 {
//!     sampler.set_epoch(epoch); // a new shuffle each epoch, the same on every rank
//!     for (x, y) in Batches::new(&xs, &ys, sampler.indices()?, 32)? {
//!         // forward, backward, step
//!     }
//! }
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod batches;
mod sampler;

pub use batches::Batches;
pub use sampler::{DistributedSampler, SamplerOptions};
