//! Raw bindings to tch-dist's C++ shim (`csrc/`, its one C header `csrc/tch_dist.h`), compiled against the
//! libtorch torch-sys found. Everything here is unsafe; the safe API is the `tch-dist` crate.
#![allow(non_camel_case_types)]
use libc::{c_char, c_int, c_void, size_t};

pub const TDX_OK: c_int = 0;
pub const TDX_EGENERIC: c_int = 1;
pub const TDX_ETIMEOUT: c_int = 2;
pub const TDX_ENETWORK: c_int = 3;
pub const TDX_EINVALID: c_int = 4;
pub const TDX_EUNAVAILABLE: c_int = 5;

/// What `tdx_optim_kind` reports: which of libtorch's C++ optimizers tch built.
pub const TDX_OPTIM_OTHER: c_int = 0;
pub const TDX_OPTIM_ADAM: c_int = 1;
pub const TDX_OPTIM_ADAMW: c_int = 2;
pub const TDX_OPTIM_SGD: c_int = 3;
pub const TDX_OPTIM_RMSPROP: c_int = 4;

#[repr(C)]
pub struct tdx_store {
    _p: [u8; 0],
}
#[repr(C)]
pub struct tdx_pg {
    _p: [u8; 0],
}
#[repr(C)]
pub struct tdx_work {
    _p: [u8; 0],
}
#[repr(C)]
pub struct tdx_hook {
    _p: [u8; 0],
}
#[repr(C)]
pub struct tdx_weak {
    _p: [u8; 0],
}
pub type tdx_tensor = *mut c_void;
#[repr(C)]
pub struct tdx_event {
    _p: [u8; 0],
}
#[repr(C)]
pub struct tdx_rng_saved {
    _p: [u8; 0],
}
pub type tdx_hook_fn = unsafe extern "C" fn(ctx: *mut c_void, index: i64);
pub type tdx_callback_fn = unsafe extern "C" fn(ctx: *mut c_void, err: *mut c_char, errlen: size_t) -> c_int;
pub type tdx_drop_fn = unsafe extern "C" fn(ctx: *mut c_void);
pub type tdx_forward_fn = unsafe extern "C" fn(
    ctx: *mut c_void,
    inputs: *const tdx_tensor,
    n: size_t,
    out: *mut tdx_tensor,
    err: *mut c_char,
    errlen: size_t,
) -> c_int;
pub type tdx_tensor_sink = unsafe extern "C" fn(ctx: *mut c_void, t: tdx_tensor);
pub type tdx_backward_fn = unsafe extern "C" fn(
    ctx: *mut c_void,
    grads: *const tdx_tensor,
    n_grads: size_t,
    grad_ins: *mut tdx_tensor,
    n_ins: size_t,
    err: *mut c_char,
    errlen: size_t,
) -> c_int;

extern "C" {
    pub fn tdx_last_error() -> *const c_char;

    pub fn tdx_store_tcp(
        host: *const c_char,
        port: u16,
        is_server: c_int,
        num_workers: i64,
        wait_workers: c_int,
        timeout_ms: i64,
        multi_tenant: c_int,
        use_libuv: c_int,
        out: *mut *mut tdx_store,
    ) -> c_int;
    pub fn tdx_store_hash(out: *mut *mut tdx_store) -> c_int;
    pub fn tdx_store_prefix(prefix: *const c_char, base: *const tdx_store, out: *mut *mut tdx_store) -> c_int;
    pub fn tdx_store_clone_handle(s: *const tdx_store, out: *mut *mut tdx_store) -> c_int;
    pub fn tdx_store_clone_connection(s: *const tdx_store, out: *mut *mut tdx_store) -> c_int;
    pub fn tdx_store_free(s: *mut tdx_store);
    pub fn tdx_store_set(s: *const tdx_store, key: *const c_char, data: *const u8, len: size_t) -> c_int;
    pub fn tdx_store_get(s: *const tdx_store, key: *const c_char, out: *mut *mut u8, len: *mut size_t) -> c_int;
    pub fn tdx_store_add(s: *const tdx_store, key: *const c_char, delta: i64, out: *mut i64) -> c_int;
    pub fn tdx_store_check(s: *const tdx_store, key: *const c_char, out: *mut c_int) -> c_int;
    pub fn tdx_store_wait(s: *const tdx_store, key: *const c_char, timeout_ms: i64) -> c_int;
    pub fn tdx_store_delete(s: *const tdx_store, key: *const c_char, out: *mut c_int) -> c_int;
    pub fn tdx_store_set_timeout(s: *const tdx_store, timeout_ms: i64) -> c_int;
    pub fn tdx_store_tcp_port(s: *const tdx_store, out: *mut u16) -> c_int;
    pub fn tdx_buf_free(p: *mut u8);

    pub fn tdx_pg_gloo(
        s: *const tdx_store,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        hostname: *const c_char,
        threads: c_int,
        out: *mut *mut tdx_pg,
    ) -> c_int;
    pub fn tdx_pg_nccl(
        s: *const tdx_store,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        device: c_int,
        name: *const c_char,
        desc: *const c_char,
        split_from: *mut tdx_pg,
        color: c_int,
        eager: c_int,
        out: *mut *mut tdx_pg,
    ) -> c_int;
    pub fn tdx_pg_shutdown(pg: *mut tdx_pg, abort: c_int) -> c_int;
    pub fn tdx_nccl_trace_json(out: *mut *mut u8, len: *mut size_t) -> c_int;
    pub fn tdx_pg_free(pg: *mut tdx_pg);
    pub fn tdx_pg_set_timeout(pg: *mut tdx_pg, timeout_ms: i64) -> c_int;
    pub fn tdx_pg_allreduce(pg: *mut tdx_pg, t: tdx_tensor, op: c_int, out: *mut *mut tdx_work) -> c_int;
    pub fn tdx_pg_broadcast(pg: *mut tdx_pg, t: tdx_tensor, root: c_int, out: *mut *mut tdx_work) -> c_int;
    pub fn tdx_pg_allgather(
        pg: *mut tdx_pg,
        outs: *mut tdx_tensor,
        n: size_t,
        input: tdx_tensor,
        out: *mut *mut tdx_work,
    ) -> c_int;
    pub fn tdx_pg_reduce_scatter(
        pg: *mut tdx_pg,
        out_t: tdx_tensor,
        ins: *mut tdx_tensor,
        n: size_t,
        op: c_int,
        out: *mut *mut tdx_work,
    ) -> c_int;
    pub fn tdx_pg_send(pg: *mut tdx_pg, t: tdx_tensor, dst: c_int, tag: c_int, out: *mut *mut tdx_work) -> c_int;
    pub fn tdx_pg_recv(pg: *mut tdx_pg, t: tdx_tensor, src: c_int, tag: c_int, out: *mut *mut tdx_work) -> c_int;
    pub fn tdx_pg_barrier(pg: *mut tdx_pg, out: *mut *mut tdx_work) -> c_int;
    pub fn tdx_pg_allgather_base(
        pg: *mut tdx_pg,
        out_t: tdx_tensor,
        input: tdx_tensor,
        out: *mut *mut tdx_work,
    ) -> c_int;
    pub fn tdx_pg_reduce_scatter_base(
        pg: *mut tdx_pg,
        out_t: tdx_tensor,
        input: tdx_tensor,
        op: c_int,
        out: *mut *mut tdx_work,
    ) -> c_int;
    pub fn tdx_pg_alltoall_base(
        pg: *mut tdx_pg,
        out_t: tdx_tensor,
        input: tdx_tensor,
        out_splits: *const i64,
        n_out: size_t,
        in_splits: *const i64,
        n_in: size_t,
        out: *mut *mut tdx_work,
    ) -> c_int;
    pub fn tdx_pg_batch_p2p(
        pg: *mut tdx_pg,
        ts: *mut tdx_tensor,
        peers: *const c_int,
        is_send: *const c_int,
        tags: *const c_int,
        n: usize,
        out: *mut *mut tdx_work,
    ) -> c_int;

    pub fn tdx_work_wait(w: *mut tdx_work, timeout_ms: i64) -> c_int;
    pub fn tdx_work_is_completed(w: *mut tdx_work, out: *mut c_int) -> c_int;
    pub fn tdx_work_clone(w: *mut tdx_work, out: *mut *mut tdx_work) -> c_int;
    pub fn tdx_work_free(w: *mut tdx_work);

    pub fn tdx_hook_register(
        var: tdx_tensor,
        f: tdx_hook_fn,
        ctx: *mut c_void,
        index: i64,
        out: *mut *mut tdx_hook,
    ) -> c_int;
    pub fn tdx_hook_free(h: *mut tdx_hook);
    pub fn tdx_queue_backward_callback(f: tdx_callback_fn, drop: tdx_drop_fn, ctx: *mut c_void) -> c_int;
    pub fn tdx_backward_with_grad(output: tdx_tensor, grad: tdx_tensor) -> c_int;
    pub fn tdx_tensor_set_grad(var: tdx_tensor, grad: tdx_tensor) -> c_int;
    pub fn tdx_tensor_grad_data_ptr(var: tdx_tensor, out: *mut u64) -> c_int;

    pub fn tdx_autocast_enter(
        device: c_int,
        enabled: c_int,
        dtype: c_int,
        prev_enabled: *mut c_int,
        prev_dtype: *mut c_int,
    ) -> c_int;
    pub fn tdx_autocast_exit(device: c_int, prev_enabled: c_int, prev_dtype: c_int) -> c_int;
    pub fn tdx_amp_unscale(grads: *mut tdx_tensor, n: usize, found_inf: tdx_tensor, inv_scale: tdx_tensor) -> c_int;

    /// Counts the outermost ATen operators the calling thread calls, by name (the `testing` feature).
    #[cfg(feature = "testing")]
    pub fn tdx_op_counter(on: c_int) -> c_int;
    #[cfg(feature = "testing")]
    pub fn tdx_op_counts(buf: *mut c_char, len: size_t, needed: *mut size_t) -> c_int;
    /// libtorch's own bucket assignment, for tests (the `testing` feature).
    #[cfg(feature = "testing")]
    pub fn tdx_ref_bucket_assignment(
        numels: *const i64,
        dtypes: *const c_int,
        device_ids: *const c_int,
        n: size_t,
        limits: *const u64,
        n_limits: size_t,
        out_order: *mut i64,
        out_bucket_of: *mut i64,
        out_buckets: *mut size_t,
    ) -> c_int;

    pub fn tdx_tp_op(pg: *mut tdx_pg, op: c_int, x: tdx_tensor, out: *mut tdx_tensor) -> c_int;

    pub fn tdx_all_to_all_op(
        pg: *mut tdx_pg,
        x: tdx_tensor,
        out_splits: *const i64,
        n_out: size_t,
        in_splits: *const i64,
        n_in: size_t,
        out: *mut tdx_tensor,
    ) -> c_int;

    pub fn tdx_sync_batch_norm(
        pg: *mut tdx_pg,
        x: tdx_tensor,
        weight: tdx_tensor,
        bias: tdx_tensor,
        running_mean: tdx_tensor,
        running_var: tdx_tensor,
        eps: f64,
        momentum: f64,
        out: *mut tdx_tensor,
    ) -> c_int;

    pub fn tdx_backward_marker(
        x: tdx_tensor,
        f: tdx_callback_fn,
        drop: tdx_drop_fn,
        ctx: *mut c_void,
        label: *const c_char,
        out: *mut tdx_tensor,
        attached: *mut c_int,
    ) -> c_int;
    pub fn tdx_checkpoint(
        f: tdx_forward_fn,
        drop: tdx_drop_fn,
        ctx: *mut c_void,
        inputs: *const tdx_tensor,
        n_inputs: size_t,
        params: *const tdx_tensor,
        n_params: size_t,
        discover: c_int,
        sink: tdx_tensor_sink,
        sink_ctx: *mut c_void,
        label: *const c_char,
        out: *mut tdx_tensor,
    ) -> c_int;
    pub fn tdx_custom_function(
        ins: *const tdx_tensor,
        n_in: size_t,
        outs: *const tdx_tensor,
        n_out: size_t,
        f: tdx_backward_fn,
        drop: tdx_drop_fn,
        ctx: *mut c_void,
        label: *const c_char,
        new_outs: *mut tdx_tensor,
        attached: *mut c_int,
    ) -> c_int;
    pub fn tdx_storage_resize(t: tdx_tensor, nbytes: i64) -> c_int;
    pub fn tdx_storage_nbytes(t: tdx_tensor, out: *mut i64) -> c_int;
    pub fn tdx_storage_use_count(t: tdx_tensor, out: *mut i64) -> c_int;
    pub fn tdx_storage_move(dst: tdx_tensor, src: tdx_tensor) -> c_int;
    pub fn tdx_storage_id(t: tdx_tensor, out: *mut i64) -> c_int;
    pub fn tdx_tensor_identity(t: tdx_tensor, id: *mut i64, out: *mut *mut tdx_weak) -> c_int;
    pub fn tdx_weak_expired(w: *const tdx_weak) -> c_int;
    pub fn tdx_weak_free(w: *mut tdx_weak);

    #[allow(clippy::too_many_arguments)]
    pub fn tdx_fused_adamw(
        params: *const tdx_tensor,
        grads: *const tdx_tensor,
        exp_avgs: *const tdx_tensor,
        exp_avg_sqs: *const tdx_tensor,
        steps: *const tdx_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> c_int;

    pub fn tdx_add_scaled(this: tdx_tensor, other: tdx_tensor, alpha: f64, out: *mut tdx_tensor) -> c_int;

    #[allow(clippy::too_many_arguments)]
    pub fn tdx_adamw_step(
        param: tdx_tensor,
        grad: tdx_tensor,
        exp_avg: tdx_tensor,
        exp_avg_sq: tdx_tensor,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        step: i64,
        chunk: i64,
    ) -> c_int;
    pub fn tdx_adamw_two_pass_variant() -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub fn tdx_foreach_adamw(
        params: *const tdx_tensor,
        grads: *const tdx_tensor,
        exp_avgs: *const tdx_tensor,
        exp_avg_sqs: *const tdx_tensor,
        steps: *const i64,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub fn tdx_foreach_sgd(
        params: *const tdx_tensor,
        grads: *const tdx_tensor,
        bufs: *mut tdx_tensor,
        n: usize,
        lr: f64,
        momentum: f64,
        dampening: f64,
        nesterov: c_int,
        weight_decay: f64,
    ) -> c_int;
    pub fn tdx_foreach_norms(ts: *const tdx_tensor, n: usize, ord: f64, out: *mut tdx_tensor) -> c_int;
    pub fn tdx_foreach_mul_(ts: *const tdx_tensor, n: usize, factor: tdx_tensor) -> c_int;

    pub fn tdx_optim_kind(opt: *mut c_void, kind: *mut c_int) -> c_int;
    pub fn tdx_optim_params(opt: *mut c_void, outs: *mut tdx_tensor, cap: size_t, n: *mut size_t) -> c_int;
    pub fn tdx_optim_state_get(
        opt: *mut c_void,
        index: size_t,
        has: *mut c_int,
        step: *mut i64,
        outs: *mut tdx_tensor,
    ) -> c_int;
    pub fn tdx_optim_state_set(opt: *mut c_void, index: size_t, has: c_int, step: i64, ins: *const tdx_tensor)
        -> c_int;

    pub fn tdx_randperm(n: i64, seed: u64, out: *mut tdx_tensor) -> c_int;
    pub fn tdx_draw_seq(
        seed: u64,
        dtype: c_int,
        count: size_t,
        ndims: *const i64,
        sizes: *const i64,
        bounds: *const f64,
        outs: *mut tdx_tensor,
    ) -> c_int;
    pub fn tdx_rng_save(out: *mut *mut tdx_rng_saved) -> c_int;
    pub fn tdx_rng_restore(saved: *mut tdx_rng_saved);

    pub fn tdx_cpu_counter_install() -> c_int;
    pub fn tdx_cpu_counter_installed() -> c_int;
    pub fn tdx_cpu_allocated() -> i64;
    pub fn tdx_cpu_peak() -> i64;
    pub fn tdx_cpu_reset_peak();
    pub fn tdx_cuda_memory(device: c_int, allocated: *mut i64, peak: *mut i64) -> c_int;
    pub fn tdx_cuda_reset_peak(device: c_int) -> c_int;
    pub fn tdx_cuda_peak_reserved(device: c_int, out: *mut i64) -> c_int;
    pub fn tdx_cuda_device_name(device: c_int, buf: *mut c_char, len: size_t) -> c_int;
    pub fn tdx_cuda_device_count(out: *mut c_int) -> c_int;
    pub fn tdx_cuda_current_device(out: *mut c_int) -> c_int;
    pub fn tdx_cuda_set_device(device: c_int) -> c_int;
    pub fn tdx_cuda_set_sync_debug_mode(mode: c_int, previous: *mut c_int) -> c_int;

    /// Our Gloo declarations against libtorch's object layout, for tests (the `testing` feature).
    #[cfg(feature = "testing")]
    pub fn tdx_layout_check(buf: *mut c_char, len: size_t) -> c_int;

    pub fn tdx_stream_pool(device: c_int, high_priority: c_int, out: *mut i64) -> c_int;
    pub fn tdx_stream_current(device: c_int, out: *mut i64) -> c_int;
    pub fn tdx_stream_exchange(stream: *const i64, previous: *mut i64) -> c_int;
    pub fn tdx_event_new(out: *mut *mut tdx_event) -> c_int;
    pub fn tdx_event_free(e: *mut tdx_event);
    pub fn tdx_event_record(e: *mut tdx_event, stream: *const i64) -> c_int;
    pub fn tdx_event_block(e: *const tdx_event, stream: *const i64) -> c_int;
    pub fn tdx_event_synchronize(e: *const tdx_event) -> c_int;
    pub fn tdx_event_query(e: *const tdx_event, done: *mut c_int) -> c_int;
    pub fn tdx_record_stream(t: tdx_tensor, stream: *const i64) -> c_int;
    pub fn tdx_copy_non_blocking(dst: tdx_tensor, src: tdx_tensor) -> c_int;
    pub fn tdx_empty_pinned(sizes: *const i64, ndim: size_t, dtype: c_int, out: *mut tdx_tensor) -> c_int;
}

/// The libtorch directory the shim was built against (tchrun hands it to workers that cannot find
/// libtorch themselves; a binary's rpath, see the build script).
pub const LIBTORCH_LIB: &str = env!("TCH_DIST_LIBTORCH_LIB");

/// `libtch_dist_memory.so`: the shim's CPU memory ruler alone, for Python processes (ctypes).
pub const MEMORY_RULER_LIB: &str = env!("TCH_DIST_MEMORY_LIB");
