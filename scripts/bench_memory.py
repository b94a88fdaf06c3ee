"""PyTorch twin of examples/bench_memory.rs: same model, batch, steps and output, measured with tch-dist's
counting allocator (scripts/memory_ruler.py).
Usage: bench_memory.py --mode default|views|zero|zero_views|fsdp2|fsdp2_keep [--fused]
  default     DDP as constructed by default, AdamW, opt.zero_grad()
  views       DDP(gradient_as_bucket_view=True)
  zero        DDP + ZeroRedundancyOptimizer(AdamW)
  zero_views  both
  fsdp2       FSDP2: fully_shard(each Linear), then fully_shard(model); AdamW over the DTensor shards
  fsdp2_keep  the same with reshard_after_forward=False
  --fused     AdamW(fused=True)
  --hsdp R    fsdp2 modes as HSDP: fully_shard over a mesh (replicate R, shard world / R)
Rank 0 prints `median_step_s peak_rank0 peak_rank1`; with BENCH_LINK=1 also `link BYTES` (bytes sent between
nodes of scripts/shaped-links.sh per timed step, as examples/bench_memory.rs counts them)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyutil import bench_mlp, exit_now  # noqa: E402
import memory_ruler  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

WIDTH, LAYERS, BATCH, WARMUP, STEPS = 1024, 24, 16, 2, 5


def link_bytes():
    """Bytes this node has sent to the others (the to<K> links of a scripts/shaped-links.sh node)."""
    total = 0
    for name in os.listdir("/sys/class/net"):
        if name.startswith("to"):
            with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
                total += int(f.read())
    return total


def main():
    mode = sys.argv[sys.argv.index("--mode") + 1]
    assert mode in ("default", "views", "zero", "zero_views", "fsdp2", "fsdp2_keep"), mode
    torch.set_num_threads(1)
    memory_ruler.install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = bench_mlp(WIDTH, LAYERS)
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        keep = mode == "fsdp2_keep"
        kw = {}
        if "--hsdp" in sys.argv:
            from torch.distributed.device_mesh import init_device_mesh

            r = int(sys.argv[sys.argv.index("--hsdp") + 1])
            world = dist.get_world_size()
            kw["mesh"] = init_device_mesh("cpu", (r, world // r), mesh_dim_names=("replicate", "shard"))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, reshard_after_forward=not keep, **kw)
        model = fully_shard(net, reshard_after_forward=not keep, **kw)
    else:
        model = DDP(net, gradient_as_bucket_view=mode.endswith("views"))
    if mode.startswith("zero"):
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True if "--fused" in sys.argv else None)
    times = []
    link = 0
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            dist.barrier()
            link = link_bytes()
        torch.manual_seed(1000 + step * 10 + rank)
        x = torch.randn(BATCH, WIDTH)
        y = torch.randn(BATCH, WIDTH)
        dist.barrier()
        start = time.perf_counter()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    dist.barrier()
    if os.environ.get("BENCH_LINK"):
        mine = (link_bytes() - link) // STEPS if os.environ.get("LOCAL_RANK", "0") == "0" else 0
        sums = torch.tensor([mine])
        dist.all_reduce(sums)
        if rank == 0:
            print(f"link {int(sums.item())}", flush=True)
    times.sort()
    peak = memory_ruler.peak()
    peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([peak]))
    if rank == 0:
        print(f"{times[len(times) // 2]:.6f} " + " ".join(str(int(p.item())) for p in peaks), flush=True)
    dist.barrier()
    # leave here, with the model alive: see pyutil.exit_now
    exit_now()


if __name__ == "__main__":
    main()
    exit_now()
