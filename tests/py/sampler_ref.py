"""PyTorch's DistributedSampler for tests/alone/data.rs: reads one combination per line on stdin,
`n world rank seed epoch drop_last shuffle`, and prints the indices PyTorch yields, space-separated,
one line per combination (an empty line for none)."""
import sys

from torch.utils.data import DistributedSampler


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


for line in sys.stdin:
    n, world, rank, seed, epoch, drop_last, shuffle = map(int, line.split())
    s = DistributedSampler(Sized(n), num_replicas=world, rank=rank, shuffle=bool(shuffle), seed=seed, drop_last=bool(drop_last))
    s.set_epoch(epoch)
    got = list(s)
    assert len(got) == len(s)
    print(" ".join(map(str, got)))
