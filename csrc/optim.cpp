// ATen's fused AdamW (what torch.optim.AdamW(fused=True) calls): one pass over each parameter's data,
// gradient and moments, with no temporaries. The caller counts the steps; `steps` holds each
// parameter's step count after this one, as float32 scalars (the kernel reads them as PyTorch passes them).
#include <ATen/ops/_fused_adamw.h>

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
