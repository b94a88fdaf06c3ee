// A custom autograd function (PyTorch's torch.autograd.Function): outputs computed without history get one
// node whose backward is a callback from Rust, mapping the outputs' gradients to the inputs'. Ring
// attention builds on it: its backward runs the ring again, which no composition of ATen ops expresses.
#include "common.h"
#include "lambda_node.h"

extern "C" int tdx_custom_function(const tdx_tensor* ins, size_t n_in, const tdx_tensor* outs, size_t n_out,
                                   tdx_backward_fn fn, tdx_drop_fn drop, void* ctx, const char* label,
                                   tdx_tensor* new_outs, int* attached) {
  TDX_TRY({
    // Owned from here on; freed with the node, or at once when no node is made.
    std::shared_ptr<void> owned(ctx, drop);
    tdx::variable_list inputs, outputs;
    for (size_t i = 0; i < n_in; ++i) inputs.push_back(tdx::tensor(ins[i]));
    // the outputs' shapes and options, for zeros where autograd passes no gradient (not the outputs
    // themselves: the node would hold its own outputs)
    std::vector<std::pair<std::vector<int64_t>, at::TensorOptions>> meta;
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < n_out; ++i) {
        outputs.push_back(tdx::tensor(outs[i]).detach());
        meta.emplace_back(outputs.back().sizes().vec(), outputs.back().options());
      }
    }
    std::string name = label ? label : "CustomFunctionBackward";
    bool made = tdx::set_backward(
        inputs, outputs, name, [fn, owned, meta, n_in](tdx::variable_list&& grads) -> tdx::variable_list {
          std::vector<tdx_tensor> g;
          for (size_t i = 0; i < grads.size(); ++i) {
            if (!grads[i].defined()) grads[i] = at::zeros(meta[i].first, meta[i].second);
            g.push_back(static_cast<tdx_tensor>(&grads[i]));
          }
          std::vector<tdx_tensor> result(n_in, nullptr);
          char buf[2048];
          buf[0] = 0;
          // The Rust side catches its own panics; a failure fails this backward with its message.
          int rc = fn(owned.get(), g.data(), g.size(), result.data(), n_in, buf, sizeof(buf));
          tdx::variable_list out;
          for (auto p : result) {
            // each non-null entry is a new at::Tensor* whose ownership passes here
            std::unique_ptr<at::Tensor> t(static_cast<at::Tensor*>(p));
            out.push_back(t ? *t : at::Tensor());
          }
          if (rc != 0) throw std::runtime_error(buf);
          return out;
        },
        // once the graph is freed (a backward without retain_graph), what the closure saved goes with it,
        // and a second backward through the node is refused
        [] {});
    *attached = made ? 1 : 0;
    for (size_t i = 0; i < n_out; ++i) new_outs[i] = new at::Tensor(outputs[i]);
    return TDX_OK;
  })
}
