// Megatron-LM's conjugate operators for tensor parallelism, as autograd nodes: libtorch's backward runs
// the collective. The node holds the group (an intrusive_ptr), so the graph can outlive the Rust handle.
#include "common.h"
#include "lambda_node.h"

namespace {
using c10d::Backend;
using tdx::with_backward;

at::Tensor allreduce_sum(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t) {
  auto r = t.contiguous().clone();
  std::vector<at::Tensor> v{r};
  pg->allreduce(v)->wait();
  return r;
}

at::Tensor gather_last(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t) {
  auto in = t.contiguous();
  std::vector<at::Tensor> parts;
  for (int i = 0; i < pg->getSize(); i++) parts.push_back(at::empty_like(in));
  std::vector<std::vector<at::Tensor>> outs{parts};
  std::vector<at::Tensor> ins{in};
  pg->allgather(outs, ins)->wait();
  return at::cat(outs[0], -1);
}

at::Tensor own_chunk(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& t) {
  auto n = t.size(-1);
  TORCH_CHECK_VALUE(n % pg->getSize() == 0, "last dimension ", n, " is not divisible by the tensor-parallel size ",
                    pg->getSize());
  return t.chunk(pg->getSize(), -1)[pg->getRank()].contiguous();
}
} // namespace

extern "C" int tdx_tp_op(tdx_pg* g, int op, tdx_tensor xt, tdx_tensor* out) {
  TDX_TRY({
    auto pg = g->backend;
    const auto& x = tdx::tensor(xt);
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      switch (op) {
        case 0: y = x.detach(); break;                 // copy_to: identity
        case 1: y = allreduce_sum(pg, x); break;       // reduce_from: allreduce
        case 2: y = gather_last(pg, x); break;         // gather_from: all_gather on the last dim
        case 3: y = own_chunk(pg, x); break;           // scatter_to: this rank's slice
        default: return tdx::set_error(TDX_EINVALID, "unknown tensor-parallel op " + std::to_string(op));
      }
    }
    switch (op) {
      case 0: y = with_backward(x, y, "CopyToParallelRegionBackward", [pg](const at::Tensor& g) { return allreduce_sum(pg, g); }); break;
      case 1: y = with_backward(x, y, "ReduceFromParallelRegionBackward", [](const at::Tensor& g) { return g; }); break;
      case 2: y = with_backward(x, y, "GatherFromParallelRegionBackward", [pg](const at::Tensor& g) { return own_chunk(pg, g); }); break;
      case 3: y = with_backward(x, y, "ScatterToParallelRegionBackward", [pg](const at::Tensor& g) { return gather_last(pg, g); }); break;
    }
    *out = new at::Tensor(y);
    return TDX_OK;
  })
}
