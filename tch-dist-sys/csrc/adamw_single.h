// torch.optim.AdamW's single-tensor update, with its floats: see adamw_single.cpp.
#pragma once
#include <ATen/ATen.h>

namespace tdx {
// One AdamW update in place, as torch.optim.adamw._single_tensor_adamw computes it, `chunk` elements at a
// time where the tensors are flat (0: in one piece). `step` is the step count after this one.
void adamw_single(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v, double lr,
                  double wd, double b1, double b2, double eps, int64_t step, int64_t chunk);

// Which variant of the two-pass kernel gave ATen's floats at its first use (>= 0), or -1 where none did
// and ATen's own sequence runs (tests read it).
int adamw_two_pass_variant();
} // namespace tdx
