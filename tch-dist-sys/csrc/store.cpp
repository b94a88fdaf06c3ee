// Stores: c10d's TCPStore (rendezvous across processes), HashStore (threads in one process), PrefixStore.
#include "common.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <cstring>

extern "C" {

int tdx_store_tcp(const char* host, uint16_t port, int is_server, int64_t num_workers, int wait_workers,
                  int64_t timeout_ms, int multi_tenant, int use_libuv, tdx_store** out) {
  TDX_TRY({
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server != 0;
    if (num_workers > 0) opts.numWorkers = static_cast<size_t>(num_workers);
    opts.waitWorkers = wait_workers != 0;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    opts.multiTenant = multi_tenant != 0;
    opts.useLibUV = use_libuv != 0;
    auto s = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    *out = new tdx_store{s};
    return TDX_OK;
  })
}

int tdx_store_hash(tdx_store** out) {
  TDX_TRY({
    *out = new tdx_store{c10::make_intrusive<c10d::HashStore>()};
    return TDX_OK;
  })
}

int tdx_store_prefix(const char* prefix, const tdx_store* base, tdx_store** out) {
  TDX_TRY({
    *out = new tdx_store{c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base->store)};
    return TDX_OK;
  })
}

int tdx_store_clone_handle(const tdx_store* s, tdx_store** out) {
  TDX_TRY({
    *out = new tdx_store{s->store};
    return TDX_OK;
  })
}

int tdx_store_clone_connection(const tdx_store* s, tdx_store** out) {
  TDX_TRY({
    // c10d's clone: a TCPStore client with a socket (and lock) of its own; a HashStore is itself
    *out = new tdx_store{s->store->clone()};
    return TDX_OK;
  })
}

void tdx_store_free(tdx_store* s) {
  try {
    delete s;
  } catch (...) {
  }
}

int tdx_store_set(const tdx_store* s, const char* key, const uint8_t* data, size_t len) {
  TDX_TRY({
    s->store->set(std::string(key), std::vector<uint8_t>(data, data + len));
    return TDX_OK;
  })
}

int tdx_store_get(const tdx_store* s, const char* key, uint8_t** out, size_t* out_len) {
  TDX_TRY({
    auto v = s->store->get(std::string(key));
    auto* buf = static_cast<uint8_t*>(std::malloc(v.size() ? v.size() : 1));
    if (!buf) return tdx::set_error(TDX_EGENERIC, "out of memory");
    if (!v.empty()) std::memcpy(buf, v.data(), v.size());
    *out = buf;
    *out_len = v.size();
    return TDX_OK;
  })
}

int tdx_store_add(const tdx_store* s, const char* key, int64_t delta, int64_t* out) {
  TDX_TRY({
    *out = s->store->add(std::string(key), delta);
    return TDX_OK;
  })
}

int tdx_store_check(const tdx_store* s, const char* key, int* out) {
  TDX_TRY({
    *out = s->store->check({std::string(key)}) ? 1 : 0;
    return TDX_OK;
  })
}

int tdx_store_delete(const tdx_store* s, const char* key, int* out) {
  TDX_TRY({
    *out = s->store->deleteKey(std::string(key)) ? 1 : 0;
    return TDX_OK;
  })
}

int tdx_store_wait(const tdx_store* s, const char* key, int64_t timeout_ms) {
  TDX_TRY({
    s->store->wait({std::string(key)}, std::chrono::milliseconds(timeout_ms));
    return TDX_OK;
  })
}

int tdx_store_set_timeout(const tdx_store* s, int64_t timeout_ms) {
  TDX_TRY({
    s->store->setTimeout(std::chrono::milliseconds(timeout_ms));
    return TDX_OK;
  })
}

int tdx_store_tcp_port(const tdx_store* s, uint16_t* out) {
  TDX_TRY({
    auto* tcp = dynamic_cast<c10d::TCPStore*>(s->store.get());
    if (!tcp) return tdx::set_error(TDX_EINVALID, "store is not a TCPStore");
    *out = tcp->getPort();
    return TDX_OK;
  })
}

void tdx_buf_free(uint8_t* p) { std::free(p); }

} // extern "C"
