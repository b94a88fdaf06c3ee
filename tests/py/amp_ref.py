"""PyTorch's side of tests/training/amp.rs. Prints one line of numbers per tensor.

  amp_ref.py autocast   -> output dtype line, then output, grad w1, b1, w2, b2 (bf16 autocast forward)
  amp_ref.py scaler     -> per step: scale, then p (GradScaler on CPU, SGD, infs at steps 2 and 6)
"""
import sys

import torch
import torch.nn.functional as F


def formula(n, k, a):
    return torch.sin(torch.arange(n, dtype=torch.float32) * a + k)


def autocast():
    w1 = (formula(128, 0.0, 0.37) * 0.3).view(16, 8).requires_grad_()
    b1 = (torch.cos(torch.arange(16, dtype=torch.float32)) * 0.1).requires_grad_()
    w2 = (formula(64, 1.0, 0.11) * 0.3).view(4, 16).requires_grad_()
    b2 = (torch.zeros(4) + 0.05).requires_grad_()
    x = formula(48, 0.0, 0.23).view(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = F.linear(F.linear(x, w1, b1).relu(), w2, b2)
    o.float().pow(2).mean().backward()
    print(str(o.dtype).replace("torch.", ""))
    for t in [o, w1.grad, b1.grad, w2.grad, b2.grad]:
        print(" ".join(repr(v) for v in t.detach().double().flatten().tolist()))


def scaler():
    p = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for step in range(10):
        g = torch.tensor([step + 1.0, -1.0, 0.5, 2.0])
        if step in (2, 6):
            g[1] = float("inf")
        opt.zero_grad()
        sc.scale((p * g).sum()).backward()
        sc.step(opt)
        sc.update()
        print(sc.get_scale(), " ".join(repr(v) for v in p.detach().double().tolist()))


{"autocast": autocast, "scaler": scaler}[sys.argv[1]]()
