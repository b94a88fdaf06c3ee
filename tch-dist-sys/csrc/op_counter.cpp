// Counts the outermost ATen operators called on the counting thread (and on autograd's threads working
// for it, which inherit its thread-local callbacks), per name: the dispatcher's top-level calls, as
// torch.profiler shows them (`aten::linear`, not the `aten::addmm` it calls), for launch-count comparisons
// with PyTorch (the `testing` feature).
#include <ATen/record_function.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "common.h"

namespace {
std::mutex mu;
std::map<std::string, int64_t> counts;
// Per thread: only ops that entered while the callback was installed leave through it, so the depth
// stays balanced.
thread_local int depth = 0;
thread_local at::CallbackHandle handle = 0;

// Marks an ATen operator's entry, so that its exit is told from others' (autograd's nodes, c10d's ops).
struct Aten final : at::ObserverContext {};

bool is_aten(const char* name) { return std::strncmp(name, "aten::", 6) == 0; }

// Only ATen operators nest here: one called inside an autograd node's evaluation is still outermost, as
// torch.profiler's tree shows it (an `aten::` event with no `aten::` ancestor).
std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (!is_aten(fn.name())) return nullptr;
  if (depth++ == 0) {
    std::lock_guard<std::mutex> g(mu);
    counts[fn.name()]++;
  }
  return std::make_unique<Aten>();
}

void on_exit(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx != nullptr) depth--;
}
} // namespace

extern "C" int tdx_op_counter(int on) {
  TDX_TRY({
    if (on) {
      {
        std::lock_guard<std::mutex> g(mu);
        counts.clear();
      }
      if (handle == 0) {
        handle = at::addThreadLocalCallback(
            at::RecordFunctionCallback(on_enter, on_exit).scopes({at::RecordScope::FUNCTION}).needsInputs(false));
      }
    } else if (handle != 0) {
      at::removeCallback(handle);
      handle = 0;
    }
    return TDX_OK;
  })
}

extern "C" int tdx_op_counts(char* buf, size_t len, size_t* needed) {
  TDX_TRY({
    std::string out;
    {
      std::lock_guard<std::mutex> g(mu);
      for (const auto& [name, n] : counts) out += name + "\t" + std::to_string(n) + "\n";
    }
    *needed = out.size() + 1;
    if (len >= out.size() + 1) std::memcpy(buf, out.c_str(), out.size() + 1);
    return TDX_OK;
  })
}
