// Counts the ATen operators called at the top level (not those they call in turn), per name: what a
// TorchDispatchMode counts from Python, so that launch counts compare with PyTorch's (the `testing` feature).
#include <ATen/record_function.h>

#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "common.h"

namespace {
std::mutex mu;
std::map<std::string, int64_t> counts;
bool counting = false;
std::optional<at::CallbackHandle> handle;
// Per thread (autograd's engine threads included): a callback stays registered once added, and every op
// that entered leaves, so the depth stays balanced whatever `counting` does meanwhile.
thread_local int depth = 0;

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (depth++ == 0) {
    std::lock_guard<std::mutex> g(mu);
    if (counting) counts[fn.name()]++;
  }
  return nullptr;
}

void on_exit(const at::RecordFunction&, at::ObserverContext*) { depth--; }
} // namespace

extern "C" int tdx_op_counter(int on) {
  TDX_TRY({
    std::lock_guard<std::mutex> g(mu);
    if (on) {
      counts.clear();
      if (!handle) {
        handle = at::addGlobalCallback(
            at::RecordFunctionCallback(on_enter, on_exit).scopes({at::RecordScope::FUNCTION}).needsInputs(false));
      }
    }
    counting = on != 0;
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
