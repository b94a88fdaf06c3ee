// Process groups (c10d Backends): Gloo always, NCCL with the `cuda` feature; collectives return Work handles.
#include "common.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef TDX_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <cstring>

namespace tdx {
c10::intrusive_ptr<c10d::Backend> backend(tdx_pg* pg) {
  std::lock_guard<std::mutex> g(pg->mu);
  if (!pg->backend) {
    throw std::invalid_argument(
        "the process group was shut down (destroy_process_group, or the process is exiting)");
  }
  return pg->backend;
}
} // namespace tdx

namespace {
std::chrono::milliseconds ms(int64_t v) { return std::chrono::milliseconds(v); }

int bad_op(int op) {
  return tdx::set_error(TDX_EINVALID, "unknown reduce op code " + std::to_string(op));
}

int finish(c10::intrusive_ptr<c10d::Work> w, tdx_work** out) {
  *out = new tdx_work{std::move(w)};
  return TDX_OK;
}

std::vector<at::Tensor> list(tdx_tensor* ts, size_t n) {
  std::vector<at::Tensor> v;
  v.reserve(n);
  for (size_t i = 0; i < n; i++) v.push_back(tdx::tensor(ts[i]));
  return v;
}
} // namespace

extern "C" {

int tdx_pg_gloo(const tdx_store* s, int rank, int size, int64_t timeout_ms, const char* hostname, int threads,
                tdx_pg** out) {
  TDX_TRY({
    auto opts = c10d::ProcessGroupGloo::Options::create(ms(timeout_ms));
    if (hostname && *hostname) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(std::string(hostname)));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    // Python uses 2 threads per device; keep that unless asked.
    opts->threads = threads > 0 ? threads : static_cast<int>(2 * opts->devices.size());
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(s->store, rank, size, opts);
    // Python calls this right after construction; a Python peer waits for it in the store.
    pg->setSequenceNumberForGroup();
    *out = new tdx_pg{pg};
    return TDX_OK;
  })
}

int tdx_pg_nccl(const tdx_store* s, int rank, int size, int64_t timeout_ms, int device, const char* name,
                const char* desc, tdx_pg* split_from, int color, int eager, tdx_pg** out) {
#ifdef TDX_CUDA
  TDX_TRY({
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = ms(timeout_ms);
    // c10d's group name and description: in NCCL's logs and the flight recorder's dumps
    if (name) opts->group_name = name;
    if (desc) opts->group_desc = desc;
    if (split_from && color >= 0) {
      // ncclCommSplit from the parent's communicator (c10d's split): every rank of the parent makes this
      // call in the same order, each with the color of its own group
      auto parent = c10::dynamic_intrusive_pointer_cast<c10d::ProcessGroupNCCL>(tdx::backend(split_from));
      if (!parent) throw std::invalid_argument("split_from is not an NCCL group");
      opts->split_from = parent;
      opts->split_color = color;
    }
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(s->store, rank, size, opts);
    if (name) pg->setGroupUid(name);
    if (desc) pg->setGroupDesc(desc);
    pg->setSequenceNumberForGroup();
    if (device >= 0) {
      // The barrier's device, and the one NCCL's communicator is created for (PyTorch's device_id).
      auto d = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
      pg->setBoundDeviceId(d);
      // as init_process_group(device_id=...) and new_group under it: the communicator now, not at the
      // group's first collective (which may land mid-backward, in an order that differs by rank)
      if (eager) pg->eagerConnectSingleDevice(d);
    }
    *out = new tdx_pg{pg};
    return TDX_OK;
  })
#else
  (void)s; (void)rank; (void)size; (void)timeout_ms; (void)device; (void)name; (void)desc; (void)split_from;
  (void)color; (void)eager; (void)out;
  return tdx::set_error(TDX_EUNAVAILABLE, "NCCL is not built: enable the `cuda` feature of tch-dist");
#endif
}

int tdx_pg_shutdown(tdx_pg* pg, int abort) {
  TDX_TRY({
    c10::intrusive_ptr<c10d::Backend> b;
    {
      std::lock_guard<std::mutex> g(pg->mu);
      b = std::move(pg->backend);
    }
    if (!b) return TDX_OK;
    if (abort) {
      // a peer is frozen: NCCL's communicators are aborted (no wait); the backend is never destroyed,
      // since Gloo's destructor would join threads that wait on that peer until the timeout
      b->abort();
      (void)b.release();
      return TDX_OK;
    }
    // c10d's shutdown (what destroy_process_group calls): NCCL waits for its pending work, then destroys
    // its communicators; then the destructor, which for Gloo runs the queued work first. Without it
    // ~ProcessGroupNCCL aborts the communicators with work still queued.
    b->shutdown();
    b.reset();
    return TDX_OK;
  })
}

void tdx_pg_free(tdx_pg* pg) {
  try {
    (void)tdx_pg_shutdown(pg, 0);
    delete pg;
  } catch (...) {
  }
}

int tdx_nccl_trace_json(uint8_t** out, size_t* len) {
#ifdef TDX_CUDA
  TDX_TRY({
    std::string s = c10d::dump_nccl_trace_json(true, false);
    auto* buf = static_cast<uint8_t*>(std::malloc(s.size() > 0 ? s.size() : 1));
    if (!buf) throw std::bad_alloc();
    std::memcpy(buf, s.data(), s.size());
    *out = buf;
    *len = s.size();
    return TDX_OK;
  })
#else
  (void)out; (void)len;
  return tdx::set_error(TDX_EUNAVAILABLE, "NCCL is not built: enable the `cuda` feature of tch-dist");
#endif
}

int tdx_pg_set_timeout(tdx_pg* pg, int64_t timeout_ms) {
  TDX_TRY({
    tdx::backend(pg)->setTimeout(ms(timeout_ms));
    return TDX_OK;
  })
}

int tdx_pg_backend_name(tdx_pg* pg, char* buf, size_t len) {
  TDX_TRY({
    auto name = tdx::backend(pg)->getBackendName();
    if (len == 0) return TDX_OK;
    std::strncpy(buf, name.c_str(), len - 1);
    buf[len - 1] = 0;
    return TDX_OK;
  })
}

int tdx_pg_allreduce(tdx_pg* pg, tdx_tensor t, int op, tdx_work** out) {
  TDX_TRY({
    if (op < 0 || op > 4) return bad_op(op);
    std::vector<at::Tensor> v{tdx::tensor(t)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
    return finish(tdx::backend(pg)->allreduce(v, o), out);
  })
}

int tdx_pg_broadcast(tdx_pg* pg, tdx_tensor t, int root, tdx_work** out) {
  TDX_TRY({
    std::vector<at::Tensor> v{tdx::tensor(t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return finish(tdx::backend(pg)->broadcast(v, o), out);
  })
}

int tdx_pg_allgather(tdx_pg* pg, tdx_tensor* outs, size_t n, tdx_tensor in, tdx_work** out) {
  TDX_TRY({
    std::vector<std::vector<at::Tensor>> o{list(outs, n)};
    std::vector<at::Tensor> i{tdx::tensor(in)};
    return finish(tdx::backend(pg)->allgather(o, i), out);
  })
}

int tdx_pg_reduce_scatter(tdx_pg* pg, tdx_tensor out_t, tdx_tensor* ins, size_t n, int op, tdx_work** out) {
  TDX_TRY({
    if (op < 0 || op > 4) return bad_op(op);
    std::vector<at::Tensor> o{tdx::tensor(out_t)};
    std::vector<std::vector<at::Tensor>> i{list(ins, n)};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
    return finish(tdx::backend(pg)->reduce_scatter(o, i, opts), out);
  })
}

int tdx_pg_send(tdx_pg* pg, tdx_tensor t, int dst, int tag, tdx_work** out) {
  TDX_TRY({
    std::vector<at::Tensor> v{tdx::tensor(t)};
    return finish(tdx::backend(pg)->send(v, dst, tag), out);
  })
}

int tdx_pg_recv(tdx_pg* pg, tdx_tensor t, int src, int tag, tdx_work** out) {
  TDX_TRY({
    std::vector<at::Tensor> v{tdx::tensor(t)};
    return finish(tdx::backend(pg)->recv(v, src, tag), out);
  })
}

int tdx_pg_allgather_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, tdx_work** out) {
  TDX_TRY({
    c10d::AllgatherOptions o;
    return finish(tdx::backend(pg)->_allgather_base(tdx::tensor(out_t), tdx::tensor(in), o), out);
  })
}

int tdx_pg_reduce_scatter_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, int op, tdx_work** out) {
  TDX_TRY({
    if (op < 0 || op > 4) return bad_op(op);
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
    return finish(tdx::backend(pg)->_reduce_scatter_base(tdx::tensor(out_t), tdx::tensor(in), o), out);
  })
}

int tdx_pg_alltoall_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, const int64_t* out_splits, size_t n_out,
                         const int64_t* in_splits, size_t n_in, tdx_work** out) {
  TDX_TRY({
    std::vector<int64_t> os(out_splits, out_splits + n_out);
    std::vector<int64_t> is(in_splits, in_splits + n_in);
    at::Tensor o = tdx::tensor(out_t);
    at::Tensor i = tdx::tensor(in);
    c10d::AllToAllOptions opts;
    return finish(tdx::backend(pg)->alltoall_base(o, i, os, is, opts), out);
  })
}

int tdx_pg_batch_p2p(tdx_pg* pg, tdx_tensor* ts, const int* peers, const int* is_send, const int* tags, size_t n,
                     tdx_work** out) {
  TDX_TRY({
    auto held = tdx::backend(pg);
    auto& b = *held;
    b.startCoalescing();
    try {
      for (size_t i = 0; i < n; i++) {
        std::vector<at::Tensor> v{tdx::tensor(ts[i])};
        if (is_send[i]) {
          b.send(v, peers[i], tags[i]);
        } else {
          b.recv(v, peers[i], tags[i]);
        }
      }
    } catch (...) {
      // close the group the backend opened, then report the first failure
      try {
        b.endCoalescing();
      } catch (...) {
      }
      throw;
    }
    return finish(b.endCoalescing(), out);
  })
}

int tdx_pg_barrier(tdx_pg* pg, tdx_work** out) {
  TDX_TRY({
    c10d::BarrierOptions o;
    return finish(tdx::backend(pg)->barrier(o), out);
  })
}

int tdx_work_wait(tdx_work* w, int64_t timeout_ms) {
  TDX_TRY({
    if (timeout_ms < 0) {
      w->work->wait();
    } else {
      w->work->wait(ms(timeout_ms));
    }
    return TDX_OK;
  })
}

int tdx_work_is_completed(tdx_work* w, int* out) {
  TDX_TRY({
    *out = w->work->isCompleted() ? 1 : 0;
    return TDX_OK;
  })
}

int tdx_work_clone(tdx_work* w, tdx_work** out) {
  TDX_TRY({
    *out = new tdx_work{w->work};
    return TDX_OK;
  })
}

void tdx_work_free(tdx_work* w) {
  try {
    delete w;
  } catch (...) {
  }
}

} // extern "C"
