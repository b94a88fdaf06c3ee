//! All-to-all inside autograd: the backward sends the output's gradient back along the transposed splits.
use tch::Tensor;

use crate::error::{Error, Result};
use crate::group::shim_op::{self, Collectives};
use crate::group::{describe, ProcessGroup};

/// Rows of `x` (dim 0) go out in chunks of `input_splits[r]` rows to rank r; the result holds rank r's
/// chunk for this rank at its place in `output_splits`, in rank order. Empty splits mean equal chunks. Its
/// backward runs the all-to-all the other way. Every rank of `pg` calls it, with splits that pair up (see
/// [`ProcessGroup::all_to_all_single`]; the agreement check runs as it does there, by the group's
/// [`CheckPolicy`](crate::group::CheckPolicy): every call on Gloo, the first on NCCL).
pub fn all_to_all(x: &Tensor, pg: &ProcessGroup, output_splits: &[usize], input_splits: &[usize]) -> Result<Tensor> {
    let what = "moe::all_to_all";
    let desc = || format!("{what} of {}", describe(x));
    if x.dim() == 0 {
        return Err(Error::invalid(desc(), "a scalar has no dim 0 to split"));
    }
    if output_splits.is_empty() != input_splits.is_empty() {
        return Err(Error::invalid(desc(), "give both splits, or neither (equal chunks)"));
    }
    let ins = pg.splits(&desc, "input", x, input_splits)?;
    let outs = if output_splits.is_empty() {
        ins.clone()
    } else if output_splits.len() != pg.size() {
        return Err(Error::invalid(
            desc(),
            format!("output_splits has {} entries for a group of {} ranks", output_splits.len(), pg.size()),
        ));
    } else {
        output_splits.iter().map(|&s| s as i64).collect()
    };
    if pg.size() == 1 {
        if outs != ins {
            return Err(Error::invalid(desc(), format!("one rank sends itself {ins:?} rows but expects {outs:?}")));
        }
        return Ok(x.shallow_clone());
    }
    // ranks that disagree would abort Gloo, or hang NCCL: checked as every collective is
    pg.agree_on_splits(x, x.size()[1..].iter().product(), &ins, &outs)?;
    let (os, is) = if input_splits.is_empty() { (vec![], vec![]) } else { (outs, ins) };
    let desc = format!("all_to_all_single of {}", describe(x));
    let collectives = Collectives { forward: Some(desc.clone()), backward: Some(desc) };
    shim_op::run(x, pg, what, collectives, |engine, input| engine.all_to_all_op(input, &os, &is))
}
