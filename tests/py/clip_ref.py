"""torch.nn.utils.clip_grad_norm_ on given gradients (tests/training/clip.rs): reads JSON cases from stdin, each
{"grads": [[shape, flat values], ...], "norm_type": p, "max_norm": m}; prints, per case, JSON
{"total": the returned norm, "grads": the clipped gradients, flat}."""
import json
import sys

import torch

out = []
for case in json.load(sys.stdin):
    params = []
    for shape, values in case["grads"]:
        p = torch.zeros(shape, dtype=torch.float32, requires_grad=True)
        p.grad = torch.tensor(values, dtype=torch.float32).reshape(shape)
        params.append(p)
    p = case["norm_type"]
    total = torch.nn.utils.clip_grad_norm_(params, case["max_norm"], norm_type=float("inf") if p == "inf" else p)
    out.append({"total": float(total), "grads": [q.grad.flatten().tolist() for q in params]})
print(json.dumps(out))
