"""PyTorch's side of scripts/bench-tp.sh: the same Megatron MLP (Linear(1024, 8192), GELU,
Linear(8192, 1024)) with DTensor tensor parallelism (`parallelize_module`, ColwiseParallel on the first
Linear, RowwiseParallel on the second) over Gloo, batch 64, SGD, one thread per rank; or with
`--block attention`, self-attention d=1024, 16 heads, batch 8 x sequence 128 (ColwiseParallel on the
query, key and value projections, RowwiseParallel on the output; heads split), measured with
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

D, H, HEADS, SEQ = 1024, 8192, 16, 128


class Attention(torch.nn.Module):
    """Self-attention with separate projections (as torchtitan's), written for any number of local heads."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        hd = D // HEADS
        q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.wo(ctx.transpose(1, 2).reshape(b, s, -1))


def main():
    torch.set_num_threads(1)
    memory_ruler.install()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    attention = "attention" in sys.argv
    if attention:
        mlp = Attention()
        plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
    else:
        mlp = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    mlp = parallelize_module(mlp, mesh, plan)
    shape = (8, SEQ, D) if attention else (64, D)
    param_bytes = sum(p.to_local().numel() * p.element_size() for p in mlp.parameters())
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    times = []
    for step in range(10):
        torch.manual_seed(100 + step)
        x = torch.randn(*shape)
        y = torch.randn(*shape)
        dist.barrier()
        t = time.perf_counter()
        phases = os.environ.get("BENCH_PHASES") and step == 3
        if phases:
            memory_ruler.reset_peak()
        out = mlp(x)
        if phases:
            print(f"forward: allocated {memory_ruler.allocated()} peak {memory_ruler.peak()}", file=sys.stderr)
        torch.nn.functional.mse_loss(out, y).backward()
        if phases:
            print(f"backward: allocated {memory_ruler.allocated()} peak {memory_ruler.peak()}", file=sys.stderr)
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
