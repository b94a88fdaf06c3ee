//! Expert parallelism: a mixture-of-experts layer whose experts are spread over the ranks of an
//! expert-parallel group, tokens sent to their experts and back by all-to-all (GShard's and torchtitan's
//! `expert_parallel_degree`).
//!
//! Each rank routes its own tokens ([`router`]: top-k over a replicated linear router, a fixed capacity
//! per expert, GShard's order of priority, the load-balancing loss); the [`Moe`] layer packs them into one
//! buffer of `capacity` rows per expert, an all-to-all ([`all_to_all`], differentiable) brings every
//! rank's rows to the rank that holds their expert, the experts run as one batched matrix product, and a
//! second all-to-all takes the results home. Sizes are fixed by the capacity, so no token count is read on
//! the host: nothing in a step waits for the GPU.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tch::{nn, Device, Kind, Tensor};
//! use tch_dist::moe::{Moe, MoeConfig};
//! let ep = Arc::new(tch_dist::ProcessGroup::from_env()?);     // e.g. 4 ranks, 2 experts each
//! let vs = nn::VarStore::new(Device::Cpu);
//! let moe = Moe::new(&(vs.root() / "moe"), 64, 256, 8, ep, MoeConfig::default())?;
//! let out = moe.f_forward(&Tensor::randn([32, 64], (Kind::Float, Device::Cpu)))?;
//! let loss = out.output.square().mean(Kind::Float) + 0.01 * &out.aux_loss;
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod all_to_all;
mod layer;
pub mod router;

pub use all_to_all::all_to_all;
pub use layer::{Moe, MoeConfig, MoeOutput};
