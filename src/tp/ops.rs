//! The conjugate operators (Megatron-LM's f and g, and the gather/scatter pair) as autograd ops. Their
//! backward runs the collective inside libtorch's autograd (tch-dist-sys/csrc/tp.cpp), so they compose with any model.
use tch::Tensor;

use crate::error::Result;
use crate::group::shim_op::{self, Collectives};
use crate::group::ProcessGroup;

fn op(code: i32, name: &str, x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let collectives =
        Collectives { forward: forward_collective(code, x, pg), backward: backward_collective(code, x, pg) };
    shim_op::run(x, pg, name, collectives, |engine, input| engine.tp_op(code, input))
}

/// `x`'s description with dimension `dim` divided by the group size (a rank's part of it).
fn part(x: &Tensor, dim: usize, pg: &ProcessGroup) -> String {
    let mut size = x.size();
    let last = size.len().saturating_sub(1);
    if let Some(d) = size.get_mut(dim.min(last)) {
        *d /= pg.size().max(1) as i64;
    }
    format!("{:?}{:?} on {:?}", x.kind(), size, x.device())
}

/// The collective the operator's forward runs, as the recorder names it (none for the ones that only
/// copy or slice).
fn forward_collective(code: i32, x: &Tensor, pg: &ProcessGroup) -> Option<String> {
    let t = crate::group::describe(x);
    match code {
        1 | 7 => Some(format!("allreduce(Sum) of {t}")),
        2 | 4 => Some(format!("all_gather of {t}")),
        5 => Some(format!("reduce_scatter(Sum) into {}", part(x, 0, pg))),
        _ => None,
    }
}

/// The collective the operator's backward runs, as the recorder names it.
fn backward_collective(code: i32, x: &Tensor, pg: &ProcessGroup) -> Option<String> {
    match code {
        0 => Some(format!("allreduce(Sum) of {}", crate::group::describe(x))),
        3 => Some(format!("all_gather of {}", part(x, usize::MAX, pg))),
        4 => Some(format!("reduce_scatter(Sum) into {}", crate::group::describe(x))),
        5 | 6 => Some(format!("all_gather of {}", part(x, 0, pg))),
        _ => None,
    }
}

/// f: identity forward, allreduce (sum) of the gradient backward. Enters a parallel region.
pub fn copy_to_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(0, "copy_to_parallel_region", x, pg)
}

/// g: allreduce (sum) forward, identity backward. Leaves a parallel region.
pub fn reduce_from_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(1, "reduce_from_parallel_region", x, pg)
}

/// [`reduce_from_parallel_region`] summing into `x` itself (Megatron's in-place reduce): for a partial
/// result the caller owns and nothing else reads (not saved for backward), to save a copy of it.
pub(crate) fn reduce_from_parallel_region_owned(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(7, "reduce_from_parallel_region", x, pg)
}

/// all_gather along the last dimension forward; backward keeps this rank's slice of the gradient.
pub fn gather_from_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(2, "gather_from_parallel_region", x, pg)
}

/// This rank's slice of the last dimension forward; backward all_gathers the gradient.
pub fn scatter_to_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(3, "scatter_to_parallel_region", x, pg)
}

/// Sequence parallelism's entry to a tensor-parallel region (Megatron's): all_gather along the sequence
/// (dimension 0 of `[s / t, b, h]`) forward; reduce-scatter of the gradient along it backward.
pub fn gather_from_sequence_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(4, "gather_from_sequence_parallel_region", x, pg)
}

/// Sequence parallelism's exit from a tensor-parallel region: reduce-scatter along the sequence
/// (the sum of the ranks' partial outputs, this rank's part of dimension 0) forward; all_gather backward.
pub fn reduce_scatter_to_sequence_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(5, "reduce_scatter_to_sequence_parallel_region", x, pg)
}

/// This rank's part of the sequence (dimension 0) forward; all_gather of the gradient backward.
pub fn scatter_to_sequence_parallel_region(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    op(6, "scatter_to_sequence_parallel_region", x, pg)
}

/// Sums, over the TP group, the gradients of parameters that sequence-parallel regions use whole
/// (LayerNorm's weight and bias, a row-parallel layer's bias): each rank's gradient covers only its part of
/// the sequence. Call after backward, before clipping and the optimizer (Megatron's
/// `allreduce_sequence_parallel_gradients`): one allreduce per dtype and device, of the gradients
/// flattened into one buffer and copied back (Megatron's `_flatten_dense_tensors`). Parameters without
/// a gradient are skipped.
pub fn allreduce_sequence_parallel_grads(params: &[Tensor], pg: &ProcessGroup) -> Result<()> {
    let _g = tch::no_grad_guard();
    for (_, grads) in crate::optim::by_device_and_dtype(&crate::optim::grads_of(params)) {
        if let [g] = &grads[..] {
            pg.allreduce(&mut g.shallow_clone(), crate::group::ReduceOp::Sum)?;
            continue;
        }
        let flat: Vec<Tensor> = grads.iter().map(|g| g.f_reshape([-1])).collect::<std::result::Result<_, _>>()?;
        let mut buf = Tensor::f_cat(&flat, 0)?;
        pg.allreduce(&mut buf, crate::group::ReduceOp::Sum)?;
        let sizes: Vec<i64> = flat.iter().map(|f| f.numel() as i64).collect();
        if grads.iter().all(|g| g.is_contiguous()) {
            // back in one kernel: the reshapes above are views of the gradients
            buf.f_split_with_sizes_copy_out(&flat, sizes.as_slice(), 0)?;
        } else {
            for (g, part) in grads.iter().zip(buf.f_split_with_sizes(sizes.as_slice(), 0)?) {
                g.shallow_clone().f_copy_(&part.f_view_as(g)?)?;
            }
        }
    }
    Ok(())
}
