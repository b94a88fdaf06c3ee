// torch.optim.AdamW's single-tensor update (what it runs on the CPU by default), with PyTorch's floats.
//
// PyTorch runs eight ATen calls, each a pass over memory: p *= 1 - lr wd; m.lerp_(g, 1 - b1);
// v *= b2; v.addcmul_(g, g, 1 - b2); r = v.sqrt(); r /= sqrt(bc2); r += eps; p.addcdiv_(m, r, -lr / bc1).
// Most of that time is the passes, not the arithmetic, so the same operations run here in two passes
// around ATen's own sqrt (MKL's, whose results are not IEEE-rounded): each element gets exactly the
// roundings of ATen's vectorized loops, which compute lerp with one fused multiply-add and, in the builds
// seen here, addcmul's add too (the compiler contracts it). Which of those a build does is not visible from
// outside, so at its first use the kernel runs each variant against ATen's sequence on test data and keeps
// the one that matches bit for bit; where none does (another CPU, another build), ATen's sequence runs.
// ATen's loops leave the last n % 16 (AVX2) or n % 32 (AVX-512) elements of a call to scalar code; the last
// n % 32 go to ATen's sequence here, so they get the same treatment.
#include "adamw_single.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tdx {
namespace {

// Elements the two-pass kernel leaves to ATen at the end of each tensor (see above).
constexpr int64_t kBlock = 32;

// v.sqrt(), the same floats. On the CPU, ATen's float sqrt is MKL's vsSqrt, which sends a stretch holding a
// zero down a slow path (about 40x slower), and AdamW's second moments are zero wherever a gradient has only
// ever been zero (behind a dead ReLU: 58% of bench-memory's model). So zeros become ones for the MKL call
// (a value's result does not depend on its neighbours) and go back to zeros after (+0 for -0, which `+ eps`
// then makes the same).
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

// The scalars as PyTorch computes them (in double); ATen's float kernels receive them as floats.
struct Scalars {
  double decay, weight, b2, one_minus_b2, step_size, bc2_sqrt, eps;
  Scalars(double lr, double wd, double b1, double b2_, double eps_, double step) {
    decay = 1 - lr * wd;
    weight = 1 - b1;
    b2 = b2_;
    one_minus_b2 = 1 - b2_;
    step_size = lr / (1 - std::pow(b1, step));
    // Python's `** 0.5` is pow, which differs from sqrt in the last bit now and then
    bc2_sqrt = std::pow(1 - std::pow(b2_, step), 0.5);
    eps = eps_;
  }
};

// ATen's sequence, as torch.optim.adamw._single_tensor_adamw writes it.
void aten_sequence(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, const Scalars& s) {
  p.mul_(s.decay);
  m.lerp_(g, s.weight);
  v.mul_(s.b2).addcmul_(g, g, s.one_minus_b2);
  at::Tensor denom = (sqrt_of_moment(v) / s.bc2_sqrt).add_(s.eps);
  p.addcdiv_(m, denom, -s.step_size);
}

#if defined(__x86_64__)
// Variant bits: which of ATen's operations its build computes with a fused multiply-add.
constexpr int kLerpFma = 1, kAddcmulFma = 2, kVariants = 4;

// Pass 1: m and v updated; `root` gets v with its zeros made ones (for the sqrt, as sqrt_of_moment).
// n is a multiple of 8. The shim is built with -ffp-contract=off, so each intrinsic rounds on its own.
template <int kVariant>
__attribute__((target("avx2,fma"))) void moments(const float* g, float* m, float* v, float* root, int64_t n,
                                                  const Scalars& s) {
  // ATen's lerp: start + w (end - start) for |w| < 0.5, else end + (w - 1) (end - start)
  const float w = static_cast<float>(s.weight);
  const bool small = std::fabs(w) < 0.5f;
  const __m256 coeff = _mm256_set1_ps(small ? w : w - 1.f);
  const __m256 b2 = _mm256_set1_ps(static_cast<float>(s.b2));
  const __m256 c2 = _mm256_set1_ps(static_cast<float>(s.one_minus_b2));
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i), mi = _mm256_loadu_ps(m + i);
    const __m256 diff = _mm256_sub_ps(gi, mi);
    const __m256 base = small ? mi : gi;
    const __m256 mo = (kVariant & kLerpFma) ? _mm256_fmadd_ps(coeff, diff, base)
                                            : _mm256_add_ps(_mm256_mul_ps(coeff, diff), base);
    _mm256_storeu_ps(m + i, mo);
    const __m256 vi = _mm256_mul_ps(_mm256_loadu_ps(v + i), b2);
    const __m256 cg = _mm256_mul_ps(c2, gi);
    const __m256 vo = (kVariant & kAddcmulFma) ? _mm256_fmadd_ps(cg, gi, vi) : _mm256_add_ps(vi, _mm256_mul_ps(cg, gi));
    _mm256_storeu_ps(v + i, vo);
    _mm256_storeu_ps(root + i, _mm256_blendv_ps(vo, one, _mm256_cmp_ps(vo, zero, _CMP_EQ_OQ)));
  }
}

// Pass 2, after the sqrt of `root`: p = p decay + (-step_size m) / (root / bc2_sqrt + eps), root 0 where
// v is.
__attribute__((target("avx2,fma"))) void apply(float* p, const float* m, const float* v, const float* root,
                                                int64_t n, const Scalars& s) {
  const __m256 decay = _mm256_set1_ps(static_cast<float>(s.decay));
  const __m256 bc2 = _mm256_set1_ps(static_cast<float>(s.bc2_sqrt));
  const __m256 eps = _mm256_set1_ps(static_cast<float>(s.eps));
  const __m256 neg_step = _mm256_set1_ps(static_cast<float>(-s.step_size));
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 r =
        _mm256_blendv_ps(_mm256_loadu_ps(root + i), zero, _mm256_cmp_ps(_mm256_loadu_ps(v + i), zero, _CMP_EQ_OQ));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(r, bc2), eps);
    const __m256 decayed = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    const __m256 upd = _mm256_div_ps(_mm256_mul_ps(neg_step, _mm256_loadu_ps(m + i)), denom);
    _mm256_storeu_ps(p + i, _mm256_add_ps(decayed, upd));
  }
}

using MomentsFn = void (*)(const float*, float*, float*, float*, int64_t, const Scalars&);
const MomentsFn kMoments[kVariants] = {moments<0>, moments<1>, moments<2>, moments<3>};

// Elements per pass: the five arrays stay in a core's L2 between the passes.
constexpr int64_t kPiece = 1 << 16;

// The update of flat float32 tensors: the first n - n % kBlock elements in two passes (over pieces, in
// parallel as ATen would), the rest by ATen's sequence.
void two_pass(int variant, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
              const Scalars& s) {
  const int64_t n = p.numel(), body = n - n % kBlock;
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  if (body > 0) {
    at::parallel_for(0, body / kBlock, kPiece / kBlock, [&](int64_t b0, int64_t b1) {
      const int64_t from = b0 * kBlock, to = b1 * kBlock;
      at::Tensor root = at::empty({std::min(kPiece, to - from)}, at::kFloat);
      float* r = root.data_ptr<float>();
      for (int64_t i = from; i < to; i += kPiece) {
        const int64_t k = std::min(kPiece, to - i);
        kMoments[variant](gp + i, mp + i, vp + i, r, k, s);
        root.narrow(0, 0, k).sqrt_();
        apply(pp + i, mp + i, vp + i, r, k, s);
      }
    });
  }
  if (body < n) {
    auto tail = [&](const at::Tensor& t) { return t.view({-1}).narrow(0, body, n - body); };
    aten_sequence(tail(p), tail(g), tail(m), tail(v), s);
  }
}

#endif

// Runs every variant against ATen's sequence on test data (sizes with and without a tail, both branches of
// lerp, zero gradients and moments, three steps); returns the first that matched bit for bit, or -1.
int choose_variant() {
#if !defined(__x86_64__)
  return -1;
#else
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return -1;
  at::NoGradGuard no_grad;
  const int64_t n = 4 * kPiece / 2 + kBlock * 3 + 21;  // several pieces and a tail
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor idx = at::arange(n, opts);
  const at::Tensor dead = at::remainder(at::arange(n, opts.dtype(at::kLong)), 3).eq(0);
  struct Hyper {
    double lr, wd, b1, b2, eps;
  };
  const Hyper hypers[] = {{1e-3, 1e-2, 0.9, 0.999, 1e-8}, {1e-2, 0.1, 0.3, 0.99, 1e-6}};
  for (int variant = 0; variant < kVariants; variant++) {
    bool same = true;
    for (const Hyper& h : hypers) {
      at::Tensor pa = (idx * 0.37 + 0.3).sin_() * 0.5, ma = at::zeros({n}, opts), va = at::zeros({n}, opts);
      at::Tensor pb = pa.clone(), mb = ma.clone(), vb = va.clone();
      for (int step = 1; same && step <= 3; step++) {
        const at::Tensor g = ((idx * 0.53 + step).sin_() * (0.1 * step)).masked_fill_(dead, 0);
        const Scalars s(h.lr, h.wd, h.b1, h.b2, h.eps, step);
        aten_sequence(pa, g, ma, va, s);
        two_pass(variant, pb, g, mb, vb, s);
        for (auto [a, b] : {std::pair{&pa, &pb}, {&ma, &mb}, {&va, &vb}}) {
          same = same && std::memcmp(a->data_ptr(), b->data_ptr(), n * sizeof(float)) == 0;
        }
      }
    }
    if (same) return variant;
  }
  return -1;
#endif
}
} // namespace

int adamw_two_pass_variant() {
  static const int variant = choose_variant();
  return variant;
}

void adamw_single(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v, double lr,
                  double wd, double b1, double b2, double eps, int64_t step, int64_t chunk) {
  at::NoGradGuard no_grad;
  const Scalars s(lr, wd, b1, b2, eps, static_cast<double>(step));
  const int64_t n = p.numel();
  const bool flat = p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous();
  bool fast = flat;
  for (const at::Tensor* t : {&p, &g, &m, &v}) {
    fast = fast && t->device().is_cpu() && t->scalar_type() == at::kFloat && t->numel() == n;
  }
#if defined(__x86_64__)
  const int variant = fast ? adamw_two_pass_variant() : -1;
  if (variant >= 0) {
    two_pass(variant, p, g, m, v, s);
    return;
  }
#endif
  // Elementwise, so chunks give the same values as one piece; only flat memory can be cut into them.
  if (chunk <= 0 || n <= chunk || !flat) {
    aten_sequence(p, g, m, v, s);
    return;
  }
  at::Tensor pf = p.view({-1}), gf = g.view({-1}), mf = m.view({-1}), vf = v.view({-1});
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t k = std::min(chunk, n - start);
    aten_sequence(pf.narrow(0, start, k), gf.narrow(0, start, k), mf.narrow(0, start, k), vf.narrow(0, start, k), s);
  }
}
} // namespace tdx
