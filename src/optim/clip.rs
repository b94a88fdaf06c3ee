//! Gradient-norm clipping that is correct however the gradients are laid out across ranks.
//!
//! `torch.nn.utils.clip_grad_norm_` takes the norm of the gradients one process holds. Under sharding
//! that is the norm of a part, a silent bug (pytorch#72548): each rank clips by another factor. Here
//! each list of gradients says how it is laid out, and the norm is that of the whole model's gradient:
//!
//! - **replicated**: every rank holds the same values (plain training, DDP after its allreduce, the
//!   layers tensor parallelism keeps whole): counted once;
//! - **sharded over groups**: across each of the groups the ranks hold disjoint parts (ZeRO and FSDP
//!   shards over the data-parallel group, TP slices over the tensor-parallel group, pipeline stages'
//!   parameters over the pipeline group): the parts' contributions are summed over those groups.
//!
//! Which is which, each parameter's [placement](crate::placement) says: the layers and wrappers that lay
//! tensors out record it, so [`clip_grad_norm`] over any model's parameters (tch's
//! `vs.trainable_variables()`) is right under every layout, with nothing classified by hand.
//!
//! A p-norm sums `|g|^p` over the parts, the ∞-norm takes their maximum; then every gradient is scaled by
//! `min(1, max_norm / (total + 1e-6))`, as PyTorch does, in float32 (PyTorch keeps the gradients' dtype:
//! the same for float32 gradients; 16-bit ones are normed in float32 here, float64 ones in float64 and
//! the total then rounded to float32). Under [`crate::amp::GradScaler`],
//! call `scaler.unscale(&mut opt)` first, as PyTorch documents, so that the norm is of true gradients.
//!
//! ```no_run
//! # fn f(vs: &tch::nn::VarStore) -> tch_dist::Result<()> {
//! // tensor parallel × pipeline × DDP: TP slices summed over the TP group, stages over the pipeline
//! // group, whole parameters counted once, each as its placement says
//! let norm = tch_dist::optim::clip_grad_norm(&vs.trainable_variables(), 1.0, 2.0)?;
//! # Ok(()) }
//! ```
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::{ProcessGroup, ReduceOp};
use crate::optim::by_device_and_dtype;

/// PyTorch's epsilon in `max_norm / (total + eps)`.
const EPS: f32 = 1e-6;

/// `torch.nn.utils.clip_grad_norm_` over the gradients of `params`, laid out however their placements
/// say ([`crate::placement`]; a parameter with none is the same on every rank): scales them so that the
/// whole model's `norm_type`-norm is at most `max_norm`; returns the norm before, a float32 scalar tensor
/// on the gradients' device (no host sync until it is read; see [`GradNorm::total`] for where groups
/// reduce). Collective over the groups the parameters are laid out over.
///
/// ```no_run
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// // after backward, before the step:
/// let norm = tch_dist::optim::clip_grad_norm(&vs.trainable_variables(), 1.0, 2.0)?;
/// println!("grad norm {}", f64::try_from(&norm)?); // a host read: for logging, not every step
/// # Ok::<(), tch_dist::Error>(())
/// ```
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<Tensor> {
    GradNorm::new(norm_type).parameters(params).clip(max_norm)
}

/// `torch.linalg.vector_norm(v, p)` of a 1-D tensor, in its dtype (a dimension given: a vector norm).
fn vector_norm(v: &Tensor, p: f64) -> Result<Tensor> {
    Ok(v.f_linalg_norm(p, Some(&[0i64][..]), false, v.kind())?)
}

struct Part {
    grads: Vec<Tensor>,
    over: Vec<Arc<ProcessGroup>>,
}

/// The norm of gradients laid out across ranks (see the module docs); built part by part, then
/// [`total`](Self::total) or [`clip`](Self::clip).
pub struct GradNorm {
    norm_type: f64,
    parts: Vec<Part>,
    /// A parameter whose placement names a group that is gone (reported by `total`).
    error: Option<Error>,
}

impl GradNorm {
    /// A `norm_type`-norm: any p > 0, or `f64::INFINITY` for the largest magnitude.
    pub fn new(norm_type: f64) -> Self {
        GradNorm { norm_type, parts: Vec::new(), error: None }
    }

    /// The gradients of `params`, each laid out as its placement says ([`crate::placement`]: a TP slice,
    /// an FSDP shard, a pipeline stage's; none: the same on every rank). Parameters without a gradient
    /// are left out, as PyTorch does.
    pub fn parameters(mut self, params: &[Tensor]) -> Self {
        for p in params {
            let over = match crate::placement::of(p) {
                None => Vec::new(),
                Some(l) if l.stepped_by().is_some() => {
                    let by = l.stepped_by().unwrap_or_default();
                    self.error.get_or_insert(Error::invalid(
                        "clip_grad_norm",
                        format!(
                            "a {:?} parameter is stepped by {by} from gradients it holds, not the parameter's: \
                             clip through that optimizer (opt.clip_grad_norm)",
                            p.size()
                        ),
                    ));
                    continue;
                }
                Some(l) => match l.partial_groups("clip_grad_norm") {
                    Ok(g) => g,
                    Err(e) => {
                        self.error.get_or_insert(e);
                        continue;
                    }
                },
            };
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            let same =
                |q: &Part| q.over.len() == over.len() && q.over.iter().zip(&over).all(|(a, b)| Arc::ptr_eq(a, b));
            match self.parts.iter_mut().find(|q| same(q)) {
                Some(q) => q.grads.push(g),
                None => self.parts.push(Part { grads: vec![g], over }),
            }
        }
        self
    }

    /// Gradient tensors laid out as the caller says: the ranks of each group in `over` hold disjoint
    /// parts (empty: the same on every rank). For tests of the norm itself (the `testing` feature): the
    /// library's callers read placements ([`parameters`](Self::parameters)).
    #[cfg(feature = "testing")]
    pub fn gradients(mut self, grads: Vec<Tensor>, over: &[&Arc<ProcessGroup>]) -> Self {
        self.parts.push(Part { grads, over: over.iter().filter(|g| g.size() > 1).map(|g| (*g).clone()).collect() });
        self
    }

    fn check(&self) -> Result<()> {
        if let Some(e) = &self.error {
            return Err(crate::error::replay(e));
        }
        let p = self.norm_type;
        if p.is_nan() || p <= 0.0 {
            return Err(Error::invalid("clip_grad_norm", format!("norm_type must be > 0 or infinity, not {p}")));
        }
        Ok(())
    }

    fn infinite(&self) -> bool {
        self.norm_type == f64::INFINITY
    }

    /// This rank's contribution of one part, Σ|g|^p (or max |g|) over its gradients: a float64 tensor
    /// `[1]` on `home`, computed where the gradients are (no host read), with one multi-tensor norm per
    /// device and dtype (`_foreach_norm`, as PyTorch's `clip_grad_norm_`).
    fn local(&self, grads: &[Tensor], home: Device) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let mut acc = Tensor::f_zeros([1], (Kind::Double, home))?;
        for (_, group) in by_device_and_dtype(grads) {
            let norms = crate::ffi::foreach_norms(&group, self.norm_type)?;
            let n = vector_norm(&norms, self.norm_type)?.f_to_kind(Kind::Double)?;
            let n = n.f_reshape([1])?.f_to_device(home)?;
            acc =
                if self.infinite() { acc.f_maximum(&n)? } else { acc.f_add(&n.f_pow_tensor_scalar(self.norm_type)?)? };
        }
        Ok(acc)
    }

    /// The device where the parts' values are reduced: that of the first gradient, unless a group named
    /// reduces elsewhere (its NCCL GPU, or the CPU of a Gloo group).
    fn home(&self) -> Device {
        let groups = self.parts.iter().flat_map(|p| p.over.iter());
        match groups.map(|g| g.scalar_device()).next() {
            Some(d) => d,
            None => self.parts.iter().flat_map(|p| p.grads.iter()).next().map_or(Device::Cpu, |g| g.device()),
        }
    }

    /// The norm of all the parts' gradients together, as if one rank held them all: a float32 scalar
    /// tensor, as `torch.nn.utils.clip_grad_norm_` returns (read it with `f64::try_from`, a host sync).
    /// Collective: every rank of every group named calls it. It is reduced where the first group reduces
    /// small values: the GPU of an NCCL group (no host sync), the CPU of a Gloo group (CUDA gradients
    /// then copy their norms to the host); with no group, on the first gradient's device.
    pub fn total(&self) -> Result<Tensor> {
        self.check()?;
        let home = self.home();
        // every rank of a group must reduce the same groups in the same order, and its parts' values in
        // the same order, whatever order its parameters came in: groups by name, parts by their groups'
        let mut groups: Vec<&Arc<ProcessGroup>> = Vec::new();
        for g in self.parts.iter().flat_map(|p| p.over.iter()) {
            if !groups.iter().any(|h| Arc::ptr_eq(h, g)) {
                groups.push(g);
            }
        }
        groups.sort_by(|a, b| a.name().cmp(b.name()));
        let rank_of = |g: &Arc<ProcessGroup>| groups.iter().position(|h| Arc::ptr_eq(h, g)).unwrap_or(usize::MAX);
        let mut parts: Vec<&Part> = self.parts.iter().collect();
        parts.sort_by_key(|p| {
            let mut k: Vec<usize> = p.over.iter().map(rank_of).collect();
            k.sort();
            k
        });
        let mut values: Vec<Tensor> = parts.iter().map(|p| self.local(&p.grads, home)).collect::<Result<_>>()?;
        let op = if self.infinite() { ReduceOp::Max } else { ReduceOp::Sum };
        for (i, g) in groups.iter().enumerate() {
            let mine: Vec<usize> =
                (0..parts.len()).filter(|&k| parts[k].over.iter().any(|h| Arc::ptr_eq(h, g))).collect();
            let shape = [i as i64, mine.len() as i64, self.norm_type.to_bits() as i64];
            if g.checks_now(crate::group::Scope::Collective, "clip_grad_norm layout", g.scalar_device()) {
                // ranks that built other parts would pass vectors of other lengths (Gloo aborts on that)
                g.meta().agree("clip_grad_norm layout", &shape, |rows| {
                    let show = |r: &[i64]| {
                        format!("group #{} of {} part(s), norm_type {}", r[0], r[1], f64::from_bits(r[2] as u64))
                    };
                    format!(
                        "ranks describe their gradients differently: {}",
                        crate::group::meta::by_rank(rows, show, "; ")
                    )
                })?;
            }
            let mut v = Tensor::f_cat(&mine.iter().map(|&k| &values[k]).collect::<Vec<_>>(), 0)?
                .f_to_device(g.scalar_device())?;
            let _l = crate::flight::label("clip_grad_norm");
            g.allreduce_unverified(&mut v, op)?.wait()?;
            let v = v.f_to_device(home)?;
            for (j, k) in mine.into_iter().enumerate() {
                values[k] = v.f_narrow(0, j as i64, 1)?;
            }
        }
        let all =
            if values.is_empty() { Tensor::f_zeros([1], (Kind::Double, home))? } else { Tensor::f_cat(&values, 0)? };
        let total = if self.infinite() {
            // an empty model's norm is 0, as PyTorch's
            all.f_amax([0i64].as_slice(), false)?.f_clamp_min(0.0)?
        } else {
            all.f_sum(Kind::Double)?.f_pow_tensor_scalar(1.0 / self.norm_type)?
        };
        Ok(total.f_to_kind(Kind::Float)?)
    }

    /// Scales every gradient by `min(1, max_norm / (total + 1e-6))` (float32, on the gradients' devices,
    /// as PyTorch); returns the total norm before clipping, as [`total`](Self::total). A non-finite norm
    /// scales the gradients to NaN, as PyTorch's default does (`GradScaler::step` skips such a step).
    pub fn clip(&self, max_norm: f64) -> Result<Tensor> {
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(Error::invalid("clip_grad_norm", format!("max_norm must be >= 0, not {max_norm}")));
        }
        let total = self.total()?;
        let _g = tch::no_grad_guard();
        // PyTorch's `max_norm / (total + eps)` is the reciprocal times max_norm; its clamp keeps a NaN
        let coef = total.f_add_scalar(EPS as f64)?.f_reciprocal()?.f_mul_scalar(max_norm)?.f_clamp_max(1.0)?;
        // the coefficient copied once to each device, one multi-tensor scale per device and dtype
        let mut on: Vec<(Device, Tensor)> = Vec::new();
        let grads: Vec<Tensor> = self.parts.iter().flat_map(|p| p.grads.iter()).map(|g| g.shallow_clone()).collect();
        for ((d, _), group) in by_device_and_dtype(&grads) {
            let i = match on.iter().position(|(e, _)| *e == d) {
                Some(i) => i,
                None => {
                    on.push((d, coef.f_to_device(d)?));
                    on.len() - 1
                }
            };
            crate::ffi::foreach_mul_(&group, &on[i].1)?;
        }
        Ok(total)
    }
}
