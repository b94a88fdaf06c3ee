"""PyTorch's twin of examples/bench_context_parallel.rs (scripts/bench-context-parallel.sh runs both under
tchrun): causal scaled_dot_product_attention's forward and backward on q, k, v of [1, BENCH_HEADS,
BENCH_SEQ, BENCH_DIM], under torch.distributed.tensor.experimental.context_parallel (head-tail load
balancing, BENCH_ROTATE: alltoall, the ring, or allgather) over Gloo; with one rank, on the whole sequence.
Prints the median seconds per step of BENCH_STEPS after 3 warm-up steps (rank 0).

On CPU, PyTorch 2.13's context parallelism does not intercept the CPU flash kernel
(aten._scaled_dot_product_flash_attention_for_cpu), so causal SDPA under it fails ("does not have a
sharding strategy registered"; BENCH_TORCH_PATCH=0 shows it). The registration below (BENCH_TORCH_PATCH=1,
the default) routes that kernel and its backward to context parallelism's own ring code
(_templated_ring_attention and its backward), with every tensor Shard(2) on the sequence: PyTorch's
algorithm, unchanged, on the kernel CPUs have.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def register_cpu_flash():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules as R
    from torch.distributed.tensor.placement_types import Replicate, Shard

    aten = torch.ops.aten
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def ring_fwd(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        return A._templated_ring_attention(mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                           query=query, key=key, value=value, is_causal=is_causal,
                                           dropout_p=dropout_p, scale=scale)

    def ring_bwd(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                 scale=None):
        return A._templated_ring_attention_backward(mesh.get_group(), 2, bwd, grad_out=grad_out,
                                                    grad_out_name="grad_out", query=query, key=key, value=value,
                                                    out=out, logsumexp=logsumexp, is_causal=is_causal,
                                                    dropout_p=dropout_p, scale=scale)

    def handler(op_call, args, kwargs):
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(info)
        f = ring_fwd if op_call is fwd else ring_bwd
        return DTensor._op_dispatcher.wrap(f(info.compute_mesh, *info.local_args, **info.local_kwargs),
                                           info.output_sharding.output_spec)

    def strategy(n, at):
        def s(op_schema):
            mesh = op_schema.get_mesh_from_args()
            return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Replicate()] * n, [Shard(2)] * n],
                                                   input_index=at)
        return s

    register = R.register_cp_sharding_rules

    def register_too():
        first = not R._cp_strategy_contexts
        register()
        if first:
            for op, s, info in ((fwd, strategy(5, 2), RuntimeSchemaInfo(3)), (bwd, strategy(9, 3), None)):
                ctx = R._op_strategy_context(op, s, info)
                R._original_strategies[op] = ctx.__enter__()
                R._cp_strategy_contexts[op] = ctx

    R.register_cp_sharding_rules = register_too
    A.custom_ops[fwd] = handler
    A.custom_ops[bwd] = handler


def main():
    env = lambda n, d: int(os.environ.get(n, d))
    seq, heads, dim, steps = env("BENCH_SEQ", 2048), env("BENCH_HEADS", 8), env("BENCH_DIM", 64), env("BENCH_STEPS", 10)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=g) for _ in range(3))
    times = []

    def step():
        for t in (q, k, v):
            t.requires_grad_(True)
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        finally:  # context_parallel's exit resizes its buffers, which refuses tensors that require grad
            for t in (q, k, v):
                t.requires_grad_(False)
                t.grad = None

    def timed():
        for i in range(steps + 3):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if i >= 3:
                times.append(time.perf_counter() - start)

    if world == 1:
        timed()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

        if os.environ.get("BENCH_TORCH_PATCH", "1") == "1":
            register_cpu_flash()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        set_rotate_method(os.environ.get("BENCH_ROTATE", "alltoall"))
        _cp_options.enable_load_balance = True
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            timed()
    if rank == 0:
        print(f"{statistics.median(times):.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
