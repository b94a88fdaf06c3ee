// An autograd node whose backward is a C++ function: what the tensor-parallel operators, FSDP's backward
// markers and activation checkpointing build on. Outputs computed without history get the node as their
// grad_fn and the inputs' gradient edges as its next edges.
#pragma once
#include "node_ptr.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <functional>
#include <string>
#include <utility>

namespace tdx {
using torch::autograd::variable_list;

struct LambdaBackward : public torch::autograd::Node {
  std::function<variable_list(variable_list&&)> fn;
  std::function<void()> release;  // frees what fn captured once the graph no longer needs it (may be empty)
  std::string label;
  variable_list apply(variable_list&& grads) override {
    if (!fn) throw std::runtime_error(label + ": backward through this graph a second time (its saved state is freed)");
    return fn(std::move(grads));
  }
  void release_variables() override {
    if (release) {
      release();
      fn = nullptr;
    }
  }
  std::string name() const override { return label; }
};

// Gives `outs` (computed from `ins` without history) one node running `bwd`, which maps the outputs'
// gradients to one gradient per input. A no-op when grad mode is off or no input requires grad.
inline bool set_backward(const variable_list& ins, variable_list& outs, const std::string& label,
                         std::function<variable_list(variable_list&&)> bwd, std::function<void()> release = {}) {
  if (!at::GradMode::is_enabled()) return false;
  bool any = false;
  for (const auto& x : ins) any = any || (x.defined() && x.requires_grad());
  if (!any) return false;
  auto node = make_node<LambdaBackward>();
  node->fn = std::move(bwd);
  node->release = std::move(release);
  node->label = label;
  node->set_next_edges(torch::autograd::collect_next_edges(ins));
  torch::autograd::set_history(outs, NodePtr(node));
  return true;
}

// One input, one output, a gradient map of one tensor.
inline at::Tensor with_backward(const at::Tensor& x, at::Tensor out, const std::string& label,
                                std::function<at::Tensor(const at::Tensor&)> bwd) {
  variable_list outs{std::move(out)};
  set_backward({x}, outs, label, [bwd = std::move(bwd)](variable_list&& g) -> variable_list {
    if (!g[0].defined()) return {at::Tensor()};
    return {bwd(g[0])};
  });
  return outs[0];
}
} // namespace tdx
