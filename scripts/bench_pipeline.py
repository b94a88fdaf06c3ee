"""PyTorch twin of a stage process of examples/pipeline.rs, with torch.distributed.pipelining: the same
16 x (Linear(1024, 1024) + tanh), 8 per stage on 2 stage processes over Gloo, the same batch, microbatches
and steps, SGD; ScheduleGPipe or Schedule1F1B.
Usage: bench_pipeline.py --schedule gpipe|1f1b --microbatches M [--steps 8] [--batch 256]
Rank 0 prints `samples_per_s idle peak0 peak1 ...`: samples per second over all steps; the stages' idle
fraction, 1 - process CPU time / wall time, averaged over the stages (each stage has one intra-op thread);
and each stage's peak bytes during the steps (tch-dist's counting allocator, reset once the stage is built,
as examples/pipeline.rs does)."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyutil import exit_now  # noqa: E402
import memory_ruler  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

WIDTH, DEPTH, LR = 1024, 16, 0.05


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(1)
    memory_ruler.install()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per = DEPTH // world
    torch.manual_seed(7 + rank)
    layers = []
    for _ in range(per):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    mod = torch.nn.Sequential(*layers)
    stage = PipelineStage(mod, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    loss_fn = lambda out, y: torch.nn.functional.mse_loss(out, y)  # noqa: E731
    kind = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=a.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    g = torch.Generator().manual_seed(10_000)
    w = torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5
    memory_ruler.reset_peak()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for s in range(a.steps):
        x = torch.randn(a.batch, WIDTH, generator=torch.Generator().manual_seed(s))
        y = torch.sin(x @ w)
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    mine = torch.tensor([1.0 - cpu / wall, float(memory_ruler.peak())], dtype=torch.float64)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        mean_idle = sum(t[0].item() for t in every) / world
        peaks = " ".join(str(int(t[1].item())) for t in every)
        print(f"{a.batch * a.steps / wall:.1f} {mean_idle:.4f} {peaks}", flush=True)
    dist.barrier()
    exit_now()


if __name__ == "__main__":
    main()
    exit_now()
