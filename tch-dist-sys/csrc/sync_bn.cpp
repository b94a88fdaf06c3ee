// SyncBatchNorm's training forward and backward as one autograd node, speaking PyTorch's protocol
// (torch/nn/modules/_functions.py) so that a PyTorch rank and a tch-dist rank share a group:
// - forward: each rank's [mean, invstd, count] (2C + 1 values) all-gathered (a list on Gloo, one flat
//   tensor elsewhere), combined into the group's mean and invstd weighted by the counts;
// - backward: [sum_dy, sum_dy_xmu] (2C values) summed over the group, only when the input needs a
//   gradient (as PyTorch's needs_input_grad[0]); the weight's and bias's gradients stay local (DDP
//   averages them).
// Written with ATen's generic ops, so it runs on CPU (where the CUDA kernels PyTorch calls do not exist)
// and on CUDA alike. A rank with an empty batch takes part with zeros, and its count of zero removes it
// from the sums arithmetically, without the host reading the counts (PyTorch's mask syncs the host).
#include "common.h"
#include "lambda_node.h"

#include <ATen/ATen.h>

namespace {
using c10d::Backend;

// The per-channel view of a [C] tensor against an input of `dim` dimensions ([1, C, 1, ...]).
at::Tensor per_channel(const at::Tensor& t, int64_t dim) {
  std::vector<int64_t> shape(dim, 1);
  shape[1] = -1;
  return t.view(shape);
}

std::vector<int64_t> reduce_dims(int64_t dim) {
  std::vector<int64_t> d{0};
  for (int64_t i = 2; i < dim; i++) d.push_back(i);
  return d;
}

// Every rank's `combined`, as rows of a [world, n] tensor.
at::Tensor all_gather_rows(const c10::intrusive_ptr<Backend>& pg, const at::Tensor& combined) {
  auto world = pg->getSize();
  if (pg->getBackendName() == "gloo") {
    std::vector<at::Tensor> parts;
    for (int i = 0; i < world; i++) parts.push_back(at::empty_like(combined));
    std::vector<std::vector<at::Tensor>> outs{parts};
    std::vector<at::Tensor> ins{combined};
    pg->allgather(outs, ins)->wait();
    return at::stack(outs[0], 0);
  }
  auto flat = at::empty({world * combined.numel()}, combined.options());
  pg->_allgather_base(flat, const_cast<at::Tensor&>(combined))->wait();
  return flat.view({world, combined.numel()});
}

struct Saved {
  at::Tensor x, weight, mean, invstd, total;  // total: the group's count, a [1] tensor
};
} // namespace

extern "C" int tdx_sync_batch_norm(tdx_pg* g, tdx_tensor xt, tdx_tensor wt, tdx_tensor bt, tdx_tensor rmt,
                                   tdx_tensor rvt, double eps, double momentum, tdx_tensor* out) {
  TDX_TRY({
    auto pg = tdx::backend(g);
    const auto& x_in = tdx::tensor(xt);
    at::Tensor w = wt ? tdx::tensor(wt) : at::Tensor();
    at::Tensor b = bt ? tdx::tensor(bt) : at::Tensor();
    TORCH_CHECK_VALUE(x_in.dim() >= 2, "SyncBatchNorm expects an input of at least 2 dimensions [N, C, ...], got ",
                      x_in.sizes());
    auto dim = x_in.dim();
    auto C = x_in.size(1);
    TORCH_CHECK_VALUE(C > 0, "SyncBatchNorm: the input has no channels (", x_in.sizes(), ")");
    for (const auto& t : {w, b})
      TORCH_CHECK_VALUE(!t.defined() || (t.dim() == 1 && t.size(0) == C), "SyncBatchNorm: ", C,
                        " channels in the input, but a weight or bias of shape ", t.sizes());
    auto per_rank = C > 0 ? x_in.numel() / C : 0;
    TORCH_CHECK_VALUE(!(per_rank == 1 && pg->getSize() < 2),
                      "Expected more than 1 value per channel when training, got input size ", x_in.sizes());
    // the statistics in float for 16-bit inputs, as PyTorch's batch_norm_stats accumulates
    auto stat_kind = (x_in.scalar_type() == at::kHalf || x_in.scalar_type() == at::kBFloat16)
                         ? at::kFloat
                         : x_in.scalar_type();
    at::Tensor y, mean, invstd, total;
    Saved saved;
    {
      at::NoGradGuard no_grad;
      auto x = x_in.contiguous();
      auto dims = reduce_dims(dim);
      at::Tensor combined;
      if (x.numel() > 0) {
        auto [var, m] = at::var_mean(x.to(stat_kind), dims, c10::Scalar(0), /*keepdim=*/false);
        auto count = at::full({1}, static_cast<double>(per_rank), m.options());
        combined = at::cat({m, (var + eps).rsqrt(), count}, 0);
      } else {
        combined = at::zeros({2 * C + 1}, x.options().dtype(stat_kind));
      }
      auto rows = all_gather_rows(pg, combined);
      auto mean_all = rows.narrow(1, 0, C);
      auto invstd_all = rows.narrow(1, C, C);
      auto count_all = rows.narrow(1, 2 * C, 1);  // [world, 1]
      auto present = count_all > 0;
      total = count_all.sum(0);  // [1]
      mean = (mean_all * count_all).sum(0) / total;
      // each rank's biased variance back from its invstd; an empty rank's (1/0) is masked out
      auto var_all = at::where(present, invstd_all.pow(-2) - eps, at::zeros({}, invstd_all.options()));
      auto dev = mean_all - mean.unsqueeze(0);
      auto var = (count_all * (var_all + dev * dev)).sum(0) / total;
      invstd = (var + eps).rsqrt();
      if (rmt) {
        auto& rm = tdx::tensor(rmt);
        rm.mul_(1 - momentum).add_(mean.to(rm.scalar_type()), momentum);
      }
      if (rvt) {
        auto& rv = tdx::tensor(rvt);
        auto unbiased = var * total / (total - 1);
        rv.mul_(1 - momentum).add_(unbiased.to(rv.scalar_type()), momentum);
      }
      auto scale = w.defined() ? invstd * w.to(stat_kind) : invstd;
      auto shifted = (x.to(stat_kind) - per_channel(mean, dim)) * per_channel(scale, dim);
      if (b.defined()) shifted = shifted + per_channel(b.to(stat_kind), dim);
      y = shifted.to(x.scalar_type());
      saved = Saved{x.detach(), w.defined() ? w.detach() : at::Tensor(), mean, invstd, total};
    }
    bool input_grad = x_in.requires_grad();
    bool weight_grad = w.defined() && w.requires_grad();
    bool bias_grad = b.defined() && b.requires_grad();
    torch::autograd::variable_list outs{y};
    tdx::set_backward(
        {x_in, w, b}, outs, "SyncBatchNormBackward",
        [pg, saved, input_grad, weight_grad, bias_grad, C, dim, stat_kind](
            torch::autograd::variable_list&& grads) -> torch::autograd::variable_list {
          at::Tensor gx, gw, gb;
          const auto& dy_in = grads[0];
          const auto& x = saved.x;
          at::Tensor sum_dy, sum_dy_xmu, xmu, dy;
          if (x.numel() > 0) {
            dy = dy_in.defined() ? dy_in.contiguous().to(stat_kind) : at::zeros(x.sizes(), x.options().dtype(stat_kind));
            xmu = x.to(stat_kind) - per_channel(saved.mean, dim);
            auto dims = reduce_dims(dim);
            sum_dy = dy.sum(dims);
            sum_dy_xmu = (dy * xmu).sum(dims);
            if (weight_grad) gw = (sum_dy_xmu * saved.invstd).to(saved.weight.scalar_type());
            if (bias_grad) gb = sum_dy.to(saved.weight.defined() ? saved.weight.scalar_type() : x.scalar_type());
          }
          if (input_grad) {
            auto combined = x.numel() > 0 ? at::cat({sum_dy, sum_dy_xmu}, 0)
                                          : at::zeros({2 * C}, x.options().dtype(stat_kind));
            std::vector<at::Tensor> v{combined};
            pg->allreduce(v)->wait();
            if (x.numel() > 0) {
              auto mean_dy = combined.narrow(0, 0, C) / saved.total;
              auto mean_dy_xmu = combined.narrow(0, C, C) / saved.total;
              auto scale = saved.weight.defined() ? saved.invstd * saved.weight.to(stat_kind) : saved.invstd;
              auto proj = xmu * per_channel(saved.invstd * saved.invstd * mean_dy_xmu, dim);
              gx = ((dy - per_channel(mean_dy, dim) - proj) * per_channel(scale, dim)).to(x.scalar_type());
            } else {
              gx = at::zeros_like(x);
            }
          }
          return {gx, gw, gb};
        },
        [] {});  // the saved tensors go with the closure once the graph is done with them
    *out = new at::Tensor(outs[0]);
    return TDX_OK;
  })
}
