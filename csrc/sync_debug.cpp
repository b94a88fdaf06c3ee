// CUDA's sync debug mode (torch.cuda.set_sync_debug_mode): with it on, every operation that makes the
// host wait for the GPU warns (or throws) where it is called, which is how a step is shown sync-free.
#ifdef TDX_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "tch_dist.h"

int tdx_cuda_set_sync_debug_mode(int mode, int* previous) {
#ifdef TDX_CUDA
  if (mode < 0 || mode > 2) return TDX_EINVALID;
  try {
    auto& state = c10::cuda::warning_state();
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
