//! Top-k routing with a fixed capacity per expert, as GShard: each token's `k` most probable experts,
//! places in each expert's queue given in order of priority (every token's first choice, then every
//! token's second, each in token order), and the assignments past an expert's capacity dropped. All of it
//! stays on the device: the queue positions come from a cumulative sum, dropped assignments point at a
//! spare row, so no count is read on the host.
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// Where one call's tokens go.
#[derive(Debug)]
pub struct Routing {
    /// `[k * tokens]`, choice-major (all first choices, then all second ones): the assignment's row in a
    /// buffer of `experts * capacity` rows (expert e's queue at `e * capacity`), or `experts * capacity`
    /// (a spare row) when it was dropped.
    pub slots: Tensor,
    /// `[k * tokens]`, choice-major: the weight of each assignment in the token's output (the router's
    /// probability, renormalised over the token's `k` choices when `k > 1`, as GShard's top-2).
    pub gates: Tensor,
    /// Rows per expert.
    pub capacity: i64,
    /// Switch Transformer's load-balancing loss over these tokens: `experts * sum_e f_e * p_e`, `f_e` the
    /// share of the assignments that chose expert e (before dropping), `p_e` its mean probability. 1 when
    /// the load is even.
    pub aux_loss: Tensor,
    /// The number of dropped assignments (a tensor: reading it would wait for the device).
    pub dropped: Tensor,
}

/// Rows per expert for `tokens` tokens: `ceil(capacity_factor * tokens * k / experts)`, at least 1.
pub fn capacity(tokens: i64, k: i64, experts: i64, capacity_factor: f64) -> i64 {
    ((capacity_factor * (tokens * k) as f64 / experts as f64).ceil() as i64).max(1)
}

/// Routes `logits` (`[tokens, experts]`, the router's output) to each token's `k` best experts, at most
/// `capacity_factor * tokens * k / experts` (rounded up) per expert.
pub fn route(logits: &Tensor, k: i64, capacity_factor: f64) -> Result<Routing> {
    let what = "moe::router::route";
    let &[tokens, experts] = logits.size().as_slice() else {
        return Err(Error::invalid(what, format!("logits must be [tokens, experts], got {:?}", logits.size())));
    };
    if k < 1 || k > experts {
        return Err(Error::invalid(what, format!("top_k = {k} must be in 1..={experts} (the number of experts)")));
    }
    if !(capacity_factor > 0.0 && capacity_factor.is_finite()) {
        return Err(Error::invalid(what, format!("capacity_factor = {capacity_factor} must be positive")));
    }
    let cap = capacity(tokens, k, experts, capacity_factor);
    let probs = logits.f_softmax(-1, Kind::Float)?;
    let (top, choice) = probs.f_topk(k, -1, true, true)?;
    let top = if k > 1 { top.f_div(&top.f_sum_dim_intlist(-1, true, Kind::Float)?)? } else { top };
    // choice-major: row j * tokens + t is token t's j-th choice
    let chosen = choice.f_tr()?.f_reshape([-1])?;
    let gates = top.f_tr()?.f_reshape([-1])?;
    let onehot = chosen.f_one_hot(experts)?;
    // each assignment's place in its expert's queue: how many assignments of that expert come before it
    let place = (onehot.f_cumsum(0, Kind::Int64)? - 1i64).f_mul(&onehot)?.f_sum_dim_intlist(-1, false, Kind::Int64)?;
    let kept = place.f_lt(cap)?;
    let slots = (chosen.f_mul_scalar(cap)? + &place).f_where_scalarother(&kept, experts * cap)?;
    let dropped = kept.f_logical_not()?.f_sum(Kind::Int64)?;
    let share = onehot.f_sum_dim_intlist(0, false, Kind::Float)?.f_div_scalar((tokens * k).max(1))?;
    let mean_prob = probs.f_mean_dim(0, false, Kind::Float)?;
    let aux_loss = share.f_mul(&mean_prob)?.f_sum(Kind::Float)?.f_mul_scalar(experts)?;
    Ok(Routing { slots, gates, capacity: cap, aux_loss, dropped })
}
