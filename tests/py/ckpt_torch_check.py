"""PyTorch reads a tch-dist checkpoint saved from a sharded layout and goes on training exactly as tch-dist did.

    python ckpt_torch_check.py STEP_DIR NEXT_STEP_DIR D H BATCH LR

Loads STEP_DIR (model and AdamW state) into a torch module and torch.optim.AdamW, takes one step on the
batch of that step, and prints as JSON how far the result is from NEXT_STEP_DIR, where tch-dist saved the
same step."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import ckpt_to_torch  # noqa: E402

step_dir, next_dir = sys.argv[1], sys.argv[2]
D, H, BATCH = (int(a) for a in sys.argv[3:6])
LR = float(sys.argv[6])


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(D, H)
        self.l2 = torch.nn.Linear(H, D)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def data(step):
    rows = torch.arange(BATCH, dtype=torch.float32).unsqueeze(1) + step * 100.0
    cols = torch.arange(D, dtype=torch.float32).unsqueeze(0)
    return torch.sin(rows * 0.21 + cols * 0.4), torch.cos(rows * 0.07 - cols)


sd = ckpt_to_torch.load(step_dir)
m = M()
m.load_state_dict(ckpt_to_torch.section(sd, "model"))  # strict: every name and shape must match
opt = torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)
opt.load_state_dict(ckpt_to_torch.optimizer_state(sd, "optim", m, opt))
with open(os.path.join(step_dir, "metadata.json")) as f:
    step = json.load(f)["step"]
x, y = data(step)
torch.nn.functional.mse_loss(m(x), y).backward()
opt.step()

want = ckpt_to_torch.load(next_dir)
diff, compared = 0.0, 0
for n, p in m.named_parameters():
    diff = max(diff, (p.detach() - want[f"model.{n}"]).abs().max().item())
    st = opt.state[p]
    for field in ("exp_avg", "exp_avg_sq"):
        diff = max(diff, (st[field] - want[f"optim.state.{n}.{field}"]).abs().max().item())
    diff = max(diff, abs(st["step"].item() - want[f"optim.state.{n}.step"].item()))
    compared += 1
print(json.dumps({"max_diff": diff, "parameters": compared}))
