"""A PyTorch rank running torch.nn.SyncBatchNorm under DDP, for the mixed PyTorch/tch-dist test
(tests/interop/sync_batch_norm.rs).

PyTorch's SyncBatchNorm refuses CPU input, and the five kernels its autograd function calls exist for CUDA
only ("Could not run 'aten::batch_norm_stats' ... from the 'CPU' backend"). This rank runs PyTorch's module
and autograd function as they are (its protocol: the all_gather it picks for Gloo, the allreduce in
backward, the masking of empty ranks, the running statistics), with the five kernels given CPU
implementations of their CUDA formulas (aten/src/ATen/native/cuda/Normalization.cuh), the device check
told that the CPU is the private-use device it accepts, and DDP's refusal of SyncBatchNorm on CPU modules
skipped.

Writes float32, in this order: the training output, the input's gradient, the weight's and bias's gradients
(DDP's average), the running mean and variance, the evaluation output."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from pyutil import exit_now  # noqa: E402

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

C = 3
SPATIAL = (3, 2)


def per_channel(t, dim):
    return t.view([1, -1] + [1] * (dim - 2))


def dims_of(x):
    return [0] + list(range(2, x.dim()))


def batch_norm_stats(x, eps):
    var, mean = torch.var_mean(x, dims_of(x), correction=0)
    return mean, (var + eps).rsqrt()


def batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    # the kernel's sequential combination, rank by rank (Chan et al.)
    n = torch.zeros_like(mean_all[0])
    avg = torch.zeros_like(mean_all[0])
    var_n = torch.zeros_like(mean_all[0])
    for j in range(mean_all.shape[0]):
        count = counts[j].to(mean_all.dtype)
        m = mean_all[j]
        v = (1.0 / invstd_all[j]) ** 2 - eps
        v = v * count
        factor = 1.0 / (n + count)
        var_n = var_n + v + (avg - m) * (avg - m) * n * count * factor
        avg = n * factor * avg + count * factor * m
        n = n + count
    invstd = 1.0 / torch.sqrt(var_n / n + eps)
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(avg.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_((var_n / (n - 1)).to(running_var.dtype), alpha=momentum)
    return avg, invstd


def batch_norm_elemt(x, weight, bias, mean, invstd, eps):
    d = x.dim()
    scale = invstd if weight is None else invstd * weight
    y = (x - per_channel(mean, d)) * per_channel(scale, d)
    return y if bias is None else y + per_channel(bias, d)


def batch_norm_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    xmu = x - per_channel(mean, x.dim())
    sum_dy = dy.sum(dims_of(x))
    sum_dy_xmu = (dy * xmu).sum(dims_of(x))
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd, sum_dy


def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    d = x.dim()
    total = count.sum().to(x.dtype)
    mean_dy = sum_dy / total
    mean_dy_xmu = sum_dy_xmu / total
    scale = invstd if weight is None else invstd * weight
    xmu = x - per_channel(mean, d)
    return (dy - per_channel(mean_dy, d) - xmu * per_channel(invstd * invstd * mean_dy_xmu, d)) * per_channel(scale, d)


torch.batch_norm_stats = batch_norm_stats
torch.batch_norm_gather_stats_with_counts = batch_norm_gather_stats_with_counts
torch.batch_norm_elemt = batch_norm_elemt
torch.batch_norm_backward_reduce = batch_norm_backward_reduce
torch.batch_norm_backward_elemt = batch_norm_backward_elemt
torch._C._get_privateuse1_backend_name = lambda: "cpu"
# DDP refuses a SyncBatchNorm on CPU modules too ("SyncBatchNorm layers only work with GPU modules"); the
# check is all that method does
DDP._passing_sync_batchnorm_handle = lambda self, module: None


def batch(r, n):
    """The same values as tests/interop/sync_batch_norm.rs's `batch`."""
    shape = [n, C, *SPATIAL]
    numel = int(np.prod(shape))
    at = torch.arange(numel, dtype=torch.float64) + 97.0 * r
    x = (torch.sin(at * 0.37) * 2.0 + torch.cos(at * 0.011)).view(shape).float()
    t = torch.cos(at * 0.23).view(shape).float()
    return x, t


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = [int(s) for s in os.environ["SBN_SIZES"].split(",")]
    n = sizes[rank]
    bn = torch.nn.SyncBatchNorm(C)
    with torch.no_grad():
        c = torch.arange(C, dtype=torch.float32)
        bn.weight.copy_(c * 0.25 + 0.5)
        bn.bias.copy_(c * 0.1 - 0.2)
    # the tch-dist rank's DDP has no buffers to broadcast (the running statistics agree by construction)
    ddp = DDP(bn, broadcast_buffers=False)
    # a first forward moves the running statistics (the module's, outside DDP's iteration)
    with torch.no_grad():
        bn(batch(rank + 10, n)[0])
    x, t = batch(rank, n)
    x.requires_grad_(True)
    y = ddp(x)
    (y * t).sum().backward()
    bn.eval()
    with torch.no_grad():
        y_eval = bn(x)
    out = [y.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var, y_eval]
    flat = torch.cat([o.reshape(-1) for o in out]).float()
    np.asarray(flat.numpy(), dtype=np.float32).tofile(os.environ["SBN_OUT"].replace("RANK", str(rank)))
    dist.barrier()
    print(f"python rank {rank} ok", flush=True)
    exit_now()


if __name__ == "__main__":
    main()
    exit_now()
