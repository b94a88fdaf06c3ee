// CUDA's sync debug mode (torch.cuda.set_sync_debug_mode): with it on, every operation that makes the
// host wait for the GPU warns (or throws) where it is called, which is how a step is shown sync-free.
#ifdef TDX_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <dlfcn.h>
#endif

#include "tch_dist.h"

#ifdef TDX_CUDA
namespace {
// warning_state() is an inline function holding a static: this shim, linked into the executable, has a
// copy of its own that libtorch's inline checks never read. libc10_cuda's copy is the one that counts.
c10::cuda::WarningState& shared_state() {
  void* p = dlsym(RTLD_DEFAULT, "_ZZN3c104cuda13warning_stateEvE14warning_state_");
  return p != nullptr ? *static_cast<c10::cuda::WarningState*>(p) : c10::cuda::warning_state();
}
}  // namespace
#endif

int tdx_cuda_set_sync_debug_mode(int mode, int* previous) {
#ifdef TDX_CUDA
  if (mode < 0 || mode > 2) return TDX_EINVALID;
  try {
    auto& state = shared_state();
    *previous = static_cast<int>(state.get_sync_debug_mode());
    state.set_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(mode));
    return TDX_OK;
  } catch (...) {
    return TDX_EUNAVAILABLE;
  }
#else
  (void)mode;
  (void)previous;
  return TDX_EUNAVAILABLE;
#endif
}
