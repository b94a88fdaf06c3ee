"""A PyTorch DDP rank training with PyTorch's own PowerSGD hook (torch.distributed.algorithms.
ddp_comm_hooks.powerSGD_hook), for tests/ddp/ddp_powersgd.rs: the MLP, data and initial values of
tests/py/ddp_rank.py. The only substitution: the seeds of the random initial Qs come from the splitmix64
sequence tch-dist uses instead of numpy's RandomState (the Qs drawn from a seed are torch's own).
Env: POWERSGD_RANK, STEPS, DDP_CAP_MB; rank 0 writes its final parameters (float32) to DDP_OUT and the
compression counts to DDP_OUT.stats."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from ddp_rank import IN, OUT, PER, LR, batch, init  # noqa: E402
from pyutil import exit_now  # noqa: E402

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

M64 = (1 << 64) - 1


class SplitMix:
    """tch-dist's seed sequence for the initial Qs (src/ddp/powersgd.rs, next_seed)."""

    def __init__(self, seed):
        self.state = seed & M64

    def randint(self, _high):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return (z ^ (z >> 31)) % 1_000_000_000


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, 24), torch.nn.Tanh(), torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, OUT)
    )
    init(model, float(rank))
    ddp = DDP(model, bucket_cap_mb=float(os.environ["DDP_CAP_MB"]))
    state = powerSGD.PowerSGDState(
        process_group=None, matrix_approximation_rank=int(os.environ["POWERSGD_RANK"]), start_powerSGD_iter=2
    )
    state.rng = SplitMix(0)
    ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(int(os.environ["STEPS"])):
        x, y = batch(s, rank, PER)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        np.asarray(flat.numpy(), dtype=np.float32).tofile(os.environ["DDP_OUT"])
        with open(os.environ["DDP_OUT"] + ".stats", "w") as f:
            f.write(f"{state.total_numel_before_compression} {state.total_numel_after_compression}\n")
    dist.barrier()
    print(f"python rank {rank} ok", flush=True)
    # leave here, with the model alive: see pyutil.exit_now
    exit_now()


if __name__ == "__main__":
    main()
    exit_now()
