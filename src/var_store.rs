//! What the wrappers read of a tch `VarStore`.
use tch::{nn, Tensor};

/// Every variable of `vs` (parameters and buffers) by name, sorted: the same order on every rank.
pub(crate) fn sorted_variables(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}
