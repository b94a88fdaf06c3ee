"""Gloo point-to-point latency between two processes, PyTorch's own Gloo: each rank sends to and receives
from the other at once, 400 times per size, and rank 0 prints the mean time per exchange. With a
72-byte header (9 int64s) posted beside the body, as tch-dist's pipeline transport did until it sent
header and body as one message, for the 64 KB body (one microbatch's activation at m = 16 in
scripts/bench-pipeline.sh).
  source scripts/env.sh && ranks 2 $TCH_DIST_PYTHON_BIN scripts/bench_gloo_p2p.py"""
import time

import torch
import torch.distributed as dist

ROUNDS = 400


def exchange(body, header, peer):
    works = []
    if header is not None:
        works += [dist.irecv(torch.empty_like(header), peer), dist.isend(header, peer)]
    works += [dist.irecv(torch.empty_like(body), peer), dist.isend(body, peer)]
    for w in works:
        w.wait()


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    peer = 1 - rank
    header = torch.zeros(9, dtype=torch.int64)
    runs = [(512, None), (16 * 1024, None), (16 * 1024, header), (512 * 1024, None)]
    for floats, h in runs + runs:  # twice, alternating, since this shared machine drifts
        body = torch.ones(floats)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(ROUNDS):
            exchange(body, h, peer)
        dt = (time.perf_counter() - t) / ROUNDS
        if rank == 0:
            what = " + header" if h is not None else ""
            print(f"{floats * 4} bytes{what}: {dt * 1e6:.0f} us per exchange", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
