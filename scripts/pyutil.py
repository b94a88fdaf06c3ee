"""Helpers shared by the Python twins and test ranks."""
import os
import sys


def exit_now(code=0):
    """Leaves without interpreter teardown: PyTorch 2.13 sometimes aborts there, after all the work is done
    ("terminate called without an active exception", about 1 run in 20 on a loaded 2-core machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
