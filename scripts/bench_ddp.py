"""PyTorch twin of examples/bench_ddp.rs: same model, batch, steps and output. Memory is measured with
tch-dist's counting allocator (scripts/memory_ruler.py), the ruler the Rust side uses.
Usage: bench_ddp.py [--view on|off] [--no-ddp] [--powersgd RANK] [--bucket-mb MB] [--hook fp16|bf16]
On a node of scripts/shaped-links.sh, GLOO_SOCKET_IFNAME=lo binds the node's address."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyutil import exit_now  # noqa: E402
import memory_ruler  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

DIMS = [1024, 4096, 4096, 1024]
BATCH, WARMUP, STEPS = 32, 2, 8


def main():
    def arg(name):
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None

    view = arg("--view") == "on"
    no_ddp = "--no-ddp" in sys.argv
    powersgd = arg("--powersgd")
    bucket_mb = arg("--bucket-mb")
    hook = arg("--hook")
    torch.set_num_threads(1)
    memory_ruler.install()
    dist.init_process_group("gloo")
    pg = dist.group.WORLD
    rank = pg.rank()
    torch.manual_seed(0)
    layers = []
    for i in range(len(DIMS) - 1):
        layers.append(torch.nn.Linear(DIMS[i], DIMS[i + 1]))
        if i + 2 < len(DIMS):
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    kwargs = {"bucket_cap_mb": float(bucket_mb)} if bucket_mb else {}
    model = net if no_ddp else DDP(net, gradient_as_bucket_view=view, process_group=pg, **kwargs)
    state = None
    if powersgd:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

        state = powerSGD.PowerSGDState(pg, matrix_approximation_rank=int(powersgd), start_powerSGD_iter=WARMUP)
        model.register_comm_hook(state, powerSGD.powerSGD_hook)
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(pg, {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[hook])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    times = []
    for step in range(WARMUP + STEPS):
        torch.manual_seed(1000 + step * 10 + rank)
        x = torch.randn(BATCH, DIMS[0])
        y = torch.randn(BATCH, DIMS[-1])
        pg.barrier().wait()
        start = time.perf_counter()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    times.sort()
    if rank == 0:
        ratio = ""
        if state is not None:
            ratio = f" {state.total_numel_before_compression / state.total_numel_after_compression:.2f}"
        print(f"{times[len(times) // 2]:.6f} {memory_ruler.peak()}{ratio}", flush=True)
    pg.barrier().wait()
    # leave here, with the model alive: see pyutil.exit_now
    exit_now()



if __name__ == "__main__":
    main()
    exit_now()
