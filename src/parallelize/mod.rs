//! One model source for every layout, as torchtitan's `parallelize.py`: the model creates its layers
//! through a [`Plan`], which returns for each VarStore path the layer its style asks for: tch's own
//! `nn::linear` / `nn::embedding` where no style matches (or the tensor-parallel group has one rank), a
//! column- or row-parallel linear, a vocabulary-parallel embedding. Styles are chosen by path pattern,
//! as `parallelize_module`'s plan is; the model code does not change between layouts.
//!
//! ```no_run
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! use tch_dist::mesh::DeviceMesh;
//! use tch_dist::parallelize::{Plan, Style};
//! let world = tch_dist::ProcessGroup::from_env()?;
//! let mesh = DeviceMesh::new(&world, &[("dp", world.size() / 2), ("tp", 2)])?;
//! let plan = Plan::tensor_parallel(&mesh, "tp")?
//!     .style("*.fc", Style::colwise())
//!     .style("*.proj", Style::rowwise());
//! // the model, written once: unchanged whatever the plan
//! let vs = nn::VarStore::new(Device::Cpu);
//! let fc = plan.linear(&(vs.root() / "mlp" / "fc"), 64, 256, Default::default())?;
//! let proj = plan.linear(&(vs.root() / "mlp" / "proj"), 256, 64, Default::default())?;
//! let y = proj.forward(&fc.forward(&Tensor::randn([8, 64], (Kind::Float, Device::Cpu))).gelu("none"));
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod current;
pub(crate) mod data_parallelism;
mod layers;
mod parallel;
mod plan;
mod replicas;

pub(crate) use current::{batch_norm1d, batch_norm2d, batch_norm3d, embedding, linear, unit};
pub use current::{current, PlanGuard};

pub use layers::{BatchNorm, Embedding, Linear};
pub use parallel::{Parallel, Unit};
pub use plan::{Plan, Style};
