"""PyTorch's side of scripts/bench-tp.sh: the same Megatron MLP (Linear(1024, 8192), GELU,
Linear(8192, 1024)) with DTensor tensor parallelism (`parallelize_module`, ColwiseParallel on the first
Linear, RowwiseParallel on the second) over Gloo, batch 64, SGD, one thread per rank, measured with
tch-dist's counting allocator (memory_ruler). Rank 0 prints the same line as examples/bench_tp.rs:
`tp <size> param_bytes <per-rank bytes of parameters> step <median seconds> peak <peak bytes>`."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyutil import exit_now  # noqa: E402
import memory_ruler  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

D, H = 1024, 8192


def main():
    torch.set_num_threads(1)
    memory_ruler.install()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
    mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    param_bytes = sum(p.to_local().numel() * p.element_size() for p in mlp.parameters())
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    times = []
    for step in range(10):
        torch.manual_seed(100 + step)
        x = torch.randn(64, D)
        y = torch.randn(64, D)
        dist.barrier()
        t = time.perf_counter()
        torch.nn.functional.mse_loss(mlp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step >= 2:
            times.append(time.perf_counter() - t)
    times.sort()
    if rank == 0:
        print(f"tp {world} param_bytes {param_bytes} step {times[len(times) // 2]:.6f} peak {memory_ruler.peak()}", flush=True)
    dist.barrier()
    exit_now()  # with the model alive: see pyutil.exit_now


if __name__ == "__main__":
    main()
