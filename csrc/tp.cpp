// Megatron-LM's conjugate operators for tensor parallelism, as autograd nodes: libtorch's backward runs
// the collective. The node holds the group (an intrusive_ptr), so the graph can outlive the Rust handle.
#include "common.h"
#include "node_ptr.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace {
using c10d::Backend;
using torch::autograd::variable_list;

struct TpBackward : public torch::autograd::Node {
  std::function<at::Tensor(const at::Tensor&)> fn;
  std::string label;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {fn(grads[0])};
  }
  std::string name() const override { return label; }
};

// `out` was computed without history; give it a backward that maps its gradient to x's.
at::Tensor with_backward(const at::Tensor& x, at::Tensor out, const char* label,
                         std::function<at::Tensor(const at::Tensor&)> bwd) {
  if (!(at::GradMode::is_enabled() && x.requires_grad())) return out;
  auto node = tdx::make_node<TpBackward>();
  node->fn = std::move(bwd);
  node->label = label;
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(out, tdx::NodePtr(node));
  return out;
}

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
