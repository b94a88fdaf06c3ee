//! PyTorch's `DistributedSampler`, index for index.
use crate::error::{Error, Result};
use crate::group::ProcessGroup;

/// How a [`DistributedSampler`] orders and cuts the indices (PyTorch's defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplerOptions {
    /// A new permutation every epoch, from `seed + epoch` (the same on every rank).
    pub shuffle: bool,
    pub seed: u64,
    /// Drop the tail that does not divide evenly among the ranks, instead of padding by repeating
    /// indices from the start.
    pub drop_last: bool,
}

impl Default for SamplerOptions {
    fn default() -> Self {
        SamplerOptions { shuffle: true, seed: 0, drop_last: false }
    }
}

impl SamplerOptions {
    pub fn shuffle(mut self, on: bool) -> Self {
        self.shuffle = on;
        self
    }
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    pub fn drop_last(mut self, on: bool) -> Self {
        self.drop_last = on;
        self
    }
}

/// Rank `rank`'s share of the indices `0..len` of a dataset, for `num_replicas` ranks: with the same
/// arguments, exactly the indices PyTorch's `DistributedSampler` yields.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    opts: SamplerOptions,
    epoch: u64,
    num_samples: usize,
}

impl DistributedSampler {
    pub fn new(len: usize, num_replicas: usize, rank: usize, opts: SamplerOptions) -> Result<DistributedSampler> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(Error::invalid(
                "DistributedSampler",
                format!("rank {rank} is not in 0..{num_replicas} (num_replicas {num_replicas})"),
            ));
        }
        let num_samples = if opts.drop_last && !len.is_multiple_of(num_replicas) {
            // ceil((len - num_replicas) / num_replicas), never below zero
            len.saturating_sub(num_replicas).div_ceil(num_replicas)
        } else {
            len.div_ceil(num_replicas)
        };
        Ok(DistributedSampler { dataset_len: len, num_replicas, rank, opts, epoch: 0, num_samples })
    }

    /// For this process's rank in `pg`.
    pub fn for_group(len: usize, pg: &ProcessGroup, opts: SamplerOptions) -> Result<DistributedSampler> {
        DistributedSampler::new(len, pg.size(), pg.rank(), opts)
    }

    /// The epoch decides the shuffle: call it at the start of every epoch, or every epoch repeats the
    /// first one's order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Indices this rank gets per epoch.
    pub fn len(&self) -> usize {
        self.num_samples
    }

    pub fn is_empty(&self) -> bool {
        self.num_samples == 0
    }

    /// This epoch's indices for this rank.
    pub fn indices(&self) -> Result<Vec<i64>> {
        let mut all: Vec<i64> = if self.opts.shuffle {
            crate::random::randperm(self.dataset_len as i64, self.opts.seed.wrapping_add(self.epoch))?
        } else {
            (0..self.dataset_len as i64).collect()
        };
        let total = self.num_samples * self.num_replicas;
        if self.opts.drop_last {
            all.truncate(total);
        } else if !all.is_empty() {
            // pad by repeating from the start, as many times as needed
            let mut k = 0;
            while all.len() < total {
                all.push(all[k]);
                k += 1;
            }
        }
        Ok(all.into_iter().skip(self.rank).step_by(self.num_replicas).take(self.num_samples).collect())
    }
}
