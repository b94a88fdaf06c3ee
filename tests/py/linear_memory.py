"""Prints the bytes the tch-dist ruler counts for torch.nn.Linear(1000, 1000) in this PyTorch process."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import memory_ruler  # noqa: E402
import torch  # noqa: E402

memory_ruler.install()
before = memory_ruler.allocated()
model = torch.nn.Linear(1000, 1000)
print(memory_ruler.allocated() - before)
