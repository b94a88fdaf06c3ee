// SGD's update, and AdamW, both of PyTorch's CPU paths. The fused one is ATen's kernel (what torch.optim.AdamW(fused=True)
// calls): one pass over each parameter's data, gradient and moments, with no temporaries. The caller counts
// the steps; `steps` holds each parameter's step count after this one, as float32 scalars (the kernel reads
// them as PyTorch passes them). The single-tensor one (torch.optim.adamw._single_tensor_adamw, with its floats)
// is in adamw_single.cpp.
#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>

#include "adamw_single.h"
#include "common.h"

namespace {
std::vector<at::Tensor> list(const tdx_tensor* ts, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; i++) out.push_back(tdx::tensor(ts[i]));
  return out;
}
} // namespace

extern "C" int tdx_fused_adamw(const tdx_tensor* params, const tdx_tensor* grads, const tdx_tensor* exp_avgs,
                               const tdx_tensor* exp_avg_sqs, const tdx_tensor* steps, size_t n, double lr,
                               double beta1, double beta2, double weight_decay, double eps) {
  TDX_TRY({
    auto p = list(params, n), g = list(grads, n), m = list(exp_avgs, n), v = list(exp_avg_sqs, n),
         s = list(steps, n);
    at::NoGradGuard no_grad;
    at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                      /*maximize=*/false);
    return TDX_OK;
  })
}

extern "C" int tdx_adamw_step(tdx_tensor param, tdx_tensor grad, tdx_tensor exp_avg, tdx_tensor exp_avg_sq, double lr,
                              double beta1, double beta2, double weight_decay, double eps, int64_t step,
                              int64_t chunk) {
  TDX_TRY({
    tdx::adamw_single(tdx::tensor(param), tdx::tensor(grad), tdx::tensor(exp_avg), tdx::tensor(exp_avg_sq), lr,
                      weight_decay, beta1, beta2, eps, step, chunk);
    return TDX_OK;
  })
}

extern "C" int tdx_adamw_two_pass_variant() {
  try {
    return tdx::adamw_two_pass_variant();
  } catch (...) {
    return -1;
  }
}

extern "C" int tdx_add_scaled(tdx_tensor self, tdx_tensor other, double alpha, tdx_tensor* out) {
  TDX_TRY({
    at::NoGradGuard no_grad;
    if (out == nullptr) {
      tdx::tensor(self).add_(tdx::tensor(other), alpha);
    } else {
      *out = new at::Tensor(tdx::tensor(self).add(tdx::tensor(other), alpha));
    }
    return TDX_OK;
  })
}
