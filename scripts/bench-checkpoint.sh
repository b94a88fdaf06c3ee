#!/usr/bin/env bash
# Checkpoint benchmark: tch-dist's sharded checkpoints against torch.distributed.checkpoint (dcp.save,
# dcp.async_save, dcp.load), same run, same model and AdamW state: the bench-memory model (24
# Linear(1024, 1024), 25.2M parameters, ~302 MB of parameters and AdamW state), on 2 and 3 ranks over Gloo,
# one intra-op thread per rank, as DDP (everything replicated: each side writes every tensor once) and as
# ZeRO-3 / FSDP2 (each rank writes its shards). Per process: REPS repetitions of a synchronous save, an
# asynchronous save (stall: until the call returns; total: until committed) and a load; the slowest
# rank's time, median over repetitions, then median over ROUNDS rounds that alternate the two sides.
#   scripts/bench-checkpoint.sh          # ROUNDS=3 REPS=3; DIR=... where to write (default: a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example bench_checkpoint --bin tchrun
ROUNDS=${ROUNDS:-3}
REPS=${REPS:-3}
dir=${DIR:-$(mktemp -d)}
out=$(mktemp -d)
trap 'rm -rf "$out"; [ -z "${DIR:-}" ] && rm -rf "$dir"' EXIT
rust=target/release/examples/bench_checkpoint
py="$TCH_DIST_PYTHON_BIN scripts/bench_checkpoint.py"
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  for n in 2 3; do
    ranks $n $rust --mode ddp --dir "$dir" --reps "$REPS" >>"$out/ours_ddp_$n"
    ranks $n $py --mode ddp --dir "$dir" --reps "$REPS" >>"$out/torch_ddp_$n"
    ranks $n $py --mode fsdp2 --dir "$dir" --reps "$REPS" >>"$out/torch_fsdp2_$n"
    ranks $n $rust --mode zero3 --dir "$dir" --reps "$REPS" >>"$out/ours_zero3_$n"
  done
done
"$TCH_DIST_PYTHON_BIN" - "$out" <<'PY'
import os, statistics, sys
out = sys.argv[1]
def med(name):
    rows = [list(map(float, l.split())) for l in open(os.path.join(out, name)) if l.strip()]
    return [statistics.median(c) for c in zip(*rows)], len(rows)
print("| layout | ranks | | save s | async stall s | async total s | load s | MB on disk |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for ours, theirs, label in (("ours_ddp", "torch_ddp", "DDP"), ("ours_zero3", "torch_fsdp2", "ZeRO-3 / FSDP2")):
    for n in (2, 3):
        a, ra = med(f"{ours}_{n}")
        b, rb = med(f"{theirs}_{n}")
        fmt = lambda v: [f"{x:.3f}" for x in v[:4]] + [f"{v[4] / 1e6:.1f}"]
        print(f"| {label} | {n} | tch-dist | " + " | ".join(fmt(a)) + " |")
        print(f"| {label} | {n} | DCP | " + " | ".join(fmt(b)) + " |")
        print(f"| {label} | {n} | **ratio** | " + " | ".join(f"**{x / y:.2f}**" for x, y in zip(a, b)) + " |")
print(f"\n({ra} rounds; ratio = tch-dist / DCP, lower is better for times)")
PY
