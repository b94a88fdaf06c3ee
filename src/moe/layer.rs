//! The mixture-of-experts layer over an expert-parallel group (see the module docs of [`crate::moe`]).
use std::sync::Arc;

use tch::nn::{self, Init};
use tch::Tensor;

use super::all_to_all::all_to_all;
use super::router::route;
use crate::error::{Error, Result};
use crate::group::{describe, ProcessGroup};
use crate::tp::init::{self, Part};

/// How a [`Moe`] routes, as tch's `LinearConfig`: what is not a size.
#[derive(Clone, Copy, Debug)]
pub struct MoeConfig {
    /// Experts per token: 2 (GShard, Mixtral), 1 (Switch).
    pub top_k: i64,
    /// Rows per expert and call, as a multiple of an even share (`tokens * top_k / experts`, rounded
    /// up): assignments past it are dropped, and a token whose every choice was dropped gets zeros (the
    /// residual connection around the layer carries it).
    pub capacity_factor: f64,
}

impl Default for MoeConfig {
    fn default() -> Self {
        MoeConfig { top_k: 2, capacity_factor: 1.25 }
    }
}

/// What a [`Moe`] call returns.
#[derive(Debug)]
pub struct MoeOutput {
    /// The input's shape: each token's experts' outputs, weighted by their gates.
    pub output: Tensor,
    /// The load-balancing loss of this rank's tokens (add it to the loss with a small weight, e.g. 0.01).
    pub aux_loss: Tensor,
    /// Assignments dropped for capacity, on this rank (a tensor, so that nothing waits for the device).
    pub dropped: Tensor,
}

/// A mixture of `experts` MLPs (`d_model -> hidden -> d_model`, GELU) with a top-k router, the experts
/// spread evenly over the ranks of `pg` (rank r holds experts `[r * local, (r + 1) * local)`), the router
/// replicated. Every rank of `pg` calls it with the same number of tokens.
#[derive(Debug)]
pub struct Moe {
    /// `[experts, d_model]` (`router.weight`), the same on every rank.
    pub router: Tensor,
    /// This rank's experts, stacked: `[local, d_model, hidden]` (`experts.w1`).
    pub w1: Tensor,
    /// `[local, hidden]` (`experts.b1`).
    pub b1: Tensor,
    /// `[local, hidden, d_model]` (`experts.w2`).
    pub w2: Tensor,
    /// `[local, d_model]` (`experts.b2`).
    pub b2: Tensor,
    pub config: MoeConfig,
    experts: i64,
    pg: Arc<ProcessGroup>,
}

/// Uniform in `±1/sqrt(fan_in)`: what `nn::linear` draws for a bias (and, through Kaiming-uniform, for
/// its weight).
fn uniform(fan_in: i64) -> Init {
    let bound = 1.0 / (fan_in as f64).sqrt();
    Init::Uniform { lo: -bound, up: bound }
}

impl Moe {
    /// Draws the router as `nn::linear(path / "router", d_model, experts)` without bias would, then the
    /// experts' stacked weights (uniform in `±1/sqrt(fan_in)`, as a Linear's); each rank keeps its own
    /// experts, and the generator ends where drawing all of them leaves it, so a model starts from the
    /// same values on any expert-parallel size.
    pub fn new(
        path: &nn::Path,
        d_model: i64,
        hidden: i64,
        experts: i64,
        pg: Arc<ProcessGroup>,
        config: MoeConfig,
    ) -> Result<Self> {
        let what = "Moe::new";
        check_sizes(what, d_model, hidden, experts, &pg)?;
        let router = (path / "router").f_var("weight", &[experts, d_model], nn::LinearConfig::default().ws_init)?;
        let opts = (path.kind(), path.device());
        let part = Part::even(0, experts, pg.rank(), pg.size());
        let w1 = init::slice(what, uniform(d_model), &[experts, d_model, hidden], part, opts)?;
        let b1 = init::slice(what, uniform(d_model), &[experts, hidden], part, opts)?;
        let w2 = init::slice(what, uniform(hidden), &[experts, hidden, d_model], part, opts)?;
        let b2 = init::slice(what, uniform(hidden), &[experts, d_model], part, opts)?;
        Self::from_local(path, router, [w1, b1, w2, b2], pg, config)
    }

    /// This rank's experts of the whole stacks `w1` (`[experts, d_model, hidden]`), `b1`, `w2`, `b2`, and
    /// the router (`[experts, d_model]`), as variables under `path`.
    pub fn from_full(
        path: &nn::Path,
        router: &Tensor,
        [w1, b1, w2, b2]: [&Tensor; 4],
        pg: Arc<ProcessGroup>,
        config: MoeConfig,
    ) -> Result<Self> {
        let what = "Moe::from_full";
        let size = w1.size();
        let &[experts, d_model, hidden] = size.as_slice() else {
            return Err(Error::invalid(what, format!("w1 must be [experts, d_model, hidden], got {size:?}")));
        };
        check_sizes(what, d_model, hidden, experts, &pg)?;
        let want = [
            ("router", router, vec![experts, d_model]),
            ("b1", b1, vec![experts, hidden]),
            ("w2", w2, vec![experts, hidden, d_model]),
            ("b2", b2, vec![experts, d_model]),
        ];
        for (name, t, shape) in &want {
            if t.size() != *shape {
                return Err(Error::invalid(
                    what,
                    format!("{name} must be {shape:?} beside w1 {size:?}, got {:?}", t.size()),
                ));
            }
        }
        let local = experts / pg.size() as i64;
        let mine =
            |t: &Tensor| -> Result<Tensor> { Ok(t.f_narrow(0, pg.rank() as i64 * local, local)?.f_contiguous()?) };
        let router = (path / "router").f_var_copy("weight", router)?;
        Self::from_local(path, router, [mine(w1)?, mine(b1)?, mine(w2)?, mine(b2)?], pg, config)
    }

    fn from_local(
        path: &nn::Path,
        router: Tensor,
        [w1, b1, w2, b2]: [Tensor; 4],
        pg: Arc<ProcessGroup>,
        config: MoeConfig,
    ) -> Result<Self> {
        let experts = router.size()[0];
        let p = path / "experts";
        let [w1, b1, w2, b2] = [("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)].map(|(name, t)| p.f_var_copy(name, &t));
        let (w1, b1, w2, b2) = (w1?, b1?, w2?, b2?);
        for t in [&w1, &b1, &w2, &b2] {
            crate::tp::layers::place_slice(t, &pg, 0)?;
        }
        Ok(Moe { router, w1, b1, w2, b2, config, experts, pg })
    }

    /// Routes `x` (`[..., d_model]`: every leading dimension is tokens) to its experts, wherever they are,
    /// and back. Differentiable throughout: the backward runs the two all-to-alls the other way.
    pub fn f_forward(&self, x: &Tensor) -> Result<MoeOutput> {
        let d = self.w1.size()[1];
        let shape = x.size();
        if shape.last() != Some(&d) {
            return Err(Error::invalid(
                "Moe::f_forward",
                format!("input {} does not end in d_model = {d}", describe(x)),
            ));
        }
        let xt = x.f_reshape([-1, d])?;
        let tokens = xt.size()[0];
        let (k, e, p) = (self.config.top_k, self.experts, self.pg.size() as i64);
        let local = e / p;
        let logits = xt.f_matmul(&self.router.f_tr()?)?;
        let r = route(&logits, k, self.config.capacity_factor)?;
        let c = r.capacity;
        // every assignment into its expert's queue (dropped ones into a spare last row), expert-major
        let queued = xt.f_repeat([k, 1])?;
        let opts = (xt.kind(), xt.device());
        let buf = Tensor::f_zeros([e * c + 1, d], opts)?.f_index_add(0, &r.slots, &queued)?.f_narrow(0, 0, e * c)?;
        // rank q's queues for this rank's experts, then one batch per expert
        let got = all_to_all(&buf, &self.pg, &[], &[])?;
        let xe = got.f_view([p, local, c, d])?.f_transpose(0, 1)?.f_reshape([local, p * c, d])?;
        let h = self.b1.f_unsqueeze(1)?.f_baddbmm(&xe, &self.w1, 1, 1)?.f_gelu("none")?;
        let ye = self.b2.f_unsqueeze(1)?.f_baddbmm(&h, &self.w2, 1, 1)?;
        let back = ye.f_view([local, p, c, d])?.f_transpose(0, 1)?.f_reshape([p * local * c, d])?;
        let y = all_to_all(&back, &self.pg, &[], &[])?;
        let y = Tensor::f_cat(&[y, Tensor::f_zeros([1, d], opts)?], 0)?;
        let picked = y.f_index_select(0, &r.slots)?.f_mul(&r.gates.f_unsqueeze(1)?.f_to_kind(y.kind())?)?;
        let output = picked.f_view([k, tokens, d])?.f_sum_dim_intlist(0, false, y.kind())?.f_reshape(shape)?;
        Ok(MoeOutput { output, aux_loss: r.aux_loss, dropped: r.dropped })
    }

    /// Expert parallelism inside data parallelism (torchtitan's EP carved out of DP): this rank's experts
    /// are held alike by the ranks of `replicas`, the data-parallel ranks beside the expert-parallel
    /// group (expert-parallel size x `replicas` size = the data-parallel size). Recorded as the experts'
    /// placement, so that DDP over the data-parallel group sums their gradients over `replicas` (the ranks
    /// that hold the same experts) and leaves them out of its buckets. Not needed when the expert-parallel
    /// group is the data-parallel group itself.
    pub fn replicated_over(self, replicas: &Arc<ProcessGroup>) -> Result<Self> {
        for t in [&self.w1, &self.b1, &self.w2, &self.b2] {
            crate::placement::record_along(t, replicas, crate::placement::Placement::Replicate)?;
        }
        Ok(self)
    }

    /// The expert-parallel group.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// Experts in all (this rank holds `experts / group size` of them).
    pub fn experts(&self) -> i64 {
        self.experts
    }
}

fn check_sizes(what: &str, d_model: i64, hidden: i64, experts: i64, pg: &ProcessGroup) -> Result<()> {
    if d_model < 1 || hidden < 1 || experts < 1 {
        return Err(Error::invalid(
            what,
            format!("d_model = {d_model}, hidden = {hidden} and experts = {experts} must be positive"),
        ));
    }
    if experts % pg.size() as i64 != 0 {
        return Err(Error::invalid(
            what,
            format!("{experts} experts do not spread evenly over the expert-parallel group's {} ranks", pg.size()),
        ));
    }
    Ok(())
}
