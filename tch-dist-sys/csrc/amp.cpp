// Autocast state (thread-local in libtorch): enter saves the previous state for exit to restore.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <vector>

#include "common.h"

static at::DeviceType device_type(int device) { return device == 1 ? at::kCUDA : at::kCPU; }

int tdx_autocast_enter(int device, int enabled, int dtype, int* prev_enabled, int* prev_dtype) {
  TDX_TRY({
    auto dt = device_type(device);
    *prev_enabled = at::autocast::is_autocast_enabled(dt) ? 1 : 0;
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dt));
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dt, enabled != 0);
    at::autocast::increment_nesting();
    return TDX_OK;
  })
}

int tdx_autocast_exit(int device, int prev_enabled, int prev_dtype) {
  TDX_TRY({
    auto dt = device_type(device);
    // leaving the outermost region frees the casts cached for it
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(dt, prev_enabled != 0);
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(prev_dtype));
    return TDX_OK;
  })
}

// GradScaler's unscale: every gradient times inv_scale, found_inf set to 1 where one is not finite, in
// ATen's foreach kernel on the gradients' device, with nothing read on the host.
int tdx_amp_unscale(tdx_tensor* grads, size_t n, tdx_tensor found_inf, tdx_tensor inv_scale) {
  TDX_TRY({
    std::vector<at::Tensor> gs;
    gs.reserve(n);
    for (size_t i = 0; i < n; i++) gs.push_back(tdx::tensor(grads[i]));
    at::_amp_foreach_non_finite_check_and_unscale_(gs, tdx::tensor(found_inf), tdx::tensor(inv_scale));
    return TDX_OK;
  })
}
