// Random permutations from a generator of their own, seeded explicitly: what
// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` computes, without touching the
// global generator the user's program draws from.
#include "common.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <mutex>

extern "C" int tdx_randperm(int64_t n, uint64_t seed, tdx_tensor* out) {
  TDX_TRY({
    if (n < 0) return tdx::set_error(TDX_EINVALID, "randperm of a negative count " + std::to_string(n));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    *out = new at::Tensor(at::randperm(n, gen, at::TensorOptions().dtype(at::kLong)));
    return TDX_OK;
  })
}

// Tensors drawn one after another from one generator seeded with `seed`: standard normal without
// `bounds` (what `torch.manual_seed(seed); [torch.randn(*shape) for shape in shapes]` gives on the CPU),
// uniform in [-bounds[i], bounds[i]) with them (`torch.empty(*shape).uniform_(-b, b)` in turn). shapes are
// `count` tensors of ndims[i] dimensions, their sizes concatenated in `sizes`.
extern "C" int tdx_draw_seq(uint64_t seed, int dtype, size_t count, const int64_t* ndims, const int64_t* sizes,
                            const double* bounds, tdx_tensor* outs) {
  TDX_TRY({
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto opts = at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype));
    size_t k = 0;
    for (size_t i = 0; i < count; i++) {
      std::vector<int64_t> shape(sizes + k, sizes + k + ndims[i]);
      k += ndims[i];
      auto t = bounds == nullptr ? at::randn(shape, gen, opts) : at::empty(shape, opts).uniform_(-bounds[i], bounds[i], gen);
      outs[i] = new at::Tensor(t);
    }
    return TDX_OK;
  })
}

// The default generators' states (the CPU's and every CUDA device's), to put back later: what
// `torch.random.fork_rng()` keeps, so that seeding inside a scope leaves the program's draws alone.
struct tdx_rng_saved {
  std::vector<std::pair<at::Generator, at::Tensor>> states;
};

extern "C" int tdx_rng_save(tdx_rng_saved** out) {
  TDX_TRY({
    auto saved = std::make_unique<tdx_rng_saved>();
    std::vector<c10::Device> devices{c10::Device(at::kCPU)};
    int gpus = at::detail::getCUDAHooks().getNumGPUs();
    for (int i = 0; i < gpus; i++) devices.emplace_back(at::kCUDA, static_cast<c10::DeviceIndex>(i));
    for (auto d : devices) {
      auto gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      saved->states.emplace_back(gen, gen.get_state());
    }
    *out = saved.release();
    return TDX_OK;
  })
}

extern "C" void tdx_rng_restore(tdx_rng_saved* saved) {
  if (saved == nullptr) return;
  for (auto& [gen, state] : saved->states) {
    try {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    } catch (...) {
      // a state taken from this generator a moment ago is one it accepts; nothing to report from a drop
    }
  }
  delete saved;
}
