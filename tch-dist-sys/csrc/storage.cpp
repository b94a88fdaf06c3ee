// A tensor's storage freed and allocated again in place, as FSDP frees a unit's gathered parameters between
// uses. The StorageImpl itself stays, so every tensor sharing it (the parameters' views, and the tensors
// autograd saved for backward) sees memory again once it is back.
#include "common.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

extern "C" int tdx_storage_resize(tdx_tensor t, int64_t nbytes) {
  TDX_TRY({
    auto& x = tdx::tensor(t);
    if (!x.defined() || !x.has_storage()) return tdx::set_error(TDX_EINVALID, "storage resize: the tensor has no storage");
    if (nbytes < 0) return tdx::set_error(TDX_EINVALID, "storage resize: negative size " + std::to_string(nbytes));
    c10::StorageImpl* s = x.storage().unsafeGetStorageImpl();
    auto have = static_cast<int64_t>(s->nbytes());
    if (have == nbytes) return TDX_OK;
    if (nbytes == 0) {
      s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
      s->set_nbytes(0);
      return TDX_OK;
    }
    // Allocation only from empty: the contents are not carried over (the caller fills the memory).
    if (have != 0)
      return tdx::set_error(TDX_EINVALID, "storage resize: allocating " + std::to_string(nbytes) +
                                              " bytes over a live storage of " + std::to_string(have));
    at::Allocator* a = s->allocator();
    if (!a) return tdx::set_error(TDX_EINVALID, "storage resize: the storage has no allocator (borrowed memory)");
    // The CUDA caching allocator allocates on the current device: make it the storage's own (a rank on
    // cuda:3 would otherwise gather into cuda:0's memory).
    c10::OptionalDeviceGuard guard;
    if (s->device().is_cuda()) guard.reset_device(s->device());
    s->set_data_ptr_noswap(a->allocate(nbytes));
    s->set_nbytes(nbytes);
    return TDX_OK;
  })
}

extern "C" int tdx_storage_nbytes(tdx_tensor t, int64_t* out) {
  TDX_TRY({
    auto& x = tdx::tensor(t);
    *out = (x.defined() && x.has_storage()) ? static_cast<int64_t>(x.storage().nbytes()) : 0;
    return TDX_OK;
  })
}

extern "C" int tdx_storage_use_count(tdx_tensor t, int64_t* out) {
  TDX_TRY({
    auto& x = tdx::tensor(t);
    *out = (x.defined() && x.has_storage()) ? static_cast<int64_t>(x.storage().use_count()) : 0;
    return TDX_OK;
  })
}

extern "C" int tdx_storage_move(tdx_tensor dst, tdx_tensor src) {
  TDX_TRY({
    auto& d = tdx::tensor(dst);
    auto& s = tdx::tensor(src);
    if (!d.defined() || !d.has_storage() || !s.defined() || !s.has_storage())
      return tdx::set_error(TDX_EINVALID, "storage move: a tensor has no storage");
    c10::StorageImpl* di = d.storage().unsafeGetStorageImpl();
    c10::StorageImpl* si = s.storage().unsafeGetStorageImpl();
    if (di == si) return TDX_OK;
    if (di->nbytes() != 0)
      return tdx::set_error(TDX_EINVALID, "storage move: the destination holds " + std::to_string(di->nbytes()) + " bytes");
    if (di->device() != si->device())
      return tdx::set_error(TDX_EINVALID, "storage move: the storages are on different devices");
    size_t n = si->nbytes();
    at::DataPtr p = si->set_data_ptr(at::DataPtr(nullptr, si->device()));
    si->set_nbytes(0);
    di->set_data_ptr_noswap(std::move(p));
    di->set_nbytes(n);
    return TDX_OK;
  })
}

extern "C" int tdx_storage_id(tdx_tensor t, int64_t* out) {
  TDX_TRY({
    auto& x = tdx::tensor(t);
    *out = (x.defined() && x.has_storage()) ? reinterpret_cast<int64_t>(x.storage().unsafeGetStorageImpl()) : 0;
    return TDX_OK;
  })
}
