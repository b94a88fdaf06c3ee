// Memory rulers. The CPU one is a counting allocator layered over libtorch's CPU allocator; this file is also
// built alone as libtch_dist_memory.so so that a Python process measures PyTorch with the very same code.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

#ifdef TDX_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "tch_dist.h"

namespace {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    auto device = inner.device();
    auto* ctx = new Ctx{std::move(inner), n, this};
    add(static_cast<int64_t>(n));
    return c10::DataPtr(data, ctx, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t allocated() const { return allocated_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  struct Ctx {
    c10::DataPtr inner;  // freeing it returns the block to the base allocator
    size_t n;
    CountingAllocator* owner;
  };

  static void release(void* p) {
    auto* ctx = static_cast<Ctx*>(p);
    ctx->owner->add(-static_cast<int64_t>(ctx->n));
    delete ctx;
  }

  void add(int64_t d) {
    int64_t now = allocated_.fetch_add(d) + d;
    int64_t prev = peak_.load();
    while (now > prev && !peak_.compare_exchange_weak(prev, now)) {
    }
  }

  c10::Allocator* base_;
  std::atomic<int64_t> allocated_{0};
  std::atomic<int64_t> peak_{0};
};

std::mutex install_mu;
CountingAllocator* counter = nullptr;  // never freed: tensors may outlive any owner we could name

} // namespace

extern "C" {

int tdx_cpu_counter_install(void) {
  try {
    std::lock_guard<std::mutex> g(install_mu);
    if (counter) return TDX_OK;
    auto* c = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(c, /*priority=*/0);
    if (c10::GetCPUAllocator() != c) {
      delete c;
      return TDX_EGENERIC;  // a higher-priority allocator is installed; counting would be wrong
    }
    counter = c;
    return TDX_OK;
  } catch (...) {
    return TDX_EGENERIC;
  }
}

int tdx_cpu_counter_installed(void) { return counter ? 1 : 0; }
int64_t tdx_cpu_allocated(void) { return counter ? counter->allocated() : 0; }
int64_t tdx_cpu_peak(void) { return counter ? counter->peak() : 0; }
void tdx_cpu_reset_peak(void) {
  if (counter) counter->reset_peak();
}

int tdx_cuda_device_count(int* out) {
#ifdef TDX_CUDA
  try {
    *out = static_cast<int>(c10::cuda::device_count());
    return TDX_OK;
  } catch (...) {
    *out = 0;
    return TDX_OK;
  }
#else
  *out = 0;
  return TDX_OK;
#endif
}

int tdx_cuda_memory(int device, int64_t* allocated, int64_t* peak) {
#ifdef TDX_CUDA
  try {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto& s = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    *allocated = s.current;
    *peak = s.peak;
    return TDX_OK;
  } catch (...) {
    return TDX_EUNAVAILABLE;
  }
#else
  (void)device; (void)allocated; (void)peak;
  return TDX_EUNAVAILABLE;
#endif
}

int tdx_cuda_reset_peak(int device) {
#ifdef TDX_CUDA
  try {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return TDX_OK;
  } catch (...) {
    return TDX_EUNAVAILABLE;
  }
#else
  (void)device;
  return TDX_EUNAVAILABLE;
#endif
}

} // extern "C"
