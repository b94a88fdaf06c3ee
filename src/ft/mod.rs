//! Fault tolerance per step for data-parallel replicas (torchft's design): when a replica is lost, the
//! others discard the step it broke, agree on who is left, rebuild their replicate group in the same
//! processes and run that step again; when it comes back, a healthy replica sends it its state over the
//! network and it takes part again. Nobody restarts and nothing is read from disk.
//!
//! - A **replica** is a group of ranks holding one copy of the model (one rank, or several running
//!   DDP, FSDP or TP among themselves). Replicas train in lockstep, their gradients averaged.
//! - The [`Lighthouse`] (run by `tchrun lighthouse`) forms a [`Quorum`] per step from the replicas whose
//!   heartbeats arrive, and hosts the store the replicate groups meet in. Only it forms quorums: a
//!   replica cut off from it stops (after `quorum_timeout`) instead of training alone.
//! - A [`Manager`] per process joins each step's quorum ([`Manager::start_step`]), rebuilds the
//!   replicate group when the members changed, heals this replica when it is behind, and reduces
//!   across the replicas: DDP's buckets through its [`comm_hook`](Manager::comm_hook), or, for HSDP (a
//!   replica sharded with FSDP over its own ranks), each reduce-scattered chunk through
//!   [`fsdp_replicas`](Manager::fsdp_replicas). [`Manager::should_commit`] says whether the step's
//!   reduction reached every member.
//! - **Healing** sends what [`ReplicaState`] names: a VarStore's variables, or an FSDP model's shards
//!   and buffers (local rank `l` of a healthy replica to local rank `l` of the one behind), with the
//!   optimizer's state and the step.
//! - **The global batch** follows torchft: each replica reads its own shard, and the gradient is the
//!   mean over the replicas that took part in the step, so a step with a replica missing averages fewer
//!   samples rather than re-sharding the data.
//!
//! ```no_run
//! use tch_dist::prelude::*;
//! use std::sync::Arc;
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! use tch_dist::ddp::{DdpOptions, DistributedDataParallel};
//! use tch_dist::ft::{Manager, ManagerConfig};
//! use tch_dist::optim::{AdamW, Optimizer};
//! use tch_dist::{GroupOptions, ProcessGroup, Store};
//!
//! // one rank per replica: DDP over a one-rank group, the manager's hook reduces across replicas
//! let own = Arc::new(ProcessGroup::new(&Store::hash()?, 0, 1, &GroupOptions::default())?);
//! let mut manager = Manager::new(ManagerConfig::from_env()?, None)?;
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::linear(vs.root() / "l", 8, 1, Default::default());
//! let ddp = DistributedDataParallel::new(&vs, net, DdpOptions::default().process_group(own).comm_hook(manager.comm_hook()))?;
//! let mut opt = AdamW::new(vs.trainable_variables(), 1e-3);
//! while manager.step() < 100 {
//!     manager.start_step(&vs, &mut opt)?; // quorum; rebuild and heal when needed
//!     let x = Tensor::randn([16, 8], (Kind::Float, Device::Cpu)); // this replica's batch of this step
//!     ddp.backward(&ddp.forward(&x).square().mean(Kind::Float))?;
//!     if manager.should_commit()? {
//!         opt.step()?;
//!     }
//!     opt.zero_grad()?;
//! }
//! # Ok::<(), tch_dist::Error>(())
//! ```
mod heal;
mod hook;
mod lighthouse;
mod manager;
mod state;
mod wire;

pub use lighthouse::{Lighthouse, LighthouseConfig};
pub use manager::{Manager, ManagerConfig, StepStart};
pub use state::ReplicaState;
pub use wire::{Member, Quorum};
