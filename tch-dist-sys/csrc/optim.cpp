// SGD's update, and AdamW, both of PyTorch's CPU paths. The fused one is ATen's kernel (what torch.optim.AdamW(fused=True)
// calls): one pass over each parameter's data, gradient and moments, with no temporaries. The caller counts
// the steps; `steps` holds each parameter's step count after this one, as float32 scalars (the kernel reads
// them as PyTorch passes them). The single-tensor one (torch.optim.adamw._single_tensor_adamw, with its floats)
// is in adamw_single.cpp.
#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>

#include <cmath>

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

namespace {
std::vector<at::Scalar> scalar_list(const std::vector<double>& xs) { return {xs.begin(), xs.end()}; }
} // namespace

extern "C" int tdx_foreach_adamw(const tdx_tensor* params, const tdx_tensor* grads, const tdx_tensor* exp_avgs,
                                 const tdx_tensor* exp_avg_sqs, const int64_t* steps, size_t n, double lr,
                                 double beta1, double beta2, double weight_decay, double eps) {
  TDX_TRY({
    if (n == 0) return TDX_OK;
    auto p = list(params, n), g = list(grads, n), m = list(exp_avgs, n), v = list(exp_avg_sqs, n);
    at::NoGradGuard no_grad;
    // torch.optim.adam._multi_tensor_adam (decoupled weight decay, capturable=False), call for call; its
    // bias corrections are host floats computed as Python does (`x ** y` is C's pow)
    if (weight_decay != 0) at::_foreach_mul_(p, at::Scalar(1 - lr * weight_decay));
    at::_foreach_lerp_(m, g, at::Scalar(1 - beta1));
    at::_foreach_mul_(v, at::Scalar(beta2));
    at::_foreach_addcmul_(v, g, g, at::Scalar(1 - beta2));
    std::vector<double> step_size, bc2_sqrt;
    for (size_t i = 0; i < n; i++) {
      const double s = static_cast<double>(steps[i]);
      step_size.push_back((lr / (1 - std::pow(beta1, s))) * -1);
      bc2_sqrt.push_back(std::pow(1 - std::pow(beta2, s), 0.5));
    }
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, scalar_list(bc2_sqrt));
    at::_foreach_add_(denom, at::Scalar(eps));
    at::_foreach_addcdiv_(p, m, denom, scalar_list(step_size));
    return TDX_OK;
  })
}

extern "C" int tdx_foreach_sgd(const tdx_tensor* params, const tdx_tensor* grads, tdx_tensor* bufs, size_t n,
                               double lr, double momentum, double dampening, int nesterov, double weight_decay) {
  TDX_TRY({
    if (n == 0) return TDX_OK;
    auto p = list(params, n), g = list(grads, n);
    at::NoGradGuard no_grad;
    // torch.optim.sgd._multi_tensor_sgd, call for call (Nesterov adds into the gradients in place, as it does)
    std::vector<at::Tensor> d = weight_decay != 0 ? at::_foreach_add(g, p, at::Scalar(weight_decay)) : g;
    if (momentum != 0) {
      bool all = true;
      for (size_t i = 0; i < n; i++) all = all && bufs[i] != nullptr;
      std::vector<at::Tensor> b;
      if (all) {
        b = list(bufs, n);
        at::_foreach_mul_(b, at::Scalar(momentum));
        at::_foreach_add_(b, d, at::Scalar(1 - dampening));
      } else {
        for (size_t i = 0; i < n; i++) {
          if (bufs[i] == nullptr) {
            b.push_back(d[i].detach().clone());
            bufs[i] = new at::Tensor(b.back());
          } else {
            b.push_back(tdx::tensor(bufs[i]));
            b.back().mul_(momentum).add_(d[i], 1 - dampening);
          }
        }
      }
      if (nesterov) {
        at::_foreach_add_(d, b, at::Scalar(momentum));
      } else {
        d = b;
      }
    }
    at::_foreach_add_(p, d, at::Scalar(-lr));
    return TDX_OK;
  })
}

extern "C" int tdx_foreach_norms(const tdx_tensor* ts, size_t n, double ord, tdx_tensor* out) {
  TDX_TRY({
    at::NoGradGuard no_grad;
    auto l = list(ts, n);
    // 16-bit tensors' norms in float32; others in their own dtype (a float64 norm is not narrowed)
    std::optional<at::ScalarType> dtype;
    if (n > 0 && at::isReducedFloatingType(l[0].scalar_type())) dtype = at::kFloat;
    *out = new at::Tensor(at::stack(at::_foreach_norm(l, at::Scalar(ord), dtype)));
    return TDX_OK;
  })
}

extern "C" int tdx_foreach_mul_(const tdx_tensor* ts, size_t n, tdx_tensor factor) {
  TDX_TRY({
    if (n == 0) return TDX_OK;
    at::NoGradGuard no_grad;
    at::_foreach_mul_(list(ts, n), tdx::tensor(factor));
    return TDX_OK;
  })
}
