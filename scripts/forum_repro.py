"""PyTorch twin of examples/forum_repro.rs: the forum question "my model takes twice the memory under
DDP", measured on each rank at each step of the forum's program, for gradient_as_bucket_view off or on.

One rank per process, started with torchrun's environment (scripts/demo.sh starts them). On CPU the
ruler is tch-dist's counting allocator (scripts/memory_ruler.py), the same code the Rust twin uses; on
CUDA it is torch.cuda.memory_allocated, as in the forum.
Usage: forum_repro.py [--view on|off] [--device cpu|cuda]
Prints lines: `rank <r> <stage> <bytes>`.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyutil import exit_now  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--view", choices=["on", "off"], default="off")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", 0)  # both ranks share one GPU, as Gloo allows
        mem = lambda: torch.cuda.memory_allocated(device)  # noqa: E731
    else:
        import memory_ruler

        memory_ruler.install()
        device = torch.device("cpu")
        mem = memory_ruler.allocated

    def settled():
        # Gloo's worker threads drop their references to a finished collective's buffers a moment
        # after wait() returns (on a loaded machine, milliseconds later); read once the number has
        # not moved for 50 ms (the Rust twin does the same), giving up after 2 s.
        last, still = mem(), 0
        for _ in range(1000):
            time.sleep(0.002)
            now = mem()
            still = still + 1 if now == last else 0
            last = now
            if still == 25:
                break
        return last

    torch.manual_seed(0)
    report = lambda stage: print(f"rank {rank} {stage} {settled()}", flush=True)  # noqa: E731
    report("start")
    model = torch.nn.Linear(1000, 1000)
    report("model created")
    model.to(device)
    report("model on device")
    dist.init_process_group("gloo")
    model = DDP(
        model,
        device_ids=[device] if args.device == "cuda" else None,
        find_unused_parameters=False,
        gradient_as_bucket_view=args.view == "on",
    )
    report("wrapped in DDP")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(20, 1000, generator=g).to(device)
    model(x).sum().backward()
    del x
    report("after one backward")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt.step()
    opt.zero_grad()
    report("after step and zero_grad")
    dist.barrier()
    # leave here, with the model alive: see pyutil.exit_now
    exit_now()



if __name__ == "__main__":
    main()
    exit_now()
