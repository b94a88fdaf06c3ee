//! Tensor parallelism, Megatron-LM style: weight matrices split across the ranks of a tensor-parallel
//! group, joined by conjugate operators ([`ops`]): an MLP costs one allreduce forward and one backward.
//! A [`DeviceMesh`](crate::mesh::DeviceMesh) carves tensor- and data-parallel groups from one world, so
//! TP combines with DDP.
//!
//! ```no_run
//! use tch::{nn, Device, Kind, Tensor};
//! use tch_dist::{mesh::DeviceMesh, tp::ParallelMlp};
//! let world = tch_dist::ProcessGroup::from_env()?;                 // e.g. 4 ranks
//! let mesh = DeviceMesh::new(&world, &[("dp", 2), ("tp", 2)])?;   // 2-way DP x 2-way TP
//! let vs = nn::VarStore::new(Device::Cpu);
//! let mlp = ParallelMlp::new(&vs.root(), 1024, 4096, mesh.group("tp")?)?; // nn::linear's values, sliced
//! let y = mlp.f_forward(&Tensor::randn([8, 1024], (Kind::Float, Device::Cpu)))?; // or `forward`, as an nn::Module
//! # Ok::<(), tch_dist::Error>(())
//! ```
pub mod attention;
pub(crate) mod init;
pub mod layers;
pub mod ops;
pub mod vocab;

pub use attention::{ParallelAttention, ParallelAttentionConfig};
pub use layers::{ColumnParallelConfig, ColumnParallelLinear, ParallelMlp, RowParallelConfig, RowParallelLinear};
pub use vocab::{vocab_parallel_cross_entropy, VocabParallelEmbedding};
