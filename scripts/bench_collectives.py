"""PyTorch twin of examples/bench_collectives.rs: same operation (BENCH_OP), sizes, iteration rule and output."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyutil import exit_now  # noqa: E402
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", init_method="env://")
    sizes = [int(s) for s in os.environ["BENCH_SIZES"].split(",")]
    budget = float(os.environ.get("BENCH_SECONDS", "0.5"))
    op = os.environ.get("BENCH_OP", "allreduce")
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        out = torch.zeros_like(t)
        run = {"allreduce": lambda: dist.all_reduce(t), "all_to_all": lambda: dist.all_to_all_single(out, t)}[op]
        for _ in range(3):
            run()
        start = time.perf_counter()
        run()
        iters = torch.tensor([min(max(int(budget / max(time.perf_counter() - start, 1e-6)), 5), 2000)])
        dist.broadcast(iters, 0)
        n = int(iters.item())
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            run()
        per_op = (time.perf_counter() - start) / n
        if dist.get_rank() == 0:
            print(f"{nbytes} {per_op:.9f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()



if __name__ == "__main__":
    main()
    exit_now()
