// libtorch's own DDP bucket assignment, exposed so tests can check ours against it.
#include "common.h"

#include <torch/csrc/distributed/c10d/reducer.hpp>

extern "C" int tdx_ref_bucket_assignment(const int64_t* numels, const int* dtypes, const int* device_ids, size_t n,
                                         const uint64_t* limits, size_t n_limits, int64_t* out_order,
                                         int64_t* out_bucket_of, size_t* out_buckets) {
  TDX_TRY({
    std::vector<at::Tensor> tensors;
    tensors.reserve(n);
    for (size_t i = 0; i < n; i++) {
      // Only dtype, device and byte size matter to the assignment. Device 0 is a meta tensor (no memory),
      // device 1 a CPU tensor with stride 0 (one element of memory): two distinct devices for the keys.
      auto dev = device_ids[i] == 0 ? at::Device(at::kMeta) : at::Device(at::kCPU);
      auto opts = at::TensorOptions().dtype(static_cast<at::ScalarType>(dtypes[i])).device(dev);
      tensors.push_back(device_ids[i] == 0 ? at::empty({numels[i]}, opts)
                                           : at::empty_strided({numels[i]}, {0}, opts));
    }
    std::vector<size_t> lim(limits, limits + n_limits);
    auto result = c10d::compute_bucket_assignment_by_size(tensors, lim);
    const auto& buckets = std::get<0>(result);
    size_t pos = 0;
    for (size_t b = 0; b < buckets.size(); b++) {
      for (auto idx : buckets[b]) {
        out_order[pos++] = static_cast<int64_t>(idx);
        out_bucket_of[idx] = static_cast<int64_t>(b);
      }
    }
    *out_buckets = buckets.size();
    return TDX_OK;
  })
}
