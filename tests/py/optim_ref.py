"""torch.optim reference for tests/training/optim.rs: the same parameters, gradients and steps; prints the final
parameters, one line per tensor. Usage: optim_ref.py sgd LR MOMENTUM DAMPENING NESTEROV WD STEPS [foreach]
                                      or optim_ref.py adamw LR BETA1 BETA2 EPS WD STEPS [fused|foreach]"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import torch  # noqa: E402

SHAPES = [(4, 3), (5,), (2, 2, 2), (300, 500)]  # as tests/training/optim.rs


def formula(n, k):
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + k) * 0.5


def main():
    kind, args = sys.argv[1], sys.argv[2:]
    params = [torch.nn.Parameter(formula(int(torch.tensor(s).prod()), i).view(s)) for i, s in enumerate(SHAPES)]
    if kind == "sgd":
        lr, mom, damp, nest, wd, steps = float(args[0]), float(args[1]), float(args[2]), args[3] == "1", float(args[4]), int(args[5])
        foreach = args[6:7] == ["foreach"]
        opt = torch.optim.SGD(params, lr=lr, momentum=mom, dampening=damp, nesterov=nest, weight_decay=wd, foreach=foreach)
    else:
        lr, b1, b2, eps, wd, steps = float(args[0]), float(args[1]), float(args[2]), float(args[3]), float(args[4]), int(args[5])
        fused, foreach = args[6:7] == ["fused"], args[6:7] == ["foreach"]
        opt = torch.optim.AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                foreach=None if fused else foreach, fused=fused or None)
    for step in range(steps):
        for i, p in enumerate(params):
            g = formula(p.numel(), step * 0.7 + i + 10)
            g[::3] = 0  # as tests/training/optim.rs: every third element exactly zero (a dead unit)
            p.grad = g.view(p.shape)
        opt.step()
    for p in params:
        print(" ".join(f"{v:.9e}" for v in p.detach().reshape(-1).tolist()))


if __name__ == "__main__":
    main()
