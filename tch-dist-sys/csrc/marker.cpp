// Backward markers: an identity in forward whose backward runs a callback before passing the gradients
// on. FSDP puts one on a unit's output, so its parameters are gathered again just before their backward.
#include "common.h"
#include "lambda_node.h"

extern "C" int tdx_backward_marker(tdx_tensor x, tdx_callback_fn fn, tdx_drop_fn drop, void* ctx, const char* label,
                                   tdx_tensor* out, int* attached) {
  TDX_TRY({
    // Owned from here on; freed with the node, or at once when no node is made.
    std::shared_ptr<void> owned(ctx, drop);
    const auto& in = tdx::tensor(x);
    tdx::variable_list outs;
    {
      at::NoGradGuard no_grad;
      outs.push_back(in.detach());
    }
    std::string name = label ? label : "BackwardMarker";
    bool made = tdx::set_backward({in}, outs, name, [fn, owned](tdx::variable_list&& grads) -> tdx::variable_list {
      char buf[2048];
      buf[0] = 0;
      // The Rust side catches its own panics; a failure fails this backward with its message.
      if (fn(owned.get(), buf, sizeof(buf)) != 0) throw std::runtime_error(buf);
      return std::move(grads);
    });
    *attached = made ? 1 : 0;
    *out = new at::Tensor(outs[0]);
    return TDX_OK;
  })
}
