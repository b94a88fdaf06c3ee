"""PyTorch twin of examples/bench_checkpoint.rs: the same model and AdamW state saved and loaded with
torch.distributed.checkpoint (dcp.save, dcp.async_save, dcp.load; get_state_dict / set_state_dict, as
its documentation does it; async saves on a Gloo group of their own, as recommended).
Usage: bench_checkpoint.py --mode ddp|fsdp2 --dir DIR --reps N
Rank 0 prints `save_s stall_s async_total_s load_s bytes_on_disk` (medians, the slowest rank's)."""
import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyutil import bench_mlp, exit_now  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

WIDTH, LAYERS, BATCH = 1024, 24, 16


def slowest(secs):
    t = torch.tensor([secs], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="ddp", choices=["ddp", "fsdp2"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = bench_mlp(WIDTH, LAYERS)
    if a.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    else:
        model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1000 + rank)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    async_pg = dist.new_group(backend="gloo")

    def state():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    root = os.path.join(a.dir, "torch")
    save, stall, total, load, size = [], [], [], [], 0
    for rep in range(a.reps):
        step = 10 * (rep + 1)
        path = os.path.join(root, f"step-{step}")
        dist.barrier()
        t = time.perf_counter()
        dcp.save(state(), checkpoint_id=path)
        save.append(slowest(time.perf_counter() - t))

        dist.barrier()
        t = time.perf_counter()
        fut = dcp.async_save(state(), checkpoint_id=os.path.join(root, f"step-{step + 1}"), process_group=async_pg)
        s = time.perf_counter() - t
        fut.result()
        whole = time.perf_counter() - t
        stall.append(slowest(s))
        total.append(slowest(whole))

        dist.barrier()
        t = time.perf_counter()
        sd = state()
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        load.append(slowest(time.perf_counter() - t))

        dist.barrier()
        if rank == 0:
            size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()

    def med(v):
        return sorted(v)[len(v) // 2]

    if rank == 0:
        print(f"{med(save):.4f} {med(stall):.4f} {med(total):.4f} {med(load):.4f} {size}", flush=True)
    dist.barrier()
    exit_now()


if __name__ == "__main__":
    main()
    exit_now()
