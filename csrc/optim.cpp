// AdamW, both of PyTorch's CPU paths. The fused one is ATen's kernel (what torch.optim.AdamW(fused=True)
// calls): one pass over each parameter's data, gradient and moments, with no temporaries. The caller counts
// the steps; `steps` holds each parameter's step count after this one, as float32 scalars (the kernel reads
// them as PyTorch passes them). The single-tensor one is torch.optim.adamw._single_tensor_adamw's sequence of
// ATen calls with its scalars, so its results are PyTorch's bit for bit; here it runs chunk by chunk.
#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>

#include <cmath>

#include "common.h"

namespace {
// v.sqrt(), the same floats. On the CPU, ATen's float sqrt is MKL's vsSqrt, which sends a stretch holding a
// zero down a slow path (about 40x slower), and AdamW's second moments are zero wherever a gradient has only
// ever been zero (behind a dead ReLU: 58% of bench-memory's model). So zeros become ones for the MKL call
// (its results are not IEEE-rounded, so no other sqrt would give PyTorch's floats; a value's result does not
// depend on its neighbours) and go back to zeros after (+0 for -0, which `+ eps` then makes the same).
at::Tensor sqrt_of_moment(const at::Tensor& v) {
  if (!v.device().is_cpu() || v.scalar_type() != at::kFloat || !v.is_contiguous()) return v.sqrt();
  at::Tensor s = at::empty_like(v, at::MemoryFormat::Contiguous);
  const float* x = v.data_ptr<float>();
  float* y = s.data_ptr<float>();
  const int64_t n = v.numel();
  for (int64_t i = 0; i < n; i++) y[i] = x[i] == 0.f ? 1.f : x[i];
  s.sqrt_();
  for (int64_t i = 0; i < n; i++) y[i] = x[i] == 0.f ? 0.f : y[i];
  return s;
}

// One single-tensor AdamW update, in place, as PyTorch writes it.
void adamw_single(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, double lr, double wd, double b1,
                  double b2, double eps, double step) {
  p.mul_(1 - lr * wd);
  m.lerp_(g, 1 - b1);
  v.mul_(b2).addcmul_(g, g, 1 - b2);
  const double bias_correction1 = 1 - std::pow(b1, step);
  const double bias_correction2 = 1 - std::pow(b2, step);
  const double step_size = lr / bias_correction1;
  // Python's `** 0.5` is pow, which differs from sqrt in the last bit now and then
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  at::Tensor denom = (sqrt_of_moment(v) / bias_correction2_sqrt).add_(eps);
  p.addcdiv_(m, denom, -step_size);
}

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
    at::Tensor p = tdx::tensor(param), g = tdx::tensor(grad), m = tdx::tensor(exp_avg), v = tdx::tensor(exp_avg_sq);
    at::NoGradGuard no_grad;
    const double t = static_cast<double>(step);
    const int64_t n = p.numel();
    // Elementwise, so chunks give the same values as one piece; only flat memory can be cut into them.
    const bool flat = p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous();
    if (chunk <= 0 || n <= chunk || !flat) {
      adamw_single(p, g, m, v, lr, weight_decay, beta1, beta2, eps, t);
      return TDX_OK;
    }
    at::Tensor pf = p.view({-1}), gf = g.view({-1}), mf = m.view({-1}), vf = v.view({-1});
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t k = std::min(chunk, n - start);
      adamw_single(pf.narrow(0, start, k), gf.narrow(0, start, k), mf.narrow(0, start, k), vf.narrow(0, start, k),
                   lr, weight_decay, beta1, beta2, eps, t);
    }
    return TDX_OK;
  })
}
