// Megatron-LM's conjugate operators for tensor parallelism, as autograd nodes: libtorch's backward runs
// the collective. The node holds the group (an intrusive_ptr), so the graph can outlive the Rust handle.
#include "common.h"
#include "lambda_node.h"

namespace {
using c10d::Backend;
using tdx::with_backward;

// The sum over the group into `t` itself when it is contiguous (a partial result the caller owns and no
// one else reads: Megatron's in-place _reduce), else into a contiguous copy.
at::Tensor allreduce_sum_into(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t) {
  auto r = t.contiguous();
  std::vector<at::Tensor> v{r};
  pg->allreduce(v)->wait();
  return r;
}

// The sum over the group in a new tensor (`t` is left as it is).
at::Tensor allreduce_sum(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t) {
  return allreduce_sum_into(pg, t.clone(at::MemoryFormat::Contiguous));
}

// all_gather along `dim` (-1: the hidden dimension; 0: the sequence, sequence parallelism's layout [s, b, h])
// into one buffer (c10d's _allgather_base, NCCL's all_gather_into_tensor), whose rows are the ranks' parts
// in rank order: along dim 0 that is the result itself; along another dimension one copy moves each part
// into place (as DTensor's gather does), where a list all_gather and a cat copied twice.
at::Tensor gather(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() > 0, "a tensor-parallel gather needs at least one dimension, got a scalar");
  auto d = dim < 0 ? dim + t.dim() : dim;
  TORCH_CHECK_INDEX(d >= 0 && d < t.dim(), "gather dimension ", dim, " is out of range for ", t.dim(), " dimensions");
  auto in = t.contiguous();
  auto n = static_cast<int64_t>(pg->getSize());
  auto shape = in.sizes().vec();
  auto flat = shape;
  flat[0] *= n;
  auto out = at::empty(flat, in.options());
  pg->_allgather_base(out, in)->wait();
  if (d == 0 || n == 1) return out;
  std::vector<int64_t> parts{n};
  parts.insert(parts.end(), shape.begin(), shape.end());
  auto merged = shape;
  merged[d] *= n;
  // [n, ..., s_d, ...] -> [..., n, s_d, ...] -> [..., n * s_d, ...]
  return out.view(parts).movedim(0, d).reshape(merged);
}

at::Tensor own_chunk(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t, int64_t dim) {
  auto n = t.size(dim);
  TORCH_CHECK_VALUE(n % pg->getSize() == 0, (dim == 0 ? "sequence" : "last"), " dimension ", n,
                    " is not divisible by the tensor-parallel size ", pg->getSize());
  return t.chunk(pg->getSize(), dim)[pg->getRank()].contiguous();
}

// Reduce-scatter along dim 0 (the sequence): this rank's chunk of the sum, half the bytes of an allreduce
// on a ring and only a chunk's output (Gloo and NCCL both have the flat form in libtorch 2.11 and 2.13).
at::Tensor reduce_scatter_seq(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t) {
  auto in = t.contiguous();
  auto n = in.size(0);
  TORCH_CHECK_VALUE(n % pg->getSize() == 0, "sequence dimension ", n, " is not divisible by the tensor-parallel size ",
                    pg->getSize());
  auto shape = in.sizes().vec();
  shape[0] = n / pg->getSize();
  auto out = at::empty(shape, in.options());
  pg->_reduce_scatter_base(out, in)->wait();
  return out;
}
} // namespace

extern "C" int tdx_tp_op(tdx_pg* g, int op, tdx_tensor xt, tdx_tensor* out) {
  TDX_TRY({
    auto pg = tdx::backend(g);
    const auto& x = tdx::tensor(xt);
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      switch (op) {
        case 0: y = x.detach(); break;                 // copy_to: identity
        case 1: y = allreduce_sum(pg, x); break;       // reduce_from: allreduce
        case 2: y = gather(pg, x, -1); break;          // gather_from: all_gather on the last dim
        case 3: y = own_chunk(pg, x, -1); break;       // scatter_to: this rank's slice
        case 4: y = gather(pg, x, 0); break;           // gather_from_sequence: all_gather on dim 0
        case 5: y = reduce_scatter_seq(pg, x); break;  // reduce_scatter_to_sequence
        case 6: y = own_chunk(pg, x, 0); break;        // scatter_to_sequence: this rank's part of dim 0
        case 7: y = allreduce_sum_into(pg, x).detach(); break;  // reduce_from, in place on an owned input
        default: return tdx::set_error(TDX_EINVALID, "unknown tensor-parallel op " + std::to_string(op));
      }
    }
    switch (op) {
      case 0: y = with_backward(x, y, "CopyToParallelRegionBackward", [pg](const at::Tensor& g) { return allreduce_sum(pg, g); }); break;
      case 1:
      case 7: y = with_backward(x, y, "ReduceFromParallelRegionBackward", [](const at::Tensor& g) { return g; }); break;
      case 2: y = with_backward(x, y, "GatherFromParallelRegionBackward", [pg](const at::Tensor& g) { return own_chunk(pg, g, -1); }); break;
      case 3: y = with_backward(x, y, "ScatterToParallelRegionBackward", [pg](const at::Tensor& g) { return gather(pg, g, -1); }); break;
      case 4: y = with_backward(x, y, "GatherFromSequenceParallelRegionBackward", [pg](const at::Tensor& g) { return reduce_scatter_seq(pg, g); }); break;
      case 5: y = with_backward(x, y, "ReduceScatterToSequenceParallelRegionBackward", [pg](const at::Tensor& g) { return gather(pg, g, 0); }); break;
      case 6: y = with_backward(x, y, "ScatterToSequenceParallelRegionBackward", [pg](const at::Tensor& g) { return gather(pg, g, 0); }); break;
    }
    *out = new at::Tensor(y);
    return TDX_OK;
  })
}
