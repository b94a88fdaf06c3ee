// All-to-all as an autograd node (expert parallelism's token dispatch and combine): the forward sends
// rows of x to the ranks by in_splits, the backward sends the output's gradient back by the transposed
// splits. The node holds the group (an intrusive_ptr), so the graph can outlive the Rust handle.
#include "common.h"
#include "lambda_node.h"

namespace {
// rows of `x` out by `in_splits`, into a new tensor of sum(out_splits) rows (empty splits: equal chunks)
at::Tensor exchange(const c10::intrusive_ptr<c10d::Backend>& pg, const at::Tensor& x, std::vector<int64_t> out_splits,
                    std::vector<int64_t> in_splits) {
  auto in = x.contiguous();
  auto shape = in.sizes().vec();
  if (!out_splits.empty()) {
    int64_t rows = 0;
    for (auto n : out_splits) rows += n;
    shape[0] = rows;
  }
  auto out = at::empty(shape, in.options());
  c10d::AllToAllOptions opts;
  // wait(): on NCCL the current stream waits on the exchange; the host does not block
  pg->alltoall_base(out, in, out_splits, in_splits, opts)->wait();
  return out;
}
} // namespace

extern "C" int tdx_all_to_all_op(tdx_pg* g, tdx_tensor xt, const int64_t* out_splits, size_t n_out,
                                 const int64_t* in_splits, size_t n_in, tdx_tensor* out) {
  TDX_TRY({
    auto pg = tdx::backend(g);
    const auto& x = tdx::tensor(xt);
    std::vector<int64_t> os(out_splits, out_splits + n_out);
    std::vector<int64_t> is(in_splits, in_splits + n_in);
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      y = exchange(pg, x, os, is);
    }
    y = tdx::with_backward(x, y, "AllToAllBackward", [pg, os, is](const at::Tensor& grad) {
      return exchange(pg, grad, is, os);
    });
    *out = new at::Tensor(y);
    return TDX_OK;
  })
}
