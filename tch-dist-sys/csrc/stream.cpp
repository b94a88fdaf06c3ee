// CUDA streams and events (torch.cuda.Stream, torch.cuda.Event, Tensor.record_stream), through c10's
// device-generic interfaces: libc10_cuda registers the CUDA implementation when it loads, so this file
// needs no CUDA headers and compiles in every build; without CUDA each call is an error, not a crash.
// A stream crosses the C ABI as c10::Stream::pack3's three numbers.
#include "common.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

struct tdx_event {
  c10::Event event;
};

namespace {
c10::Stream unpack(const int64_t s[3]) {
  return c10::Stream::unpack3(s[0], static_cast<c10::DeviceIndex>(s[1]), static_cast<c10::DeviceType>(s[2]));
}

void pack(const c10::Stream& s, int64_t out[3]) {
  auto d = s.pack3();
  out[0] = d.stream_id;
  out[1] = d.device_index;
  out[2] = static_cast<int64_t>(d.device_type);
}

c10::impl::VirtualGuardImpl cuda() { return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA); }

c10::Device device(int index) { return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index)); }
}  // namespace

extern "C" int tdx_stream_pool(int device_index, int high_priority, int64_t out[3]) {
  TDX_TRY({
    pack(cuda().getStreamFromGlobalPool(device(device_index), high_priority != 0), out);
    return TDX_OK;
  })
}

extern "C" int tdx_stream_current(int device_index, int64_t out[3]) {
  TDX_TRY({
    pack(cuda().getStream(device(device_index)), out);
    return TDX_OK;
  })
}

extern "C" int tdx_stream_exchange(const int64_t stream[3], int64_t previous[3]) {
  TDX_TRY({
    auto s = unpack(stream);
    pack(c10::impl::VirtualGuardImpl(s.device_type()).exchangeStream(s), previous);
    return TDX_OK;
  })
}

extern "C" int tdx_event_new(tdx_event** out) {
  TDX_TRY({
    *out = new tdx_event{c10::Event(c10::DeviceType::CUDA)};
    return TDX_OK;
  })
}

extern "C" void tdx_event_free(tdx_event* e) {
  try {
    delete e;
  } catch (...) {
    // destroying a CUDA event does not fail in practice; nothing useful to report from a destructor
  }
}

extern "C" int tdx_event_record(tdx_event* e, const int64_t stream[3]) {
  TDX_TRY({
    e->event.record(unpack(stream));
    return TDX_OK;
  })
}

extern "C" int tdx_event_block(const tdx_event* e, const int64_t stream[3]) {
  TDX_TRY({
    e->event.block(unpack(stream));
    return TDX_OK;
  })
}

extern "C" int tdx_event_synchronize(const tdx_event* e) {
  TDX_TRY({
    e->event.synchronize();
    return TDX_OK;
  })
}

extern "C" int tdx_event_query(const tdx_event* e, int* done) {
  TDX_TRY({
    *done = e->event.query() ? 1 : 0;
    return TDX_OK;
  })
}

extern "C" int tdx_record_stream(tdx_tensor t, const int64_t stream[3]) {
  TDX_TRY({
    tdx::tensor(t).record_stream(unpack(stream));
    return TDX_OK;
  })
}

extern "C" int tdx_copy_non_blocking(tdx_tensor dst, tdx_tensor src) {
  TDX_TRY({
    tdx::tensor(dst).copy_(tdx::tensor(src), /*non_blocking=*/true);
    return TDX_OK;
  })
}

extern "C" int tdx_empty_pinned(const int64_t* sizes, size_t ndim, int dtype, tdx_tensor* out) {
  TDX_TRY({
    auto opts = at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)).pinned_memory(true);
    *out = new at::Tensor(at::empty(at::IntArrayRef(sizes, ndim), opts));
    return TDX_OK;
  })
}
