//! PowerSGD gradient compression (Vogels et al., 2019) as a DDP comm hook, with the semantics of
//! PyTorch's `powerSGD_hook`: each 2-D gradient matrix M (n x m) worth compressing is approximated by
//! rank-r factors, P = M Q (allreduced, orthogonalised) and Q = M^T P (allreduced, averaged), so a bucket
//! sends (n + m) r numbers per matrix instead of n m; the rest (biases, small matrices) is allreduced
//! as it is. Error feedback adds what compression lost last time back into the gradients; warm start
//! reuses last step's Q. The first `start_iter` iterations use plain allreduce.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tch_dist::ddp::{DdpOptions, PowerSgd, PowerSgdOptions};
//! # let pg = Arc::new(tch_dist::ProcessGroup::from_env()?);
//! let hook = Arc::new(PowerSgd::new(PowerSgdOptions::default().rank(2).start_iter(10))?);
//! let opts = DdpOptions::default().comm_hook(hook.clone()).process_group(pg);
//! // ... train; then hook.compression() says how much less was sent
//! # Ok::<(), tch_dist::Error>(())
//! ```
//!
//! One difference from PyTorch: the seeds of the random initial Qs come from a small generator of our
//! own ([`PowerSgdOptions::seed`]) instead of numpy's `RandomState`. Every rank draws the same seeds,
//! and from a seed the Qs are PyTorch's (`torch.manual_seed(s)`, then `torch.randn` per matrix).
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;

use super::comm_hook::{CommHook, GradBucket, HookFuture};
use crate::error::{Error, Result};
use crate::group::{ProcessGroup, ReduceOp};

/// PowerSGD's settings, named and defaulted as PyTorch's `PowerSGDState`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerSgdOptions {
    /// r, the rank of the approximation (`matrix_approximation_rank`, 1).
    pub rank: i64,
    /// Plain allreduce for this many iterations first (`start_powerSGD_iter`, 1,000); at least 2 with
    /// error feedback or warm start, since buckets settle after the first iteration.
    pub start_iter: u64,
    /// Compress a matrix only if (n + m) r times this is less than n m (`min_compression_rate`, 2).
    pub min_compression_rate: f64,
    pub error_feedback: bool,
    pub warm_start: bool,
    /// Added to column norms when orthogonalising (`orthogonalization_epsilon`, 0).
    pub epsilon: f64,
    /// Where the seeds of the random initial Qs start (`random_seed`, 0).
    pub seed: u64,
}

impl Default for PowerSgdOptions {
    fn default() -> Self {
        PowerSgdOptions {
            rank: 1,
            start_iter: 1000,
            min_compression_rate: 2.0,
            error_feedback: true,
            warm_start: true,
            epsilon: 0.0,
            seed: 0,
        }
    }
}

impl PowerSgdOptions {
    pub fn rank(mut self, r: i64) -> Self {
        self.rank = r;
        self
    }
    pub fn start_iter(mut self, n: u64) -> Self {
        self.start_iter = n;
        self
    }
    pub fn min_compression_rate(mut self, c: f64) -> Self {
        self.min_compression_rate = c;
        self
    }
    pub fn error_feedback(mut self, on: bool) -> Self {
        self.error_feedback = on;
        self
    }
    pub fn warm_start(mut self, on: bool) -> Self {
        self.warm_start = on;
        self
    }
    pub fn epsilon(mut self, e: f64) -> Self {
        self.epsilon = e;
        self
    }
    pub fn seed(mut self, s: u64) -> Self {
        self.seed = s;
        self
    }
}

/// Numbers a bucket would send without compression, and with it, summed over PowerSGD iterations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compression {
    pub before: u64,
    pub after: u64,
}

impl Compression {
    /// before / after (1 before PowerSGD starts).
    pub fn ratio(&self) -> f64 {
        if self.after == 0 {
            1.0
        } else {
            self.before as f64 / self.after as f64
        }
    }
}

#[derive(Default)]
struct State {
    iter: u64,
    seeds: u64,
    errors: HashMap<usize, Tensor>,
    p_memory: HashMap<usize, Tensor>,
    q_memory: HashMap<usize, Tensor>,
    stats: Compression,
}

/// The PowerSGD comm hook (see the module docs). Keep an `Arc` to read [`compression`](Self::compression).
#[derive(Debug)]
pub struct PowerSgd {
    opts: PowerSgdOptions,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PowerSgdState(iter {})", self.iter)
    }
}

fn lock(s: &Mutex<State>) -> MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl PowerSgd {
    pub fn new(opts: PowerSgdOptions) -> Result<PowerSgd> {
        if (opts.error_feedback || opts.warm_start) && opts.start_iter <= 1 {
            return Err(Error::invalid(
                "PowerSgdOptions::start_iter",
                "must be above 1 with error feedback or warm start: buckets settle only after the first iteration",
            ));
        }
        if opts.rank < 1 {
            return Err(Error::invalid("PowerSgdOptions::rank", format!("{} is below 1", opts.rank)));
        }
        Ok(PowerSgd { opts, state: Arc::new(Mutex::new(State { seeds: opts.seed, ..State::default() })) })
    }

    /// Elements sent so far with and without compression.
    pub fn compression(&self) -> Compression {
        lock(&self.state).stats
    }

    /// Iterations seen (counted at each iteration's last bucket).
    pub fn iterations(&self) -> u64 {
        lock(&self.state).iter
    }
}

/// The seed sequence of the initial Qs: splitmix64, reduced below 10^9 as PyTorch's seeds are.
fn next_seed(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) % 1_000_000_000
}

/// Orthogonalises the columns of each matrix of a batch (b x n x r) in place: Gram-Schmidt for r <= 2 or
/// 16-bit types, QR otherwise (PyTorch's `_orthogonalize`).
fn orthogonalize(m: &Tensor, epsilon: f64) -> Result<()> {
    let r = m.size()[2];
    if r <= 2 || matches!(m.kind(), tch::Kind::Half | tch::Kind::BFloat16) {
        for i in 0..r {
            let mut col = m.f_narrow(2, i, 1)?;
            // torch.norm(col, dim=1, keepdim=True); libtorch's norm computes it as linalg.vector_norm
            let norm = col.f_norm_scalaropt_dim(2.0, [1i64].as_slice(), true)?;
            if epsilon == 0.0 {
                let _ = col.f_div_(&norm)?;
            } else {
                let _ = col.f_div_(&(norm + epsilon))?;
            }
            if i + 1 < r {
                let mut rest = m.f_narrow(2, i + 1, r - i - 1)?;
                let proj = (&col * &rest).f_sum_dim_intlist([1i64].as_slice(), true, None::<tch::Kind>)?;
                let _ = rest.f_sub_(&(proj * &col))?;
            }
        }
    } else {
        let (q, _) = Tensor::f_linalg_qr(m, "reduced")?;
        m.shallow_clone().f_copy_(&q)?;
    }
    Ok(())
}

/// One matrix to compress: its view into the bucket, and its P and Q inside the bucket's memories.
struct Factor {
    matrix: Tensor,
    p: Tensor,
    q: Tensor,
}

impl CommHook for PowerSgd {
    fn run(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket) -> Result<HookFuture> {
        let world = pg.size() as f64;
        let input = bucket.buffer().shallow_clone();
        let b = bucket.index();
        let last = bucket.is_last();
        let mut st = lock(&self.state);
        if st.iter < self.opts.start_iter {
            if last {
                st.iter += 1;
            }
            drop(st);
            let mut t = input.shallow_clone();
            let _ = t.f_div_scalar_(world)?;
            return Ok(HookFuture::after(pg.allreduce_unverified(&mut t, ReduceOp::Sum)?));
        }
        // error feedback: what compression lost last time goes back in; keep the input to measure this time's
        let copy = if self.opts.error_feedback {
            match st.errors.get(&b) {
                Some(e) => {
                    let _ = input.shallow_clone().f_add_(e)?;
                }
                None => {
                    st.errors.insert(b, input.f_zeros_like()?);
                }
            }
            Some(input.f_detach_copy()?)
        } else {
            None
        };
        // which matrices are worth compressing
        let (mut compress, mut plain) = (Vec::new(), Vec::new());
        let (mut p_len, mut q_len) = (0i64, 0i64);
        for g in bucket.gradients() {
            let n = g.size().first().copied().unwrap_or(1);
            let matrix = g.f_view([n, -1])?;
            let m = matrix.size()[1];
            let r = n.min(m).min(self.opts.rank);
            let (before, after) = (n * m, (n + m) * r);
            st.stats.before += before as u64;
            if (after as f64) * self.opts.min_compression_rate < before as f64 {
                st.stats.after += after as u64;
                compress.push((matrix, n, m, r));
                p_len += n * r;
                q_len += m * r;
            } else {
                st.stats.after += before as u64;
                plain.push(g.shallow_clone());
            }
        }
        let fresh = !self.opts.warm_start || !st.p_memory.contains_key(&b);
        if fresh {
            st.p_memory.insert(b, Tensor::f_empty([p_len], (input.kind(), input.device()))?);
            st.q_memory.insert(b, Tensor::f_empty([q_len], (input.kind(), input.device()))?);
        }
        let (p_mem, q_mem) = match (st.p_memory.get(&b), st.q_memory.get(&b)) {
            (Some(p), Some(q)) => (p.shallow_clone(), q.shallow_clone()),
            _ => return Err(Error::invalid("PowerSGD", format!("bucket {b} has no P/Q memory"))),
        };
        let mut factors = Vec::with_capacity(compress.len());
        let (mut pi, mut qi) = (0i64, 0i64);
        for (matrix, n, m, r) in compress {
            let p = p_mem.f_narrow(0, pi, n * r)?.f_view([1, n, r])?;
            let q = q_mem.f_narrow(0, qi, m * r)?.f_view([1, m, r])?;
            pi += n * r;
            qi += m * r;
            factors.push(Factor { matrix: matrix.f_unsqueeze(0)?, p, q });
        }
        if fresh {
            // the same seed on every rank, a new one each time
            let seed = next_seed(&mut st.seeds);
            let shapes: Vec<Vec<i64>> = factors.iter().map(|f| f.q.size()).collect();
            let draws = crate::random::randn_seq(seed, input.kind(), &shapes)?;
            for (f, d) in factors.iter().zip(draws) {
                f.q.shallow_clone().f_copy_(&d)?;
                orthogonalize(&f.q, self.opts.epsilon)?;
            }
        } else {
            for f in &factors {
                orthogonalize(&f.q, self.opts.epsilon)?;
            }
        }
        let warm = self.opts.warm_start;
        let state = self.state.clone();
        drop(st);
        let _g = tch::no_grad_guard();
        for f in &factors {
            let _ = f.matrix.f_bmm_out(&f.p, &f.q)?;
        }
        // the uncompressed tensors go first, as one flat allreduce
        let mut flat = if plain.is_empty() {
            Tensor::f_empty([0], (input.kind(), input.device()))?
        } else {
            Tensor::f_cat(&plain.iter().map(|t| t.f_reshape([-1])).collect::<std::result::Result<Vec<_>, _>>()?, 0)?
        };
        let work = pg.allreduce_unverified(&mut flat, ReduceOp::Sum)?;
        let (pg1, pg2) = (pg.clone(), pg.clone());
        let (p_all, q_all) = (p_mem.shallow_clone(), q_mem.shallow_clone());
        let epsilon = self.opts.epsilon;
        Ok(HookFuture::after(work)
            .then(move || {
                // unpack the uncompressed tensors, averaged; then sum the Ps (no need to average
                // what is orthogonalised next)
                let _ = flat.f_div_scalar_(world)?;
                let mut off = 0i64;
                for t in &plain {
                    let n = t.numel() as i64;
                    t.shallow_clone().f_copy_(&flat.f_narrow(0, off, n)?.f_view_as(t)?)?;
                    off += n;
                }
                pg1.allreduce_unverified(&mut p_all.shallow_clone(), ReduceOp::Sum)?.wait()
            })
            .then(move || {
                let _g = tch::no_grad_guard();
                for f in &factors {
                    orthogonalize(&f.p, epsilon)?;
                    let _ = f.matrix.f_transpose(1, 2)?.f_bmm_out(&f.q, &f.p)?;
                }
                pg2.allreduce_unverified(&mut q_all.shallow_clone(), ReduceOp::Sum)?.wait()?;
                let _ = q_all.shallow_clone().f_div_scalar_(world)?;
                // decompress into the bucket: M ~ P Q^T
                for f in &factors {
                    let _ = f.p.f_bmm_out(&f.matrix, &f.q.f_transpose(1, 2)?)?;
                }
                let mut st = lock(&state);
                if let Some(before) = copy {
                    st.errors.insert(b, before.f_sub(&input)?);
                }
                if !warm {
                    st.p_memory.clear();
                    st.q_memory.clear();
                }
                if last {
                    st.iter += 1;
                }
                Ok(())
            }))
    }
}
