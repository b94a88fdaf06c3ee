//! The layers a plan returns: tch's own, or their tensor-parallel (or synchronised) forms, behind one
//! type each so that the model's code is the same for every layout.
use tch::{nn, Tensor};

use crate::error::Result;
use crate::sync_batch_norm::SyncBatchNorm;
use crate::tp::{ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding};

/// A linear layer: tch's, column-parallel or row-parallel.
#[derive(Debug)]
pub enum Linear {
    Local(nn::Linear),
    Column(ColumnParallelLinear),
    Row(RowParallelLinear),
}

impl Linear {
    /// The weight `[out, in]` as this rank holds it: tch's `ws` whole, a column-parallel layer's rows
    /// of it, a row-parallel layer's columns.
    pub fn ws(&self) -> &Tensor {
        match self {
            Linear::Local(l) => &l.ws,
            Linear::Column(l) => &l.ws,
            Linear::Row(l) => &l.ws,
        }
    }

    /// The bias as this rank holds it (a column-parallel layer's part; a row-parallel layer's whole).
    pub fn bs(&self) -> Option<&Tensor> {
        match self {
            Linear::Local(l) => l.bs.as_ref(),
            Linear::Column(l) => l.bs.as_ref(),
            Linear::Row(l) => l.bs.as_ref(),
        }
    }

    /// The layer's output, errors returned.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Local(l) => Ok(x.f_linear(&l.ws, l.bs.as_ref())?),
            Linear::Column(l) => l.f_forward(x),
            Linear::Row(l) => l.f_forward(x),
        }
    }
}

/// An embedding: tch's, or split by vocabulary.
#[derive(Debug)]
pub enum Embedding {
    Local(nn::Embedding),
    Vocab(VocabParallelEmbedding),
}

impl Embedding {
    /// The table `[num, dim]` as this rank holds it: tch's `ws` whole, or this rank's rows of the
    /// vocabulary.
    pub fn ws(&self) -> &Tensor {
        match self {
            Embedding::Local(e) => &e.ws,
            Embedding::Vocab(e) => &e.ws,
        }
    }

    /// The embeddings of `ids`, errors returned.
    pub fn f_forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Embedding::Local(e) => Ok(nn::Module::forward(e, ids)),
            Embedding::Vocab(e) => e.f_forward(ids),
        }
    }
}

/// A batch-normalization layer: tch's, or one whose training statistics are a group's.
#[derive(Debug)]
pub enum BatchNorm {
    Local(nn::BatchNorm),
    Sync(SyncBatchNorm),
}

impl BatchNorm {
    /// The layer's output, errors returned.
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            BatchNorm::Local(b) => Ok(nn::ModuleT::forward_t(b, x, train)),
            BatchNorm::Sync(b) => b.f_forward_t(x, train),
        }
    }
}

impl nn::ModuleT for BatchNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(x, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

module!(Linear);
module!(Embedding);
