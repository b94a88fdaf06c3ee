// Process groups (c10d Backends): Gloo always, NCCL with the `cuda` feature; collectives return Work handles.
#include "common.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef TDX_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstring>

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

int tdx_pg_nccl(const tdx_store* s, int rank, int size, int64_t timeout_ms, int device, tdx_pg** out) {
#ifdef TDX_CUDA
  TDX_TRY({
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = ms(timeout_ms);
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(s->store, rank, size, opts);
    // The barrier's device, and the one NCCL's communicator is created for (PyTorch's device_id).
    if (device >= 0) pg->setBoundDeviceId(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
    pg->setSequenceNumberForGroup();
    *out = new tdx_pg{pg};
    return TDX_OK;
  })
#else
  (void)s; (void)rank; (void)size; (void)timeout_ms; (void)device; (void)out;
  return tdx::set_error(TDX_EUNAVAILABLE, "NCCL is not built: enable the `cuda` feature of tch-dist");
#endif
}

void tdx_pg_free(tdx_pg* pg) {
  try {
    delete pg;
  } catch (...) {
  }
}

int tdx_pg_set_timeout(tdx_pg* pg, int64_t timeout_ms) {
  TDX_TRY({
    pg->backend->setTimeout(ms(timeout_ms));
    return TDX_OK;
  })
}

int tdx_pg_backend_name(const tdx_pg* pg, char* buf, size_t len) {
  TDX_TRY({
    auto name = pg->backend->getBackendName();
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
    return finish(pg->backend->allreduce(v, o), out);
  })
}

int tdx_pg_broadcast(tdx_pg* pg, tdx_tensor t, int root, tdx_work** out) {
  TDX_TRY({
    std::vector<at::Tensor> v{tdx::tensor(t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return finish(pg->backend->broadcast(v, o), out);
  })
}

int tdx_pg_allgather(tdx_pg* pg, tdx_tensor* outs, size_t n, tdx_tensor in, tdx_work** out) {
  TDX_TRY({
    std::vector<std::vector<at::Tensor>> o{list(outs, n)};
    std::vector<at::Tensor> i{tdx::tensor(in)};
    return finish(pg->backend->allgather(o, i), out);
  })
}

int tdx_pg_reduce_scatter(tdx_pg* pg, tdx_tensor out_t, tdx_tensor* ins, size_t n, int op, tdx_work** out) {
  TDX_TRY({
    if (op < 0 || op > 4) return bad_op(op);
    std::vector<at::Tensor> o{tdx::tensor(out_t)};
    std::vector<std::vector<at::Tensor>> i{list(ins, n)};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
    return finish(pg->backend->reduce_scatter(o, i, opts), out);
  })
}

int tdx_pg_send(tdx_pg* pg, tdx_tensor t, int dst, int tag, tdx_work** out) {
  TDX_TRY({
    std::vector<at::Tensor> v{tdx::tensor(t)};
    return finish(pg->backend->send(v, dst, tag), out);
  })
}

int tdx_pg_recv(tdx_pg* pg, tdx_tensor t, int src, int tag, tdx_work** out) {
  TDX_TRY({
    std::vector<at::Tensor> v{tdx::tensor(t)};
    return finish(pg->backend->recv(v, src, tag), out);
  })
}

int tdx_pg_allgather_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, tdx_work** out) {
  TDX_TRY({
    c10d::AllgatherOptions o;
    return finish(pg->backend->_allgather_base(tdx::tensor(out_t), tdx::tensor(in), o), out);
  })
}

int tdx_pg_reduce_scatter_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, int op, tdx_work** out) {
  TDX_TRY({
    if (op < 0 || op > 4) return bad_op(op);
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
    return finish(pg->backend->_reduce_scatter_base(tdx::tensor(out_t), tdx::tensor(in), o), out);
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
    return finish(pg->backend->alltoall_base(o, i, os, is, opts), out);
  })
}

int tdx_pg_batch_p2p(tdx_pg* pg, tdx_tensor* ts, const int* peers, const int* is_send, const int* tags, size_t n,
                     tdx_work** out) {
  TDX_TRY({
    auto& b = *pg->backend;
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
    return finish(pg->backend->barrier(o), out);
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

void tdx_work_free(tdx_work* w) {
  try {
    delete w;
  } catch (...) {
  }
}

} // extern "C"
