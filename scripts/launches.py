"""Launch counts, tch-dist against PyTorch in the same run (scripts/bench-launches.sh; tests/models/launches.rs
runs it small). For each layout, examples/gpt.rs --launches (under tchrun, in the strict NCCL mode: the
path NCCL takes, one collective per FSDP unit) and its PyTorch twin scripts/launches_ref.py (under
torchrun) train the same model with foreach AdamW and gradient clipping; after the warm-up each counts,
per training step and rank, the collectives it posts and the outermost ATen operators it calls. Prints per
layout

    launches LAYOUT: collectives ours/PyTorch R1 (a vs b), aten ops ours/PyTorch R2 (c vs d)

(the highest count over the ranks, each side) and exits 1 when a ratio is above --max (1.0).
    launches.py --tchrun target/debug/tchrun --gpt target/debug/examples/gpt [--layouts ddp,fsdp,hsdp]
                [--layers 4 --d 128 --heads 4 --context 64 --batch 4 --warmup 2 --steps 3 --max 1.0]"""
import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = {"ddp": 2, "fsdp": 2, "hsdp": 4}
OURS = {"ddp": ["--dp", "2"], "fsdp": ["--fsdp", "2"], "hsdp": ["--hsdp", "2x2"]}
LINE = re.compile(r"launches (?:\w+ )?rank (\d+) aten ([\d.]+) collectives ([\d.]+)")


def counts(cmd, env, what):
    """The highest (aten, collectives) per step over the ranks' `launches` lines of `cmd`."""
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    rows = [(float(m.group(2)), float(m.group(3))) for m in LINE.finditer(out)]
    if p.returncode != 0 or not rows:
        sys.exit(f"{what} failed (exit {p.returncode}, {len(rows)} launches lines):\n{out[-4000:]}")
    return max(r[0] for r in rows), max(r[1] for r in rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tchrun", required=True)
    ap.add_argument("--gpt", required=True)
    ap.add_argument("--layouts", default="ddp,fsdp,hsdp")
    for name, default in [("layers", 4), ("d", 128), ("heads", 4), ("context", 64), ("batch", 4), ("warmup", 2), ("steps", 3)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--max", type=float, default=1.0)
    a = ap.parse_args()
    import pydoc_data.topics as corpus  # a real text on every CPython: the example's bytes

    model = ["--layers", str(a.layers), "--heads", str(a.heads), "--context", str(a.context)]
    failed = []
    for layout in a.layouts.split(","):
        world = WORLD[layout]
        rows = a.batch * world  # the global batch: every rank is a data-parallel one
        env = dict(os.environ, TCH_DIST_STRICT_NCCL="1", TCH_DIST_VERIFY="once", OMP_NUM_THREADS="1")
        ours = counts(
            [a.tchrun, "--standalone", "--nproc-per-node", str(world), "--", a.gpt, "--corpus", corpus.__file__]
            + model
            + ["--d", str(a.d)]
            + OURS[layout]
            + ["--global-batch", str(rows), "--microbatches", "1", "--steps", str(a.warmup + a.steps), "--launches", str(a.steps)],
            env,
            f"tch-dist {layout}",
        )
        env = dict(os.environ, OMP_NUM_THREADS="1")
        theirs = counts(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), os.path.join(HERE, "launches_ref.py"), layout]
            + model
            + ["--dim", str(a.d), "--batch", str(a.batch), "--warmup", str(a.warmup), "--steps", str(a.steps)],
            env,
            f"PyTorch {layout}",
        )
        r_coll, r_aten = ours[1] / theirs[1], ours[0] / theirs[0]
        print(
            f"launches {layout}: collectives ours/PyTorch {r_coll:.2f} ({ours[1]:g} vs {theirs[1]:g}), "
            f"aten ops ours/PyTorch {r_aten:.2f} ({ours[0]:g} vs {theirs[0]:g})",
            flush=True,
        )
        if max(r_coll, r_aten) > a.max:
            failed.append(layout)
    if failed:
        sys.exit(f"above {a.max}: {', '.join(failed)}")


if __name__ == "__main__":
    main()
