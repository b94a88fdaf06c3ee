// Random permutations from a generator of their own, seeded explicitly: what
// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` computes, without touching the
// global generator the user's program draws from.
#include "common.h"

#include <ATen/CPUGeneratorImpl.h>

extern "C" int tdx_randperm(int64_t n, uint64_t seed, tdx_tensor* out) {
  TDX_TRY({
    if (n < 0) return tdx::set_error(TDX_EINVALID, "randperm of a negative count " + std::to_string(n));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    *out = new at::Tensor(at::randperm(n, gen, at::TensorOptions().dtype(at::kLong)));
    return TDX_OK;
  })
}
