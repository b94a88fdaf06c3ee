// Memory rulers. The CPU one is a counting allocator layered over libtorch's CPU allocator; this file is also
// built alone as libtch_dist_memory.so so that a Python process measures PyTorch with the very same code.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#ifdef TDX_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>  // cudaDeviceProp only: the shim links no CUDA runtime of its own

// libtorch_cuda's (ATen/cuda/CUDAContextLight.h, whose other includes the shim does not need): the
// properties ATen caches per device, through the runtime libtorch_cuda itself links.
namespace at::cuda {
cudaDeviceProp* getDeviceProperties(c10::DeviceIndex device);
}
#endif

#include <cstring>

#include "tch_dist.h"

namespace {

// The data pointer doubles as the DataPtr's context (and raw_deleter frees by pointer), as libtorch's
// raw_allocate() requires; the base allocator's DataPtr and the size live in a table until the free.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // empty tensors hold no memory
    auto device = inner.device();
    {
      std::lock_guard<std::mutex> g(table_mu_);
      table_.emplace(data, Entry{std::move(inner), n});
    }
    add(static_cast<int64_t>(n));
    return c10::DataPtr(data, data, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t allocated() const { return allocated_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  struct Entry {
    c10::DataPtr inner;  // freeing it returns the block to the base allocator
    size_t n;
  };

  static void release(void* p);

  void add(int64_t d) {
    int64_t now = allocated_.fetch_add(d) + d;
    int64_t prev = peak_.load();
    while (now > prev && !peak_.compare_exchange_weak(prev, now)) {
    }
  }

  c10::Allocator* base_;
  std::atomic<int64_t> allocated_{0};
  std::atomic<int64_t> peak_{0};
  std::mutex table_mu_;
  std::unordered_map<void*, Entry> table_;
};

std::mutex install_mu;
CountingAllocator* counter = nullptr;  // never freed: tensors may outlive any owner we could name

void CountingAllocator::release(void* p) {
  auto* self = counter;
  if (self == nullptr || p == nullptr) return;
  c10::DataPtr inner;
  size_t n = 0;
  {
    std::lock_guard<std::mutex> g(self->table_mu_);
    auto it = self->table_.find(p);
    if (it == self->table_.end()) return;
    inner = std::move(it->second.inner);
    n = it->second.n;
    self->table_.erase(it);
  }
  self->add(-static_cast<int64_t>(n));
  // `inner` goes out of scope here, outside the lock, and frees the block
}

} // namespace

extern "C" {

int tdx_cpu_counter_install(void) {
  try {
    std::lock_guard<std::mutex> g(install_mu);
    if (counter) return TDX_OK;
    auto* c = new CountingAllocator(c10::GetCPUAllocator());
    counter = c;  // before installation: frees can arrive as soon as the first block is handed out
    c10::SetCPUAllocator(c, /*priority=*/0);
    if (c10::GetCPUAllocator() != c) {
      counter = nullptr;
      delete c;
      return TDX_EGENERIC;  // a higher-priority allocator is installed; counting would be wrong
    }
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

#ifdef TDX_CUDA
namespace {
bool valid_device(int device) { return device >= 0 && device < static_cast<int>(c10::cuda::device_count()); }

// Before the first CUDA allocation the allocator has no per-device state and its stats calls throw;
// nothing is allocated then, which is what torch.cuda.memory_allocated reports.
bool allocator_started() {
  auto* alloc = c10::cuda::CUDACachingAllocator::get();
  return alloc != nullptr && alloc->initialized();
}
} // namespace
#endif

int tdx_cuda_current_device(int* out) {
#ifdef TDX_CUDA
  try {
    *out = static_cast<int>(c10::cuda::current_device());
    return TDX_OK;
  } catch (...) {
    *out = -1;
    return TDX_EUNAVAILABLE;
  }
#else
  *out = -1;
  return TDX_EUNAVAILABLE;
#endif
}

int tdx_cuda_set_device(int device) {
#ifdef TDX_CUDA
  try {
    if (!valid_device(device)) return TDX_EINVALID;
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
    return TDX_OK;
  } catch (...) {
    return TDX_EUNAVAILABLE;
  }
#else
  (void)device;
  return TDX_EUNAVAILABLE;
#endif
}

int tdx_cuda_memory(int device, int64_t* allocated, int64_t* peak) {
#ifdef TDX_CUDA
  try {
    if (!valid_device(device)) return TDX_EUNAVAILABLE;
    if (!allocator_started()) {
      *allocated = 0;
      *peak = 0;
      return TDX_OK;
    }
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
    if (!valid_device(device)) return TDX_EUNAVAILABLE;
    if (!allocator_started()) return TDX_OK;  // no peak to reset yet
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

int tdx_cuda_peak_reserved(int device, int64_t* out) {
#ifdef TDX_CUDA
  try {
    if (!valid_device(device)) return TDX_EUNAVAILABLE;
    *out = 0;
    if (!allocator_started()) return TDX_OK;
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    *out = stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    return TDX_OK;
  } catch (...) {
    return TDX_EUNAVAILABLE;
  }
#else
  (void)device; (void)out;
  return TDX_EUNAVAILABLE;
#endif
}

int tdx_cuda_device_name(int device, char* buf, size_t len) {
#ifdef TDX_CUDA
  try {
    if (!valid_device(device) || len == 0) return TDX_EUNAVAILABLE;
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
    if (prop == nullptr) return TDX_EUNAVAILABLE;
    std::strncpy(buf, prop->name, len - 1);
    buf[len - 1] = '\0';
    return TDX_OK;
  } catch (...) {
    return TDX_EUNAVAILABLE;
  }
#else
  (void)device; (void)buf; (void)len;
  return TDX_EUNAVAILABLE;
#endif
}

} // extern "C"
