"""A PyTorch DDP rank training the same MLP on the same data as tests/common/model.rs, for the mixed
PyTorch/tch-dist DDP test (tests/interop/ddp_interop.rs). Writes its final parameters (float32, in parameter
order) to the file named by DDP_OUT."""
import os
import sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from pyutil import exit_now  # noqa: E402

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

IN, OUT, PER, STEPS, LR = 12, 4, 5, 5, 0.1


def init(model, shift):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            n = p.numel()
            v = torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + i * 1.3) * 0.3 + shift
            p.copy_(v.view(p.shape))


def batch(step, rank, per):
    base = float(step * 1000 + rank * per)
    rows = torch.arange(per, dtype=torch.float32).unsqueeze(1) + base
    cols = torch.arange(IN, dtype=torch.float32).unsqueeze(0)
    x = torch.sin(rows * 0.13 + cols * 0.71)
    ycols = torch.arange(OUT, dtype=torch.float32).unsqueeze(0)
    y = torch.cos(rows * 0.05 - ycols * 0.3)
    return x, y


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, 24), torch.nn.Tanh(), torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, OUT)
    )
    init(model, float(rank))
    frozen = os.environ.get("DDP_FROZEN", "")
    if frozen:
        model[{"l1": 0, "l2": 2, "l3": 4}[frozen]].requires_grad_(False)
    find_unused = os.environ.get("DDP_FIND_UNUSED") == "1"
    ddp = DDP(model, bucket_cap_mb=float(os.environ.get("DDP_CAP_MB", "25")), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # uneven inputs (tests/ddp/ddp_join.rs): DDP_STEPS="5,3" gives rank 0 five batches and rank 1 three, under
    # torch.distributed.algorithms.Join
    steps = [int(n) for n in os.environ["DDP_STEPS"].split(",")][rank] if "DDP_STEPS" in os.environ else STEPS
    join = None
    if "DDP_STEPS" in os.environ:
        from torch.distributed.algorithms import Join

        join = Join([ddp], divide_by_initial_world_size=os.environ.get("DDP_DIVIDE_BY_WORLD", "1") == "1")
        join.__enter__()
    for s in range(steps):
        x, y = batch(s, rank, PER)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if join is not None:
        join.__exit__(None, None, None)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    np.asarray(flat.numpy(), dtype=np.float32).tofile(os.environ["DDP_OUT"].replace("RANK", str(rank)))
    dist.barrier()
    print(f"python rank {rank} ok", flush=True)
    # leave here, with the model alive: see pyutil.exit_now
    exit_now()



if __name__ == "__main__":
    main()
    exit_now()
