// C ABI of the tch-dist shim. Every function returns 0 on success or a TDX_E* code; the message of the
// last failure on the calling thread is read with tdx_last_error(). No C++ exception crosses this boundary.
// Tensors are tch's C_tensor, i.e. `at::Tensor*`; handles are opaque and freed by their *_free function.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TDX_OK = 0,
  TDX_EGENERIC = 1,      // any other c10/std exception
  TDX_ETIMEOUT = 2,      // an operation or wait ran past its timeout
  TDX_ENETWORK = 3,      // a peer closed its connection or could not be reached
  TDX_EINVALID = 4,      // bad argument (shape, dtype, rank, ...)
  TDX_EUNAVAILABLE = 5,  // backend or device not available (e.g. no GPU, cuda feature off)
};

typedef struct tdx_store tdx_store;
typedef struct tdx_pg tdx_pg;
typedef struct tdx_work tdx_work;
typedef struct tdx_hook tdx_hook;
typedef struct tdx_weak tdx_weak;
typedef void* tdx_tensor;  // at::Tensor*

const char* tdx_last_error(void);

// ---- stores
int tdx_store_tcp(const char* host, uint16_t port, int is_server, int64_t num_workers, int wait_workers,
                  int64_t timeout_ms, int multi_tenant, int use_libuv, tdx_store** out);
int tdx_store_hash(tdx_store** out);
int tdx_store_prefix(const char* prefix, const tdx_store* base, tdx_store** out);
int tdx_store_clone_handle(const tdx_store* s, tdx_store** out);
// A store on a connection of its own (c10d's Store::clone): its operations never wait behind another's.
int tdx_store_clone_connection(const tdx_store* s, tdx_store** out);
void tdx_store_free(tdx_store* s);
int tdx_store_set(const tdx_store* s, const char* key, const uint8_t* data, size_t len);
// *out is malloc'ed; free with tdx_buf_free.
int tdx_store_get(const tdx_store* s, const char* key, uint8_t** out, size_t* out_len);
int tdx_store_add(const tdx_store* s, const char* key, int64_t delta, int64_t* out);
int tdx_store_check(const tdx_store* s, const char* key, int* out);
int tdx_store_wait(const tdx_store* s, const char* key, int64_t timeout_ms);
// Removes key; *out is 1 when it was there.
int tdx_store_delete(const tdx_store* s, const char* key, int* out);
int tdx_store_set_timeout(const tdx_store* s, int64_t timeout_ms);
int tdx_store_tcp_port(const tdx_store* s, uint16_t* out);
void tdx_buf_free(uint8_t* p);

// ---- process groups
// hostname may be NULL: then the device binds like Python's default (hostname, else loopback).
int tdx_pg_gloo(const tdx_store* s, int rank, int size, int64_t timeout_ms, const char* hostname, int threads,
                tdx_pg** out);
// device: the CUDA device index the NCCL backend binds to (PyTorch's device_id), or -1 to leave it unbound.
// name, desc: c10d's group name and description (may be NULL). split_from (may be NULL) and color >= 0: the
// communicator is split from that NCCL group's (every rank of it calls, in the same order). eager, with a
// device: the communicator is created now rather than at the first collective.
int tdx_pg_nccl(const tdx_store* s, int rank, int size, int64_t timeout_ms, int device, const char* name,
                const char* desc, tdx_pg* split_from, int color, int eager, tdx_pg** out);
// c10d's shutdown: pending work completes, then the backend is destroyed; later calls on the handle fail.
// abort != 0: for a group given up on, the backend is aborted and never destroyed (no wait on a frozen peer).
int tdx_pg_shutdown(tdx_pg* pg, int abort);
// Frees the handle (shutting the group down first if that was not done).
void tdx_pg_free(tdx_pg* pg);
// c10d's NCCL flight recorder as JSON (its entries and pg_config name every group); *out is malloc'ed, free
// with tdx_buf_free. Needs TORCH_NCCL_TRACE_BUFFER_SIZE > 0 before the first NCCL group.
int tdx_nccl_trace_json(uint8_t** out, size_t* len);
int tdx_pg_set_timeout(tdx_pg* pg, int64_t timeout_ms);
int tdx_pg_backend_name(tdx_pg* pg, char* buf, size_t len);

// op: 0 sum, 1 avg, 2 product, 3 min, 4 max (c10d::ReduceOp order)
int tdx_pg_allreduce(tdx_pg* pg, tdx_tensor t, int op, tdx_work** out);
int tdx_pg_broadcast(tdx_pg* pg, tdx_tensor t, int root, tdx_work** out);
int tdx_pg_allgather(tdx_pg* pg, tdx_tensor* outs, size_t n, tdx_tensor in, tdx_work** out);
int tdx_pg_reduce_scatter(tdx_pg* pg, tdx_tensor out_t, tdx_tensor* ins, size_t n, int op, tdx_work** out);
int tdx_pg_send(tdx_pg* pg, tdx_tensor t, int dst, int tag, tdx_work** out);
int tdx_pg_recv(tdx_pg* pg, tdx_tensor t, int src, int tag, tdx_work** out);
int tdx_pg_barrier(tdx_pg* pg, tdx_work** out);
// c10d's _allgather_base / _reduce_scatter_base (torch's all_gather_into_tensor / reduce_scatter_tensor):
// one flat output of size x input, rank r's part at r * input.numel().
int tdx_pg_allgather_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, tdx_work** out);
int tdx_pg_reduce_scatter_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, int op, tdx_work** out);
// c10d's alltoall_base (torch's all_to_all_single): rows of `in` (dim 0) go out in `in_splits[r]`-row
// chunks to rank r, and rank r's chunk lands in `out` at its `out_splits` place. n_out == n_in == 0: equal
// chunks of size(0) / world rows.
int tdx_pg_alltoall_base(tdx_pg* pg, tdx_tensor out_t, tdx_tensor in, const int64_t* out_splits, size_t n_out,
                         const int64_t* in_splits, size_t n_in, tdx_work** out);
// Sends (is_send[i] != 0) and receives posted as one coalesced group (startCoalescing .. endCoalescing,
// torch's batch_isend_irecv): one work for all. For backends that coalesce (NCCL).
int tdx_pg_batch_p2p(tdx_pg* pg, tdx_tensor* ts, const int* peers, const int* is_send, const int* tags, size_t n,
                     tdx_work** out);

// Waits at most timeout_ms (<0: the group's own timeout applies). Errors with TDX_ETIMEOUT when not done.
int tdx_work_wait(tdx_work* w, int64_t timeout_ms);
int tdx_work_is_completed(tdx_work* w, int* out);
// A second handle on the same work (freed on its own with tdx_work_free).
int tdx_work_clone(tdx_work* w, tdx_work** out);
void tdx_work_free(tdx_work* w);

// ---- autograd hooks on AccumulateGrad (fires after a leaf's .grad was accumulated)
typedef void (*tdx_hook_fn)(void* ctx, int64_t index);
int tdx_hook_register(tdx_tensor var, tdx_hook_fn fn, void* ctx, int64_t index, tdx_hook** out);
void tdx_hook_free(tdx_hook* h);  // removes the hook
// Runs fn once when the current backward pass finishes (call it from inside a hook). A non-zero return
// fails that backward with the message fn wrote into err. The shim owns ctx from the call on, and frees it
// with drop (exactly once: after fn ran, when the backward failed before running it, or on error).
typedef int (*tdx_callback_fn)(void* ctx, char* err, size_t errlen);
typedef void (*tdx_drop_fn)(void* ctx);
int tdx_queue_backward_callback(tdx_callback_fn fn, tdx_drop_fn drop, void* ctx);
// Backward from `output` with `grad` as its gradient (torch.autograd.backward(output, grad)).
int tdx_backward_with_grad(tdx_tensor output, tdx_tensor grad);
int tdx_tensor_set_grad(tdx_tensor var, tdx_tensor grad);  // grad NULL: undefine .grad
int tdx_tensor_grad_data_ptr(tdx_tensor var, uint64_t* out);  // 0 when undefined

// amp.cpp: autocast regions. device 0 CPU, 1 CUDA; dtype a c10::ScalarType code.
int tdx_autocast_enter(int device, int enabled, int dtype, int* prev_enabled, int* prev_dtype);
int tdx_autocast_exit(int device, int prev_enabled, int prev_dtype);
// GradScaler's unscale (at::_amp_foreach_non_finite_check_and_unscale_): grads on found_inf's device.
int tdx_amp_unscale(tdx_tensor* grads, size_t n, tdx_tensor found_inf, tdx_tensor inv_scale);

// ---- op_counter.cpp (the `testing` feature): counts the outermost ATen operators the calling thread calls
// (and autograd's threads working for it), by name. on != 0 clears the counts and starts counting on the
// calling thread; 0 stops it (call both on one thread). tdx_op_counts writes "name\tcount\n" lines into buf
// when `needed` (set always, with the terminating NUL) fits in len.
int tdx_op_counter(int on);
int tdx_op_counts(char* buf, size_t len, size_t* needed);

// ---- DDP reference (libtorch's own c10d::compute_bucket_assignment_by_size)
// sizes: numel per tensor; dtypes: c10::ScalarType codes; limits in bytes. out_bucket_of[i] receives the
// bucket index of tensor i, in libtorch's bucket order; *out_buckets the number of buckets.
int tdx_ref_bucket_assignment(const int64_t* numels, const int* dtypes, const int* device_ids, size_t n,
                              const uint64_t* limits, size_t n_limits, int64_t* out_order, int64_t* out_bucket_of,
                              size_t* out_buckets);

// ---- tensor parallelism: Megatron's conjugate operators as autograd ops on group pg.
// op 0 copy_to (identity, allreduce in backward), 1 reduce_from (allreduce, identity in backward),
// 2 gather_from (all_gather on the last dim, own slice in backward), 3 scatter_to (the reverse);
// sequence parallelism, on dim 0: 4 gather_from_sequence (all_gather, reduce-scatter in backward),
// 5 reduce_scatter_to_sequence (the reverse), 6 scatter_to_sequence (own part, all_gather in backward).
// *out receives a new at::Tensor* owned by the caller.
int tdx_tp_op(tdx_pg* pg, int op, tdx_tensor x, tdx_tensor* out);

// ---- all_to_all_op.cpp: alltoall_base as an autograd node: rows of x go to the ranks by in_splits, the
// result has sum(out_splits) rows (empty splits: equal chunks); the backward sends the gradient back by
// the transposed splits. *out receives a new at::Tensor* owned by the caller.
int tdx_all_to_all_op(tdx_pg* pg, tdx_tensor x, const int64_t* out_splits, size_t n_out, const int64_t* in_splits,
                      size_t n_in, tdx_tensor* out);

// ---- sync_bn.cpp: SyncBatchNorm's training forward on group pg, with its backward as an autograd node
// (PyTorch's protocol: all_gather of [mean, invstd, count], then in backward an allreduce of [sum_dy,
// sum_dy_xmu] when x needs a gradient). weight, bias, running_mean and running_var may be null; the running
// statistics are updated in place. *out receives a new at::Tensor* owned by the caller.
int tdx_sync_batch_norm(tdx_pg* pg, tdx_tensor x, tdx_tensor weight, tdx_tensor bias, tdx_tensor running_mean,
                        tdx_tensor running_var, double eps, double momentum, tdx_tensor* out);

// ---- marker.cpp: an identity whose backward first runs fn(ctx) (a non-zero return fails the backward with
// the message fn wrote). The shim owns ctx from the call on and frees it with drop when the node goes, or at
// once when *attached is 0 (grad mode off, or x does not require grad).
int tdx_backward_marker(tdx_tensor x, tdx_callback_fn fn, tdx_drop_fn drop, void* ctx, const char* label,
                        tdx_tensor* out, int* attached);

// ---- recompute.cpp: activation checkpointing. fn(ctx, inputs, n, out, err, errlen) runs the block: it
// reads n borrowed inputs, stores a new at::Tensor* in *out (ownership passes to the shim) and returns 0, or
// writes a message and returns non-zero. The block runs without grad now and again with grad in backward,
// under the random state and autocast state of now. `params`: the leaves whose gradients the block
// produces; with discover != 0 they are found by one extra forward with grad instead, and each is handed
// to sink (a new handle the receiver owns). The shim owns ctx, freed with drop.
typedef int (*tdx_forward_fn)(void* ctx, const tdx_tensor* inputs, size_t n, tdx_tensor* out, char* err,
                              size_t errlen);
typedef void (*tdx_tensor_sink)(void* ctx, tdx_tensor t);
int tdx_checkpoint(tdx_forward_fn fn, tdx_drop_fn drop, void* ctx, const tdx_tensor* inputs, size_t n_inputs,
                   const tdx_tensor* params, size_t n_params, int discover, tdx_tensor_sink sink, void* sink_ctx,
                   const char* label, tdx_tensor* out);

// ---- function.cpp: a custom autograd function. The n_out outputs (computed from the n_in inputs without
// history) get one node; new_outs receives n_out new at::Tensor* (the outputs with that history), owned by
// the caller. Its backward runs fn(ctx, grads, n_out, grad_ins, n_in, err, errlen): it reads the outputs'
// n_out borrowed gradients (zeros where autograd has none), stores in grad_ins[i] a new at::Tensor* for
// input i (ownership passes to the shim) or leaves it null (no gradient), and returns 0, or writes a
// message and returns non-zero. The shim owns ctx from the call on and frees it with drop when the node
// goes, or at once when *attached is 0 (grad mode off, or no input requires grad).
typedef int (*tdx_backward_fn)(void* ctx, const tdx_tensor* grads, size_t n_grads, tdx_tensor* grad_ins, size_t n_ins,
                               char* err, size_t errlen);
int tdx_custom_function(const tdx_tensor* ins, size_t n_in, const tdx_tensor* outs, size_t n_out, tdx_backward_fn fn,
                        tdx_drop_fn drop, void* ctx, const char* label, tdx_tensor* new_outs, int* attached);

// ---- storage.cpp: frees a tensor's storage in place (nbytes 0), or allocates it again (from 0 bytes; the
// contents are undefined). Tensors sharing the storage see the change.
int tdx_storage_resize(tdx_tensor t, int64_t nbytes);
int tdx_storage_nbytes(tdx_tensor t, int64_t* out);
// How many tensors (TensorImpls: views, autograd's saved copies) share t's storage, t included.
int tdx_storage_use_count(tdx_tensor t, int64_t* out);
// Moves src's memory into dst's freed storage (same device); src's storage is left freed.
int tdx_storage_move(tdx_tensor dst, tdx_tensor src);
// An identity of t's storage (its StorageImpl's address; 0 for none), shared by every tensor viewing it.
int tdx_storage_id(tdx_tensor t, int64_t* out);

// ---- identity.cpp: a tensor's identity (its TensorImpl's address, the same for every handle to it) and a
// weak reference to it, which keeps that address from being reused while held.
// out may be NULL (the address only).
int tdx_tensor_identity(tdx_tensor t, int64_t* id, tdx_weak** out);
// 1 once every strong reference to the tensor is gone, else 0.
int tdx_weak_expired(const tdx_weak* w);
void tdx_weak_free(tdx_weak* w);

// ---- optim.cpp: ATen's fused AdamW over n parameters, in place (torch.optim.AdamW(fused=True)); steps[i] is
// parameter i's step count after this step, a float32 scalar tensor.
int tdx_fused_adamw(const tdx_tensor* params, const tdx_tensor* grads, const tdx_tensor* exp_avgs,
                    const tdx_tensor* exp_avg_sqs, const tdx_tensor* steps, size_t n, double lr, double beta1,
                    double beta2, double weight_decay, double eps);
// self + alpha * other as ATen's add(other, alpha), what torch.optim.SGD calls: one kernel, no temporary,
// one rounding where the kernel fuses the multiply-add. In place when out is null, else into a new tensor.
int tdx_add_scaled(tdx_tensor self, tdx_tensor other, double alpha, tdx_tensor* out);
// One parameter's AdamW update, in place, with the floats of torch.optim.AdamW's single-tensor path (its
// ATen calls and scalars; on the CPU in two passes where that gives the same floats: adamw_single.cpp);
// `step` is the parameter's step count after this one. Otherwise contiguous tensors go `chunk` elements at a
// time (0: in one piece), which bounds the temporaries and keeps the passes in cache.
int tdx_adamw_step(tdx_tensor param, tdx_tensor grad, tdx_tensor exp_avg, tdx_tensor exp_avg_sq, double lr,
                   double beta1, double beta2, double weight_decay, double eps, int64_t step, int64_t chunk);
// torch.optim's multi-tensor (foreach) paths over tensors of one device and dtype, in place, call for call:
// AdamW's (`_multi_tensor_adam`, decoupled weight decay; steps[i] is parameter i's step count after this step),
// and SGD's (`_multi_tensor_sgd`; bufs[i] the momentum buffer, null where there is none yet: then a new
// at::Tensor* is written there, for the caller to own, also when the call fails).
int tdx_foreach_adamw(const tdx_tensor* params, const tdx_tensor* grads, const tdx_tensor* exp_avgs,
                      const tdx_tensor* exp_avg_sqs, const int64_t* steps, size_t n, double lr, double beta1,
                      double beta2, double weight_decay, double eps);
int tdx_foreach_sgd(const tdx_tensor* params, const tdx_tensor* grads, tdx_tensor* bufs, size_t n, double lr,
                    double momentum, double dampening, int nesterov, double weight_decay);
// The ord-norm of each of n tensors of one dtype (ATen's _foreach_norm; 16-bit ones in float32), stacked into a
// new 1-D tensor.
int tdx_foreach_norms(const tdx_tensor* ts, size_t n, double ord, tdx_tensor* out);
// Multiplies each of n tensors in place by `factor`, a scalar tensor on their device (_foreach_mul_).
int tdx_foreach_mul_(const tdx_tensor* ts, size_t n, tdx_tensor factor);
// Which variant of the two-pass CPU update matched ATen's floats when first used (>= 0), or -1 where none did
// (or the CPU lacks AVX2 and FMA) and ATen's sequence runs.
int tdx_adamw_two_pass_variant(void);

// ---- tch_optim.cpp: the per-parameter state of a libtorch C++ optimizer (`opt`: a torch::optim::Optimizer*,
// what tch's nn::Optimizer holds). Parameters are numbered across the param groups, in order.
#define TDX_OPTIM_OTHER 0
#define TDX_OPTIM_ADAM 1
#define TDX_OPTIM_ADAMW 2
#define TDX_OPTIM_SGD 3
#define TDX_OPTIM_RMSPROP 4
int tdx_optim_kind(void* opt, int* kind);
// The parameters (at most `cap` of them into outs, new handles); `n`: how many it holds.
int tdx_optim_params(void* opt, tdx_tensor* outs, size_t cap, size_t* n);
// Parameter `index`'s state: `has` 0 where it has none yet; else its step count and up to three tensors
// (new handles, null where unset): Adam and AdamW exp_avg, exp_avg_sq, max_exp_avg_sq; SGD momentum_buffer;
// RMSprop square_avg, momentum_buffer, grad_avg.
int tdx_optim_state_get(void* opt, size_t index, int* has, int64_t* step, tdx_tensor* outs);
// Replaces parameter `index`'s state with `step` and the three tensors as above (null: unset); `has` 0
// removes it. The tensors are held, not copied.
int tdx_optim_state_set(void* opt, size_t index, int has, int64_t step, const tdx_tensor* ins);

// ---- random.cpp: a permutation of 0..n from a CPU generator seeded with `seed` (the global one untouched).
int tdx_randperm(int64_t n, uint64_t seed, tdx_tensor* out);
// Tensors drawn in turn from one CPU generator seeded with `seed` (dtype: a c10::ScalarType code): standard
// normal when `bounds` is NULL, else tensor i uniform in [-bounds[i], bounds[i]); tensor i has ndims[i]
// dimensions, the sizes of all of them concatenated in `sizes`.
int tdx_draw_seq(uint64_t seed, int dtype, size_t count, const int64_t* ndims, const int64_t* sizes,
                 const double* bounds, tdx_tensor* outs);
// The default generators' states (CPU and every CUDA device), and putting them back (which frees them):
// torch.random.fork_rng().
typedef struct tdx_rng_saved tdx_rng_saved;
int tdx_rng_save(tdx_rng_saved** out);
void tdx_rng_restore(tdx_rng_saved* saved);

// ---- memory
int tdx_cpu_counter_install(void);
int tdx_cpu_counter_installed(void);
int64_t tdx_cpu_allocated(void);
int64_t tdx_cpu_peak(void);
void tdx_cpu_reset_peak(void);
int tdx_cuda_memory(int device, int64_t* allocated, int64_t* peak);
int tdx_cuda_reset_peak(int device);
// The caching allocator's peak reserved bytes on `device` (what torch.cuda.max_memory_reserved reports).
int tdx_cuda_peak_reserved(int device, int64_t* out);
// The device's name (cudaDeviceProp::name, "NVIDIA H100 80GB HBM3"), NUL-terminated within len.
int tdx_cuda_device_name(int device, char* buf, size_t len);
int tdx_cuda_device_count(int* out);
// The calling thread's current CUDA device (torch.cuda.current_device); TDX_EUNAVAILABLE without one.
int tdx_cuda_current_device(int* out);
// Makes cuda:device the calling thread's current device (torch.cuda.set_device).
int tdx_cuda_set_device(int device);
// torch.cuda.set_sync_debug_mode: 0 off, 1 warn, 2 error on every host-device sync; *previous gets the
// mode before. TDX_EUNAVAILABLE without the cuda feature.
int tdx_cuda_set_sync_debug_mode(int mode, int* previous);

// ---- stream.cpp: CUDA streams and events (torch.cuda.Stream / Event). A stream is c10::Stream::pack3's
// {id, device index, device type}. Every call fails with a message where CUDA is not linked or present.
typedef struct tdx_event tdx_event;
// A stream from the device's pool (high or low priority), or the calling thread's current one.
int tdx_stream_pool(int device, int high_priority, int64_t out[3]);
int tdx_stream_current(int device, int64_t out[3]);
// Makes `stream` current on its device for the calling thread; *previous gets the one it replaces.
int tdx_stream_exchange(const int64_t stream[3], int64_t previous[3]);
int tdx_event_new(tdx_event** out);
void tdx_event_free(tdx_event* e);
int tdx_event_record(tdx_event* e, const int64_t stream[3]);
// Makes `stream` wait on the GPU for the event's last record (the host does not wait).
int tdx_event_block(const tdx_event* e, const int64_t stream[3]);
int tdx_event_synchronize(const tdx_event* e);
int tdx_event_query(const tdx_event* e, int* done);
// Tensor.record_stream: the caching allocator reuses t's memory only once `stream`'s work queued so far is done.
int tdx_record_stream(tdx_tensor t, const int64_t stream[3]);
// dst.copy_(src, non_blocking=true): between pinned host memory and a GPU, it returns before the copy ends.
int tdx_copy_non_blocking(tdx_tensor dst, tdx_tensor src);
// torch.empty(sizes, dtype=dtype, pin_memory=True)
int tdx_empty_pinned(const int64_t* sizes, size_t ndim, int dtype, tdx_tensor* out);

// ---- layout self-checks for the declaration-only gloo headers (see gloo_decl/README.md)
int tdx_layout_check(char* buf, size_t len);

#ifdef __cplusplus
}
#endif
