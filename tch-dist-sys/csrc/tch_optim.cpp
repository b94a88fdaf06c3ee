// The state of tch's own optimizers (nn::Adam, nn::AdamW, nn::Sgd, nn::RmsProp): libtorch's C++ optimizers,
// whose per-parameter state (moments, momentum, step counts) lives in `Optimizer::state()`, keyed by the
// parameter's TensorImpl. Read and written here so that sharded checkpoints hold it.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "common.h"

namespace {
torch::optim::Optimizer* optimizer(void* p) { return static_cast<torch::optim::Optimizer*>(p); }

// The options of the param group holding parameter `index` (numbered across the groups).
torch::optim::OptimizerOptions& options_of(torch::optim::Optimizer* o, size_t index) {
  for (auto& g : o->param_groups()) {
    if (index < g.params().size()) return g.options();
    index -= g.params().size();
  }
  return o->defaults();
}

std::vector<at::Tensor> params(torch::optim::Optimizer* o) {
  std::vector<at::Tensor> out;
  for (auto& g : o->param_groups())
    for (auto& p : g.params()) out.push_back(p);
  return out;
}

int kind_of(torch::optim::Optimizer* o) {
  if (dynamic_cast<torch::optim::Adam*>(o)) return TDX_OPTIM_ADAM;
  if (dynamic_cast<torch::optim::AdamW*>(o)) return TDX_OPTIM_ADAMW;
  if (dynamic_cast<torch::optim::SGD*>(o)) return TDX_OPTIM_SGD;
  if (dynamic_cast<torch::optim::RMSprop*>(o)) return TDX_OPTIM_RMSPROP;
  return TDX_OPTIM_OTHER;
}

int out_of_range(size_t index, size_t n) {
  return tdx::set_error(TDX_EINVALID,
                        "parameter " + std::to_string(index) + " of an optimizer holding " + std::to_string(n));
}

tdx_tensor give(const at::Tensor& t) { return t.defined() ? new at::Tensor(t) : nullptr; }

// Moments (Adam's and AdamW's state alike): step, exp_avg, exp_avg_sq, max_exp_avg_sq.
template <typename S>
void read_adam(torch::optim::OptimizerParamState& st, int64_t* step, tdx_tensor* outs) {
  auto& s = static_cast<S&>(st);
  *step = s.step();
  outs[0] = give(s.exp_avg());
  outs[1] = give(s.exp_avg_sq());
  outs[2] = give(s.max_exp_avg_sq());
}

// A state tensor given, else zeros like the parameter where the step reads it (what libtorch starts a
// state with: an AMSGrad optimizer loading a checkpoint saved without it, say), else none.
at::Tensor given_or_zeros(const tdx_tensor* ins, int i, const at::Tensor& p, bool read) {
  if (ins[i]) return tdx::tensor(ins[i]);
  return read ? at::zeros_like(p, at::MemoryFormat::Preserve) : at::Tensor();
}

template <typename S>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam(int64_t step, const tdx_tensor* ins,
                                                             const at::Tensor& p, bool amsgrad) {
  auto s = std::make_unique<S>();
  s->step(step);
  s->exp_avg(given_or_zeros(ins, 0, p, true));
  s->exp_avg_sq(given_or_zeros(ins, 1, p, true));
  auto max = given_or_zeros(ins, 2, p, amsgrad);
  if (max.defined()) s->max_exp_avg_sq(max);
  return s;
}
} // namespace

extern "C" int tdx_optim_kind(void* opt, int* kind) {
  TDX_TRY({
    *kind = kind_of(optimizer(opt));
    return TDX_OK;
  })
}

extern "C" int tdx_optim_params(void* opt, tdx_tensor* outs, size_t cap, size_t* n) {
  TDX_TRY({
    auto ps = params(optimizer(opt));
    *n = ps.size();
    for (size_t i = 0; i < ps.size() && i < cap; i++) outs[i] = new at::Tensor(ps[i]);
    return TDX_OK;
  })
}

extern "C" int tdx_optim_state_get(void* opt, size_t index, int* has, int64_t* step, tdx_tensor* outs) {
  TDX_TRY({
    auto* o = optimizer(opt);
    auto ps = params(o);
    if (index >= ps.size()) return out_of_range(index, ps.size());
    for (int i = 0; i < 3; i++) outs[i] = nullptr;
    *step = 0;
    auto it = o->state().find(ps[index].unsafeGetTensorImpl());
    *has = it != o->state().end();
    if (!*has) return TDX_OK;
    switch (kind_of(o)) {
      case TDX_OPTIM_ADAM: read_adam<torch::optim::AdamParamState>(*it->second, step, outs); break;
      case TDX_OPTIM_ADAMW: read_adam<torch::optim::AdamWParamState>(*it->second, step, outs); break;
      case TDX_OPTIM_SGD:
        outs[0] = give(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
        break;
      case TDX_OPTIM_RMSPROP: {
        auto& s = static_cast<torch::optim::RMSpropParamState&>(*it->second);
        *step = s.step();
        outs[0] = give(s.square_avg());
        outs[1] = give(s.momentum_buffer());
        outs[2] = give(s.grad_avg());
        break;
      }
      default: return tdx::set_error(TDX_EINVALID, "an optimizer other than Adam, AdamW, SGD and RMSprop");
    }
    return TDX_OK;
  })
}

extern "C" int tdx_optim_state_set(void* opt, size_t index, int has, int64_t step, const tdx_tensor* ins) {
  TDX_TRY({
    auto* o = optimizer(opt);
    auto ps = params(o);
    if (index >= ps.size()) return out_of_range(index, ps.size());
    void* key = ps[index].unsafeGetTensorImpl();
    if (!has) {
      o->state().erase(key);
      return TDX_OK;
    }
    std::unique_ptr<torch::optim::OptimizerParamState> s;
    switch (kind_of(o)) {
      case TDX_OPTIM_ADAM: {
        bool ams = static_cast<torch::optim::AdamOptions&>(options_of(o, index)).amsgrad();
        s = make_adam<torch::optim::AdamParamState>(step, ins, ps[index], ams);
        break;
      }
      case TDX_OPTIM_ADAMW: {
        bool ams = static_cast<torch::optim::AdamWOptions&>(options_of(o, index)).amsgrad();
        s = make_adam<torch::optim::AdamWParamState>(step, ins, ps[index], ams);
        break;
      }
      case TDX_OPTIM_SGD: {
        auto m = std::make_unique<torch::optim::SGDParamState>();
        if (ins[0]) m->momentum_buffer(tdx::tensor(ins[0]));
        s = std::move(m);
        break;
      }
      case TDX_OPTIM_RMSPROP: {
        auto r = std::make_unique<torch::optim::RMSpropParamState>();
        auto& opts = static_cast<torch::optim::RMSpropOptions&>(options_of(o, index));
        r->step(step);
        r->square_avg(given_or_zeros(ins, 0, ps[index], true));
        auto buf = given_or_zeros(ins, 1, ps[index], opts.momentum() > 0);
        auto avg = given_or_zeros(ins, 2, ps[index], opts.centered());
        if (buf.defined()) r->momentum_buffer(buf);
        if (avg.defined()) r->grad_avg(avg);
        s = std::move(r);
        break;
      }
      default: return tdx::set_error(TDX_EINVALID, "an optimizer other than Adam, AdamW, SGD and RMSprop");
    }
    o->state()[key] = std::move(s);
    return TDX_OK;
  })
}
