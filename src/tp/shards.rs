//! Where each tensor-parallel layer's slices lie in the full layer's tensors, for checkpoints that load
//! onto another tensor-parallel degree ([`crate::checkpoint::StateDict::sharded`]).
use tch::Tensor;

use super::{ColumnParallelLinear, ParallelAttention, ParallelMlp, RowParallelLinear, VocabParallelEmbedding};
use crate::checkpoint::{Sharded, TensorShard};

impl Sharded for ColumnParallelLinear {
    /// The weight's rows and the bias: slice `rank` of `size` along dimension 0.
    fn shards(&self) -> Vec<TensorShard> {
        let (r, t) = (self.tp_rank(), self.tp_size());
        std::iter::once(&self.ws).chain(self.bs.as_ref()).map(|x| TensorShard::along(x, 0, r, t)).collect()
    }
}

impl Sharded for RowParallelLinear {
    /// The weight's columns (the bias is whole).
    fn shards(&self) -> Vec<TensorShard> {
        vec![TensorShard::along(&self.ws, 1, self.tp_rank(), self.tp_size())]
    }
}

impl Sharded for ParallelMlp {
    fn shards(&self) -> Vec<TensorShard> {
        let mut v = self.fc1.shards();
        v.extend(self.fc2.shards());
        v
    }
}

impl Sharded for ParallelAttention {
    /// The QKV projection holds this rank's heads of the queries, keys and values, one block of rows each:
    /// viewed as `[3, d/t, ...]`, a slice along dimension 1 of the full `[3, d, ...]` (queries, keys,
    /// values; `in_proj_weight.view(3, d, d)` in PyTorch's terms).
    fn shards(&self) -> Vec<TensorShard> {
        let (r, t) = (self.qkv.tp_rank(), self.qkv.tp_size());
        let heads = |x: &Tensor| {
            let size = x.size();
            let local: Vec<i64> = [vec![3, size[0] / 3], size[1..].to_vec()].concat();
            let mut global = local.clone();
            global[1] *= t;
            let mut offsets = vec![0; local.len()];
            offsets[1] = r * local[1];
            TensorShard { tensor: x.shallow_clone(), global_shape: global, offsets, local_shape: local }
        };
        let mut v: Vec<TensorShard> = std::iter::once(&self.qkv.ws).chain(self.qkv.bs.as_ref()).map(heads).collect();
        v.extend(self.out.shards());
        v
    }
}

impl Sharded for VocabParallelEmbedding {
    /// The table's rows of this rank's vocabulary range.
    fn shards(&self) -> Vec<TensorShard> {
        let (start, end) = self.vocab_range();
        let size = self.ws.size();
        let mut global = size.clone();
        global[0] = (end - start) * self.tp_size();
        let mut offsets = vec![0; size.len()];
        offsets[0] = start;
        vec![TensorShard { tensor: self.ws.shallow_clone(), global_shape: global, offsets, local_shape: size }]
    }
}
