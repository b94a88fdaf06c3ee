//! The plan: a tensor-parallel group and a style per path pattern.
use std::sync::Arc;

use tch::nn;

use super::layers::{Embedding, Linear};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::mesh::DeviceMesh;
use crate::tp::VocabParallelEmbedding;
use crate::tp::{ColumnParallelConfig, ColumnParallelLinear, RowParallelConfig, RowParallelLinear};

/// How a layer is split over the tensor-parallel group (PyTorch's `ParallelStyle`).
#[derive(Clone, Copy, Debug)]
pub enum Style {
    /// A linear layer's output features split ([`ColumnParallelLinear`]). Its `linear` field is not
    /// read: the model's own `nn::LinearConfig` is.
    Colwise(ColumnParallelConfig),
    /// A linear layer's input features split ([`RowParallelLinear`]); on an embedding, its rows, i.e.
    /// the vocabulary ([`VocabParallelEmbedding`]), as PyTorch's `RowwiseParallel` on `nn.Embedding`.
    Rowwise(RowParallelConfig),
}

impl Style {
    /// Columns split, each rank keeping its output features (for a row-wise layer after it, or a
    /// vocabulary-parallel loss).
    pub fn colwise() -> Style {
        Style::Colwise(Default::default())
    }

    /// Rows split, the input already split (after a column-wise layer), the output summed.
    pub fn rowwise() -> Style {
        Style::Rowwise(Default::default())
    }
}

/// Which layer each path gets (see the module docs). Cheap to clone; no communication.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    tp: Option<Arc<ProcessGroup>>,
    styles: Vec<(String, Style)>,
}

/// `pattern` against a dotted path: `*` matches any run of characters (dots included), as fnmatch on
/// PyTorch's module names.
fn matches(pattern: &str, path: &str) -> bool {
    let (p, s) = (pattern.as_bytes(), path.as_bytes());
    // classic two-pointer glob with backtracking to the last star
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < s.len() {
        if i < p.len() && p[i] == b'*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if i < p.len() && p[i] == s[j] {
            i += 1;
            j += 1;
        } else if let Some(k) = star {
            i = k + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == b'*')
}

/// The VarStore name prefix of `path` (`"block3.mlp.fc"`).
fn dotted(path: &nn::Path) -> String {
    path.components().collect::<Vec<_>>().join(".")
}

impl Plan {
    /// No parallelism in the layers: every path gets tch's own layer.
    pub fn new() -> Plan {
        Plan::default()
    }

    /// Tensor parallelism over the mesh dimension `dim`.
    pub fn tensor_parallel(mesh: &DeviceMesh, dim: &str) -> Result<Plan> {
        Ok(Plan::over_group(mesh.group(dim)?))
    }

    /// Tensor parallelism over `pg`.
    pub fn over_group(pg: Arc<ProcessGroup>) -> Plan {
        Plan { tp: Some(pg), styles: Vec::new() }
    }

    /// The layers whose path (VarStore names, dotted: `"block3.mlp.fc"`) matches `pattern` take `style`;
    /// the first pattern that matches a path decides it.
    pub fn style(mut self, pattern: &str, style: Style) -> Plan {
        self.styles.push((pattern.to_string(), style));
        self
    }

    /// The tensor-parallel group, when it has more than one rank.
    pub fn tp_group(&self) -> Option<&Arc<ProcessGroup>> {
        self.tp.as_ref().filter(|g| g.size() > 1)
    }

    /// Ranks in the tensor-parallel group (1 without one).
    pub fn tp_size(&self) -> usize {
        self.tp_group().map_or(1, |g| g.size())
    }

    /// The style for `path` and the group it splits over, when the layer is split.
    fn style_of(&self, path: &nn::Path) -> Option<(Style, Arc<ProcessGroup>)> {
        let pg = self.tp_group()?;
        let name = dotted(path);
        self.styles.iter().find(|(p, _)| matches(p, &name)).map(|(_, s)| (*s, pg.clone()))
    }

    /// `nn::linear(path, in_dim, out_dim, config)`, split as the plan says for `path`: with the same
    /// values on the whole as tch's layer after the same seed.
    pub fn linear(&self, path: &nn::Path, in_dim: i64, out_dim: i64, config: nn::LinearConfig) -> Result<Linear> {
        Ok(match self.style_of(path) {
            None => Linear::Local(nn::linear(path, in_dim, out_dim, config)),
            Some((Style::Colwise(c), pg)) => Linear::Column(ColumnParallelLinear::new(
                path,
                in_dim,
                out_dim,
                pg,
                ColumnParallelConfig { linear: config, ..c },
            )?),
            Some((Style::Rowwise(c), pg)) => Linear::Row(RowParallelLinear::new(
                path,
                in_dim,
                out_dim,
                pg,
                RowParallelConfig { linear: config, ..c },
            )?),
        })
    }

    /// `nn::embedding(path, num, dim, config)`, split as the plan says for `path` (row-wise: the
    /// vocabulary).
    pub fn embedding(&self, path: &nn::Path, num: i64, dim: i64, config: nn::EmbeddingConfig) -> Result<Embedding> {
        Ok(match self.style_of(path) {
            None => Embedding::Local(nn::embedding(path, num, dim, config)),
            Some((Style::Rowwise(_), pg)) => Embedding::Vocab(VocabParallelEmbedding::new(path, num, dim, pg, config)?),
            Some((Style::Colwise(_), _)) => {
                return Err(Error::invalid(
                    "Plan::embedding",
                    format!("{}: an embedding splits row-wise (its vocabulary), not column-wise", dotted(path)),
                ));
            }
        })
    }

    /// Per-token cross-entropy of logits from a column-wise layer (each rank's slice of the vocabulary,
    /// [`crate::tp::vocab_parallel_cross_entropy`]); without tensor parallelism, of whole logits.
    pub fn cross_entropy(&self, logits: &tch::Tensor, targets: &tch::Tensor) -> Result<tch::Tensor> {
        match self.tp_group() {
            Some(pg) => crate::tp::vocab_parallel_cross_entropy(logits, targets, pg),
            None => {
                let v = logits.size().last().copied().unwrap_or(0);
                let flat = logits.f_reshape([-1, v])?;
                let loss = flat.f_cross_entropy_loss::<tch::Tensor>(
                    &targets.f_reshape([-1])?,
                    None,
                    tch::Reduction::None,
                    -100,
                    0.0,
                )?;
                Ok(loss.f_reshape(targets.size())?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn patterns_match_as_fnmatch() {
        assert!(matches("*.attn.q", "block0.attn.q"));
        assert!(matches("*.attn.q", "model.block12.attn.q"));
        assert!(!matches("*.attn.q", "block0.attn.qkv"));
        assert!(matches("block*.mlp.*", "block3.mlp.fc"));
        assert!(matches("embed.tok", "embed.tok"));
        assert!(!matches("embed.tok", "embed.tok2"));
        assert!(matches("*", "anything.at.all"));
        assert!(!matches("head", "embed.head"));
    }
}
