//! Cutting a layer list into contiguous stages: by hand (layers per stage, or cut points) or balanced by a
//! cost per layer (parameter bytes, or profiled time as torchgpipe's `balance_by_time`).
use crate::error::{Error, Result};

/// How many consecutive layers each stage gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    pub sizes: Vec<usize>,
}

impl Partition {
    /// `sizes[s]` layers for stage `s`, e.g. `[3, 2]`.
    pub fn sizes(sizes: &[usize], n_layers: usize) -> Result<Partition> {
        if sizes.is_empty() || sizes.contains(&0) {
            return Err(Error::invalid("partition", format!("{sizes:?}: every stage needs at least one layer")));
        }
        let total: usize = sizes.iter().sum();
        if total != n_layers {
            return Err(Error::invalid(
                "partition",
                format!("{sizes:?} covers {total} layers, the model has {n_layers}"),
            ));
        }
        Ok(Partition { sizes: sizes.to_vec() })
    }

    /// Cut before each listed layer index, e.g. `[3]` splits 5 layers into `[3, 2]`.
    pub fn cuts(cuts: &[usize], n_layers: usize) -> Result<Partition> {
        let mut prev = 0;
        let mut sizes = Vec::new();
        for &c in cuts {
            if c <= prev || c >= n_layers {
                return Err(Error::invalid(
                    "partition",
                    format!("cut points {cuts:?} must increase strictly within 1..{n_layers}"),
                ));
            }
            sizes.push(c - prev);
            prev = c;
        }
        sizes.push(n_layers - prev);
        Ok(Partition { sizes })
    }

    /// Contiguous stages minimising the largest stage cost (e.g. bytes or seconds per layer).
    pub fn balanced(costs: &[f64], stages: usize) -> Result<Partition> {
        let n = costs.len();
        if stages == 0 || stages > n {
            return Err(Error::invalid("partition", format!("cannot cut {n} layers into {stages} non-empty stages")));
        }
        if let Some(i) = costs.iter().position(|c| !(c.is_finite() && *c >= 0.0)) {
            return Err(Error::invalid("partition", format!("cost of layer {i} is {}", costs[i])));
        }
        // best[k][i]: minimal max-cost splitting the first i layers into k stages; exact O(stages * n^2).
        let prefix: Vec<f64> = std::iter::once(0.0)
            .chain(costs.iter().scan(0.0, |a, &c| {
                *a += c;
                Some(*a)
            }))
            .collect();
        let inf = f64::INFINITY;
        let mut best = vec![vec![inf; n + 1]; stages + 1];
        let mut cut = vec![vec![0usize; n + 1]; stages + 1];
        best[0][0] = 0.0;
        for k in 1..=stages {
            for i in k..=n {
                for j in (k - 1)..i {
                    let c = best[k - 1][j].max(prefix[i] - prefix[j]);
                    if c < best[k][i] {
                        best[k][i] = c;
                        cut[k][i] = j;
                    }
                }
            }
        }
        let mut sizes = vec![0; stages];
        let mut i = n;
        for k in (1..=stages).rev() {
            let j = cut[k][i];
            sizes[k - 1] = i - j;
            i = j;
        }
        Ok(Partition { sizes })
    }

    pub fn stages(&self) -> usize {
        self.sizes.len()
    }

    /// Layer index ranges per stage.
    pub fn ranges(&self) -> Vec<std::ops::Range<usize>> {
        let mut start = 0;
        self.sizes
            .iter()
            .map(|&n| {
                let r = start..start + n;
                start += n;
                r
            })
            .collect()
    }
}
