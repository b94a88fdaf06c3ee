// Checks, against the linked libtorch, the assumptions behind the declaration-only gloo headers.
#include "common.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <malloc.h>

#include <cstdio>
#include <cstring>
#include <memory>

extern "C" int tdx_layout_check(char* buf, size_t len) {
  using PGG = c10d::ProcessGroupGloo;
  auto report = [&](const std::string& s) {
    if (len) {
      std::snprintf(buf, len, "%s", s.c_str());
    }
  };
  TDX_TRY({
    // 1. An Options object made by libtorch (its own sizeof) is as large as ours.
    auto libtorch_made = PGG::Options::create_default(std::chrono::milliseconds(1000));
    size_t usable = malloc_usable_size(static_cast<void*>(libtorch_made.get()));
    if (usable < sizeof(PGG::Options) || usable > sizeof(PGG::Options) + 32) {
      report("Options: libtorch allocated " + std::to_string(usable) + " usable bytes, our headers say " +
             std::to_string(sizeof(PGG::Options)));
      return TDX_EINVALID;
    }
    // 2. libtorch's constructor writes nothing past our sizeof(ProcessGroupGloo).
    const size_t guard = 1024;
    const size_t total = sizeof(PGG) + guard;
    std::unique_ptr<unsigned char[]> raw(new unsigned char[total + 64]);
    auto addr = reinterpret_cast<uintptr_t>(raw.get());
    auto* mem = reinterpret_cast<unsigned char*>((addr + 63) & ~uintptr_t(63));
    std::memset(mem, 0xA5, total);
    auto opts = PGG::Options::create(std::chrono::milliseconds(5000));
    opts->devices.push_back(PGG::createDeviceForHostname("127.0.0.1"));
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto* pg = new (mem) PGG(store, 0, 1, opts);
    size_t dirty = 0;
    for (size_t i = sizeof(PGG); i < total; i++) dirty += mem[i] != 0xA5;
    pg->~PGG();
    if (dirty) {
      report("ProcessGroupGloo: libtorch's constructor wrote " + std::to_string(dirty) +
             " bytes past our sizeof " + std::to_string(sizeof(PGG)));
      return TDX_EINVALID;
    }
    report("sizeof(ProcessGroupGloo)=" + std::to_string(sizeof(PGG)) +
           " sizeof(Options)=" + std::to_string(sizeof(PGG::Options)) +
           " libtorch Options usable=" + std::to_string(usable));
    return TDX_OK;
  })
}
