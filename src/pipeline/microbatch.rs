//! Splitting a batch into equal microbatches along the batch dimension.
use tch::Tensor;

use crate::error::{Error, Result};

/// `m` equal chunks of `t` along dimension 0; errors if the batch does not divide.
pub(crate) fn split(t: &Tensor, m: usize, what: &str) -> Result<Vec<Tensor>> {
    let b = t.size().first().copied().unwrap_or(0);
    if m == 0 || b % m as i64 != 0 {
        return Err(Error::invalid(
            "microbatching",
            format!("{what}: batch of {b} does not split into {m} equal microbatches"),
        ));
    }
    Ok(t.f_split(b / m as i64, 0)?)
}
