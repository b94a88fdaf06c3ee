"""PyTorch's side of scripts/bench-launches.sh: examples/gpt.rs's model (byte vocabulary, learned
positions, pre-LayerNorm blocks with q/k/v/proj and a GELU MLP, an unbiased head) trained under DDP,
FSDP2 (a unit for the embeddings, each block and the head, then the root) or HSDP (FSDP2 over a 2-D
mesh), with AdamW(foreach=True) and
clip_grad_norm_(foreach=True). After WARMUP steps, torch.profiler counts over STEPS steps the
outermost ATen operators and the c10d collectives this rank calls; prints, per step,
`launches LAYOUT rank R aten A collectives C`.
Run under torchrun: launches_ref.py LAYOUT [--layers 4 --dim 128 --heads 4 --context 64 --batch 4
--warmup 2 --steps 3]; LAYOUT is ddp, fsdp or hsdp (hsdp: world 4 as 2 x 2)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB = 256


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head_dim = d // heads

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (l(h).view(b, s, -1, self.head_dim).transpose(1, 2) for l in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, s, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Embed(nn.Module):
    def __init__(self, d, context):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.01)

    def forward(self, ids):
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Head(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


class Gpt(nn.Module):
    """The example's layers: the embeddings, the blocks and the head, each an FSDP unit (as the example's
    LayerList makes them, and as torchtitan wraps its embeddings, blocks and final norm with output)."""

    def __init__(self, layers, d, heads, context):
        super().__init__()
        self.embed = Embed(d, context)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = Head(d)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def top_level(events, prefix, names=None):
    """Events named `prefix...` with no ancestor of the same prefix: the outermost calls (counted by
    name into `names` when given)."""
    n = 0
    for e in events:
        if not e.name.startswith(prefix):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith(prefix):
            p = p.cpu_parent
        n += p is None
        if p is None and names is not None:
            names[e.name] = names.get(e.name, 0) + 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("layout", choices=["ddp", "fsdp", "hsdp"])
    for name, default in [("layers", 4), ("dim", 128), ("heads", 4), ("context", 64), ("batch", 4), ("warmup", 2), ("steps", 3)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Gpt(a.layers, a.dim, a.heads, a.context)
    if a.layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        if a.layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        # FSDP2's defaults: every unit but the root resharded after its forward
        for m in [model.embed, *model.blocks, model.head]:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(rank)

    def step():
        ids = torch.randint(0, VOCAB, (a.batch, a.context + 1), generator=g)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()

    for _ in range(a.warmup):
        step()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    events = prof.events()
    names = {}
    aten, comms = top_level(events, "aten::", names), top_level(events, "c10d::", names)
    print(f"launches {a.layout} rank {rank} aten {aten / a.steps:.1f} collectives {comms / a.steps:.1f}", flush=True)
    if os.environ.get("LAUNCHES_OPS"):
        for k, v in sorted(names.items(), key=lambda kv: -kv[1]):
            print(f"op {a.layout} rank {rank} {k} {v / a.steps:.1f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
