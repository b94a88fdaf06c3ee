// Shared by the shim's translation units: handle structs and the exception barrier.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/ATen.h>

#include <mutex>
#include <string>

#include "tch_dist.h"

struct tdx_store {
  c10::intrusive_ptr<c10d::Store> store;
};
struct tdx_pg {
  // Null once the group was shut down (tdx_pg_shutdown); read through tdx::backend, under `mu`.
  c10::intrusive_ptr<c10d::Backend> backend;
  std::mutex mu;
};
struct tdx_work {
  c10::intrusive_ptr<c10d::Work> work;
};

namespace tdx {
// Records the message for tdx_last_error() and returns the code to hand back.
int set_error(int code, const std::string& msg);
int classify(const std::string& msg, int fallback);
inline at::Tensor& tensor(tdx_tensor t) { return *static_cast<at::Tensor*>(t); }
// The group's backend for one call (a reference held for its length), or an error once it was shut down.
c10::intrusive_ptr<c10d::Backend> backend(tdx_pg* pg);
} // namespace tdx

// Wraps a body so that no exception escapes through the C ABI. The body returns an int code.
#define TDX_TRY(...)                                                                   \
  try {                                                                                \
    __VA_ARGS__                                                                        \
  } catch (const c10::DistNetworkError& e) {                                           \
    return tdx::set_error(tdx::classify(e.what_without_backtrace(), TDX_ENETWORK),     \
                          e.what_without_backtrace());                                 \
  } catch (const c10::ValueError& e) {                                                 \
    return tdx::set_error(tdx::classify(e.what_without_backtrace(), TDX_EINVALID),     \
                          e.what_without_backtrace());                                 \
  } catch (const c10::TypeError& e) {                                                  \
    return tdx::set_error(TDX_EINVALID, e.what_without_backtrace());                   \
  } catch (const c10::Error& e) {                                                      \
    return tdx::set_error(tdx::classify(e.what_without_backtrace(), TDX_EGENERIC),     \
                          e.what_without_backtrace());                                 \
  } catch (const std::exception& e) {                                                  \
    return tdx::set_error(tdx::classify(e.what(), TDX_EGENERIC), e.what());            \
  } catch (...) {                                                                      \
    return tdx::set_error(TDX_EGENERIC, "unknown C++ exception");                      \
  }
