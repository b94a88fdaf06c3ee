"""Helpers shared by the Python twins and test ranks."""
import os
import sys


def exit_now(code=0):
    """Leaves without interpreter teardown: PyTorch 2.13 sometimes aborts there, after all the work is done
    ("terminate called without an active exception", about 1 run in 20 on a loaded 2-core machine). Scripts
    holding a DDP model call it from main, before destroy_process_group or the model's release: dropping
    DDP's Reducer frees the ProcessGroupGloo, whose destructor waits for its worker thread while that thread
    waits for the GIL the main thread holds (a deadlock seen on 2026-11-30 in bench_memory.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bench_mlp(width, layers):
    """The benchmarks' model: `layers` Linear(width, width) with ReLU between them (seed 0)."""
    import torch

    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)
