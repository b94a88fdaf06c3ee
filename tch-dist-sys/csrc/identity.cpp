// A tensor's identity, for the placement registry: the address of its TensorImpl (shared by every handle
// to the same tensor, as tch's shallow clones and a VarStore's entries are), with a weak reference that
// tells when the tensor is gone. The weak reference keeps the TensorImpl's memory (not its storage), so
// while it is held no other tensor can take that address.
#include "common.h"

#include <c10/util/intrusive_ptr.h>

struct tdx_weak {
  c10::weak_intrusive_ptr<c10::TensorImpl> p;
};

extern "C" int tdx_tensor_identity(tdx_tensor t, int64_t* id, tdx_weak** out) {
  TDX_TRY({
    auto& x = tdx::tensor(t);
    if (!x.defined()) return tdx::set_error(TDX_EINVALID, "tensor identity: the tensor is undefined");
    *id = reinterpret_cast<int64_t>(x.unsafeGetTensorImpl());
    if (out == nullptr) return TDX_OK;  // a lookup needs the address only
    *out = new tdx_weak{c10::weak_intrusive_ptr<c10::TensorImpl>(x.getIntrusivePtr())};
    return TDX_OK;
  })
}

extern "C" int tdx_weak_expired(const tdx_weak* w) { return w->p.expired() ? 1 : 0; }

extern "C" void tdx_weak_free(tdx_weak* w) { delete w; }
