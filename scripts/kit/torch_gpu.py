"""PyTorch's side of the GPU kit's benchmarks (the Rust side: examples/gpu_kit.rs), same model, same sizes,
on the same GPU, one rank over NCCL:
  torch_gpu.py bench-ddp [--steps 20]        DDP step time and peak memory_allocated
  torch_gpu.py bench-allreduce [--iters 20]  torch.distributed.all_reduce bandwidth, 1 MiB to 1 GiB
  torch_gpu.py selftest                      imports torch and torch.distributed, says what it found
Prints `BENCH ...` lines as the Rust side does, and a `PASS`/`SKIP` line.
"""
import argparse
import time

WIDTH, DEPTH, BATCH = 4096, 8, 64


def nccl_world_of_one():
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=__import__("torch").device("cuda", 0))
    return dist


def bench_ddp(steps):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = nccl_world_of_one()
    dev = torch.device("cuda", 0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers).to(dev), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH, device=dev)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / steps
    peak = torch.cuda.max_memory_allocated(dev)
    print(f"BENCH ddp step_ms {ms:.3f} peak_bytes {peak}", flush=True)
    print(f"PASS torch-bench-ddp: {ms:.2f} ms/step, peak {peak} B", flush=True)
    dist.destroy_process_group()


def bench_allreduce(iters):
    import torch

    dist = nccl_world_of_one()
    shown = []
    for mib in (1, 4, 16, 64, 256, 1024):
        t = torch.ones(mib * 1024 * 1024 // 4, device="cuda:0")
        for _ in range(3):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, async_op=True).wait()
        torch.cuda.synchronize()
        s = (time.perf_counter() - start) / iters
        gbs = mib * 1024 * 1024 / s / 1e9
        print(f"BENCH allreduce mib {mib} us {s * 1e6:.1f} gb_per_s {gbs:.2f}", flush=True)
        shown.append(f"{mib} MiB {gbs:.1f} GB/s")
    print("PASS torch-bench-allreduce: " + ", ".join(shown), flush=True)
    dist.destroy_process_group()


def selftest():
    import torch
    import torch.distributed as dist

    assert dist.is_available() and dist.is_gloo_available()
    cuda = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
    print(f"PASS python-torch: torch {torch.__version__}, gloo, nccl {dist.is_nccl_available()}, {cuda}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["bench-ddp", "bench-allreduce", "selftest"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if a.what == "selftest":
        return selftest()
    import torch

    if not torch.cuda.is_available():
        print(f"SKIP torch-{a.what}: no CUDA device", flush=True)
        return
    if a.what == "bench-ddp":
        bench_ddp(a.steps)
    else:
        bench_allreduce(a.iters)


if __name__ == "__main__":
    main()
