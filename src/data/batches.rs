//! Batches of (input, target) rows picked by a list of indices, e.g. a rank's share from
//! [`DistributedSampler`](super::DistributedSampler).
use tch::Tensor;

use crate::error::{Error, Result};

/// Iterates over `(xs[idx], ys[idx])` for consecutive chunks of `batch_size` indices; the last batch
/// may be smaller (drop it with [`drop_last`](Self::drop_last), as a `DataLoader` does).
#[derive(Debug)]
pub struct Batches {
    xs: Tensor,
    ys: Tensor,
    indices: Tensor,
    batch_size: i64,
    pos: i64,
    end: i64,
}

impl Batches {
    /// Fails if an index is outside the first dimension of `xs` or `ys`, or the batch size is 0.
    pub fn new(xs: &Tensor, ys: &Tensor, indices: Vec<i64>, batch_size: usize) -> Result<Batches> {
        let rows = |t: &Tensor, what: &str| -> Result<i64> {
            t.size()
                .first()
                .copied()
                .ok_or_else(|| Error::invalid("Batches::new", format!("{what} is a scalar; rows are needed")))
        };
        let n = rows(xs, "xs")?.min(rows(ys, "ys")?);
        if batch_size == 0 {
            return Err(Error::invalid("Batches::new", "batch_size is 0"));
        }
        if let Some(bad) = indices.iter().find(|&&i| i < 0 || i >= n) {
            return Err(Error::invalid("Batches::new", format!("index {bad} is outside the {n} rows of xs and ys")));
        }
        let end = indices.len() as i64;
        let indices = Tensor::from_slice(&indices).f_to_device(xs.device())?;
        Ok(Batches {
            xs: xs.shallow_clone(),
            ys: ys.shallow_clone(),
            indices,
            batch_size: batch_size as i64,
            pos: 0,
            end,
        })
    }

    /// Stops before a last batch smaller than `batch_size`.
    pub fn drop_last(mut self) -> Self {
        self.end -= self.end % self.batch_size;
        self
    }
}

impl Iterator for Batches {
    type Item = (Tensor, Tensor);

    fn next(&mut self) -> Option<(Tensor, Tensor)> {
        if self.pos >= self.end {
            return None;
        }
        let k = self.batch_size.min(self.end - self.pos);
        let idx = self.indices.narrow(0, self.pos, k);
        self.pos += k;
        // the indices were checked against both tensors when the iterator was made
        Some((self.xs.index_select(0, &idx), self.ys.index_select(0, &idx.to_device(self.ys.device()))))
    }
}
