// AccumulateGrad post-hooks (what DDP's reducer uses) and direct access to a leaf's .grad slot.
#include "common.h"
#include "node_ptr.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

struct tdx_hook {
  // The variable only holds a weak reference to its accumulator: without this strong one the node can be
  // recreated and the hook is silently lost.
  tdx::NodePtr acc;
  uintptr_t key;
};

extern "C" {

int tdx_hook_register(tdx_tensor var, tdx_hook_fn fn, void* ctx, int64_t index, tdx_hook** out) {
  TDX_TRY({
    auto& v = tdx::tensor(var);
    if (!v.requires_grad() || !v.is_leaf())
      return tdx::set_error(TDX_EINVALID, "hooks need a leaf tensor that requires grad");
    auto acc = torch::autograd::impl::grad_accumulator(v);
    if (!acc) return tdx::set_error(TDX_EINVALID, "tensor has no grad accumulator");
    auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [fn, ctx, index](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          fn(ctx, index);  // the Rust side catches its own panics
          return outputs;
        }));
    *out = new tdx_hook{acc, key};
    return TDX_OK;
  })
}

void tdx_hook_free(tdx_hook* h) {
  try {
    if (h && h->acc) h->acc->del_post_hook(h->key);
    delete h;
  } catch (...) {
  }
}

int tdx_queue_backward_callback(tdx_callback_fn fn, tdx_drop_fn drop, void* ctx) {
  TDX_TRY({
    // ctx is owned from here on, and freed through `drop` when the callback goes, whether it ran or not
    // (a backward that fails before its final callbacks never runs them); also if anything here throws.
    std::shared_ptr<void> owned(ctx, drop);
    torch::autograd::Engine::get_default_engine().queue_callback([fn, owned]() {
      char buf[2048];
      buf[0] = 0;
      // The Rust side catches its own panics and reports failure through the return code; the
      // exception below is how autograd reports a failed callback: backward() itself fails.
      if (fn(owned.get(), buf, sizeof(buf)) != 0) throw std::runtime_error(buf);
    });
    return TDX_OK;
  })
}

int tdx_backward_with_grad(tdx_tensor output, tdx_tensor grad) {
  TDX_TRY({
    torch::autograd::backward({tdx::tensor(output)}, {tdx::tensor(grad)});
    return TDX_OK;
  })
}

int tdx_tensor_set_grad(tdx_tensor var, tdx_tensor grad) {
  TDX_TRY({
    auto& v = tdx::tensor(var);
    if (grad) {
      v.mutable_grad() = tdx::tensor(grad);
    } else {
      v.mutable_grad() = at::Tensor();
    }
    return TDX_OK;
  })
}

int tdx_tensor_grad_data_ptr(tdx_tensor var, uint64_t* out) {
  TDX_TRY({
    const auto& g = tdx::tensor(var).grad();
    *out = g.defined() ? reinterpret_cast<uint64_t>(g.data_ptr()) : 0;
    return TDX_OK;
  })
}

} // extern "C"
