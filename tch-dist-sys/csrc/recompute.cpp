// Activation checkpointing: a block's forward runs without keeping its activations; its backward runs
// the forward again (same random numbers, same autocast state) with grad on, then back through it.
//
// The node's next edges are the inputs' and the block's parameters', so parameter gradients reach their
// accumulators from the outer backward: hooks on them (DDP's, ZeRO's, FSDP's) fire in the backward the
// user started, not in a nested one whose end would finalise them too early (the trap of PyTorch's
// reentrant checkpoint under DDP). The parameters are given, or found once by a forward with grad.
#include "common.h"
#include "lambda_node.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <mutex>
#include <unordered_set>

namespace {
using tdx::variable_list;

// The default generators the block may draw from: the CPU's and each CUDA device of the inputs.
struct RngState {
  std::vector<std::pair<at::Generator, at::Tensor>> states;
  static RngState capture(const variable_list& ins) {
    RngState r;
    std::vector<c10::Device> devices{c10::Device(at::kCPU)};
    for (const auto& x : ins)
      if (x.defined() && x.is_cuda() && std::find(devices.begin(), devices.end(), x.device()) == devices.end())
        devices.push_back(x.device());
    for (auto d : devices) {
      auto gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      r.states.emplace_back(gen, gen.get_state());
    }
    return r;
  }
  void restore() const {
    for (const auto& [gen, state] : states) {
      auto g = gen;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }
};

// Runs a scope under another RNG state, then puts the previous one back (also when the body throws).
struct RngScope {
  RngState previous;
  RngScope(const RngState& use, const variable_list& ins) : previous(RngState::capture(ins)) { use.restore(); }
  ~RngScope() {
    try {
      previous.restore();
    } catch (...) {
    }
  }
};

struct AutocastState {
  bool cpu, cuda;
  at::ScalarType cpu_dtype, cuda_dtype;
  static AutocastState capture() {
    return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

struct AutocastScope {
  AutocastState previous = AutocastState::capture();
  bool nested;
  explicit AutocastScope(const AutocastState& use) : nested(use.cpu || use.cuda) {
    use.apply();
    if (nested) at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (nested && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    previous.apply();
  }
};

struct Block {
  std::shared_ptr<void> ctx;
  tdx_forward_fn fn;
  at::Tensor run(const variable_list& ins) const {
    std::vector<tdx_tensor> ptrs;
    for (const auto& x : ins) ptrs.push_back(const_cast<at::Tensor*>(&x));
    tdx_tensor out = nullptr;
    char buf[2048];
    buf[0] = 0;
    if (fn(ctx.get(), ptrs.data(), ptrs.size(), &out, buf, sizeof(buf)) != 0) throw std::runtime_error(buf);
    if (!out) throw std::runtime_error("the checkpointed block returned no tensor");
    auto* t = static_cast<at::Tensor*>(out);
    at::Tensor y = std::move(*t);
    delete t;
    return y;
  }
};

// The leaves that require grad reachable backwards from `y`, other than `skip`.
variable_list graph_leaves(const at::Tensor& y, const variable_list& skip) {
  std::unordered_set<const c10::TensorImpl*> skipped;
  for (const auto& s : skip) skipped.insert(s.unsafeGetTensorImpl());
  variable_list leaves;
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  if (auto root = y.grad_fn()) stack.push_back(root.get());
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n)) {
      if (!skipped.count(acc->variable.unsafeGetTensorImpl())) leaves.push_back(acc->variable);
      continue;
    }
    for (const auto& e : n->next_edges())
      if (e.function) stack.push_back(e.function.get());
  }
  return leaves;
}

variable_list detached(const variable_list& ins) {
  variable_list out;
  for (const auto& x : ins) {
    auto d = x.detach();
    d.set_requires_grad(x.requires_grad());
    out.push_back(d);
  }
  return out;
}
} // namespace

extern "C" int tdx_checkpoint(tdx_forward_fn fn, tdx_drop_fn drop, void* ctx, const tdx_tensor* inputs, size_t n_inputs,
                              const tdx_tensor* params, size_t n_params, int discover, tdx_tensor_sink sink,
                              void* sink_ctx, const char* label, tdx_tensor* out) {
  TDX_TRY({
    auto block = std::make_shared<Block>(Block{std::shared_ptr<void>(ctx, drop), fn});
    variable_list ins;
    for (size_t i = 0; i < n_inputs; i++) ins.push_back(tdx::tensor(inputs[i]));
    variable_list ps;
    for (size_t i = 0; i < n_params; i++) ps.push_back(tdx::tensor(params[i]));
    auto rng = RngState::capture(ins);
    auto autocast = AutocastState::capture();
    std::string name = label ? label : "CheckpointBackward";

    if (discover) {
      // One forward with grad, only to see which parameters the block uses; its graph goes at once.
      RngScope same_numbers(rng, ins);
      at::AutoGradMode grad(true);
      auto xs = detached(ins);
      auto y = block->run(xs);
      ps = graph_leaves(y, xs);
      for (const auto& p : ps) sink(sink_ctx, new at::Tensor(p));
    }
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      y = block->run(ins).detach();
    }
    // The values the backward recomputes from; an in-place change after forward would make them wrong.
    std::vector<int64_t> versions;
    for (const auto& x : ins) versions.push_back(x._version());
    auto saved = std::make_shared<variable_list>(ins);
    variable_list edges = ins;
    edges.insert(edges.end(), ps.begin(), ps.end());
    variable_list outs{y};
    auto bwd = [block, saved, versions, ps, rng, autocast, name, n_inputs](variable_list&& grads) -> variable_list {
      variable_list result(n_inputs + ps.size());
      if (!grads[0].defined()) return result;
      for (size_t i = 0; i < saved->size(); i++)
        if ((*saved)[i]._version() != versions[i])
          throw std::runtime_error(name + ": input " + std::to_string(i) +
                                   " was modified in place after the forward; the recomputation would differ");
      auto xs = detached(*saved);
      at::Tensor y2;
      {
        RngScope same_numbers(rng, xs);
        AutocastScope same_casts(autocast);
        at::AutoGradMode grad(true);
        y2 = block->run(xs);
      }
      if (!y2.requires_grad()) return result;
      variable_list known = xs;
      known.insert(known.end(), ps.begin(), ps.end());
      auto extra = graph_leaves(y2, known);
      if (!extra.empty())
        throw std::runtime_error(name + ": the recomputed forward used a parameter of shape " +
                                 c10::str(extra[0].sizes()) +
                                 " that the first forward did not (its gradient would be lost); make the block use the "
                                 "same parameters every time");
      variable_list targets;
      std::vector<size_t> where;
      for (size_t i = 0; i < xs.size(); i++)
        if (xs[i].requires_grad()) targets.push_back(xs[i]), where.push_back(i);
      for (size_t i = 0; i < ps.size(); i++)
        if (ps[i].requires_grad()) targets.push_back(ps[i]), where.push_back(n_inputs + i);
      if (targets.empty()) return result;
      auto gs = torch::autograd::grad({y2}, targets, {grads[0]}, false, false, true);
      for (size_t k = 0; k < gs.size(); k++) result[where[k]] = gs[k];
      return result;
    };
    // After the backward (without retain_graph), the saved inputs go with the graph's other buffers.
    auto release = [saved]() { saved->clear(); };
    tdx::set_backward(edges, outs, name, bwd, release);
    *out = new at::Tensor(outs[0]);
    return TDX_OK;
  })
}
