// Autograd node handles across libtorch versions: libtorch 2.11 holds nodes in std::shared_ptr<Node>,
// 2.13 in c10::intrusive_ptr<Node>. The type is read off libtorch's own API, so the shim builds
// against either without naming versions.
#pragma once
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace tdx {
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
inline constexpr bool kSharedNodes = std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

// A new node of type T, held the way this libtorch holds nodes.
template <class T>
auto make_node() {
  if constexpr (kSharedNodes) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}
} // namespace tdx
