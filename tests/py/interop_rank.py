"""A PyTorch rank that runs the same collectives, in the same order, as tests/collectives/collectives.rs's scenario.

Started by tests/interop/interop.rs with torchrun's environment; joins the group with
torch.distributed.init_process_group("gloo", init_method="env://") and checks every result.
"""
import math
import os
import sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from pyutil import exit_now  # noqa: E402

import torch
import torch.distributed as dist


def main():
    dist.init_process_group(os.environ.get("TCH_DIST_BACKEND", "gloo"), init_method="env://")
    r, w = dist.get_rank(), dist.get_world_size()
    sum_r1 = sum(range(1, w + 1))

    base = torch.arange(1, 6, dtype=torch.float32)
    t = base * (r + 1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    assert t.tolist() == [i * sum_r1 for i in range(1, 6)], t

    # Gloo has no AVG: tch-dist sends SUM and divides, so the PyTorch twin does the same.
    t = base * (r + 1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t /= w
    assert all(abs(a - i * sum_r1 / w) < 1e-5 for a, i in zip(t.tolist(), range(1, 6))), t

    t = torch.tensor([float(r), -float(r)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [w - 1, 0.0], t
    t = torch.tensor([float(r), -float(r)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    assert t.tolist() == [0.0, -(w - 1)], t

    t = torch.tensor([r + 1.0, 2.0])
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    assert t.tolist() == [float(math.factorial(w)), float(2**w)], t

    t = torch.tensor([r * 1_000_000_007, 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    assert t.tolist() == [sum(q * 1_000_000_007 for q in range(w)), w], t

    root = w - 1
    t = torch.full((3, 4), float(r), dtype=torch.float64)
    dist.broadcast(t, src=root)
    assert (t == root).all(), t

    inp = torch.tensor([r * 10.0, r * 10.0 + 1, r * 10.0 + 2])
    outs = [torch.zeros(3) for _ in range(w)]
    dist.all_gather(outs, inp)
    for k, o in enumerate(outs):
        assert o.tolist() == [k * 10.0, k * 10.0 + 1, k * 10.0 + 2], (k, o)

    inputs = [torch.full((4,), r + 100.0 * k) for k in range(w)]
    out = torch.zeros(4)
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM)
    want = sum(range(w)) + 100.0 * r * w
    assert out.tolist() == [want] * 4, out

    nxt, prv = (r + 1) % w, (r + w - 1) % w
    sent = dist.isend(torch.tensor([float(r), 7.0]), nxt, tag=3)
    got = torch.zeros(2)
    dist.recv(got, prv, tag=3)
    sent.wait()
    assert got.tolist() == [float(prv), 7.0], got

    # the Rust scenario's plain send/recv between pairs (0, 1), (2, 3), ...: the even rank sends first
    partner = r ^ 1
    if partner < w:
        msg, got = torch.tensor([float(r), 7.0]), torch.zeros(2)
        if r % 2 == 0:
            dist.send(msg, partner, tag=4)
            dist.recv(got, partner, tag=4)
        else:
            dist.recv(got, partner, tag=4)
            dist.send(msg, partner, tag=4)
        assert got.tolist() == [float(partner), 7.0], got

    a = torch.full((1 << 16,), r + 1.0)
    b = torch.full((1 << 10,), 2.0 * (r + 1))
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.all_reduce(b, async_op=True)
    wb.wait()
    wa.wait()
    assert (a == sum_r1).all() and (b == 2 * sum_r1).all()

    # all_to_all_single, uneven: rank r sends rank s (r + s + 1) rows of 2, each 1000 r + 10 s + row
    def rows(n, base):
        return (torch.arange(n, dtype=torch.float32) + base).unsqueeze(1).repeat(1, 2)
    in_splits = [r + s + 1 for s in range(w)]
    out_splits = [q + r + 1 for q in range(w)]
    inp = torch.cat([rows(r + s + 1, 1000 * r + 10 * s) for s in range(w)])
    out = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    want = [float(1000 * q + 10 * r + j) for q in range(w) for j in range(q + r + 1) for _ in range(2)]
    assert out.flatten().tolist() == want, out

    inp = torch.arange(2 * w, dtype=torch.float32) + 100.0 * r
    out = torch.zeros(2 * w)
    dist.all_to_all_single(out, inp)
    assert out.tolist() == [float(x + 100 * q) for q in range(w) for x in (2 * r, 2 * r + 1)], out

    # the Rust scenario's all_to_all of [s + 1, r + 1] blocks: the same bytes as one flat all_to_all_single
    def block(frm, to):
        return torch.arange((to + 1) * (frm + 1), dtype=torch.float32) + 1000 * frm + 10 * to
    inp = torch.cat([block(r, s) for s in range(w)])
    out = torch.zeros(sum((r + 1) * (q + 1) for q in range(w)))
    dist.all_to_all_single(out, inp, [(r + 1) * (q + 1) for q in range(w)], [(s + 1) * (r + 1) for s in range(w)])
    assert out.tolist() == torch.cat([block(q, r) for q in range(w)]).tolist(), out

    dist.barrier()
    dist.destroy_process_group()
    print(f"python rank {r} ok", flush=True)



if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # a clear line for the Rust test's failure message
        print(f"python rank failed: {e!r}", file=sys.stderr, flush=True)
        raise
    exit_now()
