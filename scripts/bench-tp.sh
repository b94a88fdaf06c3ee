#!/usr/bin/env bash
# Tensor-parallel benchmark: Megatron MLP (d=1024, h=8192: 16.8M parameters), batch 64, and one
# self-attention block (d=1024, 16 heads: 4.2M parameters), batch 8 x sequence 128; SGD, one thread per
# rank: ours at TP 1 and 2, and PyTorch's DTensor TP (parallelize_module with ColwiseParallel /
# RowwiseParallel, scripts/bench_tp.py) at TP 2, alternating (ours first in odd rounds, PyTorch's first in
# even ones), ROUNDS times (default 7), in the same run.
# Memory: parameter bytes per rank, and the peak of tch-dist's counting allocator (PyTorch loads the same
# one through ctypes). Step: the median of 8 steps, median over rounds; the headline step ratio is the
# median of the rounds' own ratios (each round's pair runs back to back), the ratio of medians beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example bench_tp --bin tchrun
export TCH_DIST_MEMORY_LIB=$PWD/target/release/libtch_dist_memory.so
bin=target/release/examples/bench_tp
ROUNDS=${ROUNDS:-7}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  for block in mlp attention; do
    ranks 1 $bin --block $block >>"$out/ours1_$block"
    if ((r % 2)); then
      ranks 2 $bin --block $block >>"$out/ours2_$block"
      ranks 2 "$TCH_DIST_PYTHON_BIN" scripts/bench_tp.py --block $block >>"$out/torch2_$block"
    else
      ranks 2 "$TCH_DIST_PYTHON_BIN" scripts/bench_tp.py --block $block >>"$out/torch2_$block"
      ranks 2 $bin --block $block >>"$out/ours2_$block"
    fi
  done
done
"$TCH_DIST_PYTHON_BIN" - "$out" <<'PY'
import statistics
import sys

out = sys.argv[1]


def load(name):
    rows = [l.split() for l in open(f"{out}/{name}") if l.strip()]
    # "tp N param_bytes B step S peak P"
    return (int(rows[0][1]), int(rows[0][3]), statistics.median(float(r[5]) for r in rows),
            max(int(r[7]) for r in rows), len(rows), [float(r[5]) for r in rows])


for block, title in (("mlp", "Megatron MLP d=1024, h=8192, batch 64"),
                     ("attention", "self-attention d=1024, 16 heads, batch 8 x sequence 128")):
    R = {n: load(f"{n}_{block}") for n in ("ours1", "ours2", "torch2")}
    print(f"{title}, SGD; {R['ours2'][4]} rounds\n")
    print("| run | TP size | parameter MB per rank | peak MB per rank | step (s) |")
    print("|---|---:|---:|---:|---:|")
    for n, label in (("ours1", "tch-dist"), ("ours2", "tch-dist"), ("torch2", "PyTorch DTensor TP")):
        tp, b, t, peak, *_ = R[n]
        print(f"| {label} | {tp} | {b / 1e6:.1f} | {peak / 1e6:.1f} | {t:.4f} |")
    o, p = R["ours2"], R["torch2"]
    paired = [a / b for a, b in zip(o[5], p[5])]  # each round's pair ran back to back
    print(f"\nTP 2, ours / PyTorch DTensor: parameters {o[1] / p[1]:.3f}, peak {o[3] / p[3]:.3f} (goal <= 1), "
          f"step {statistics.median(paired):.3f} (goal <= 1; median of the rounds' ratios, {sum(x <= 1 for x in paired)} "
          f"of {len(paired)} rounds <= 1; ratio of medians {o[2] / p[2]:.3f}); ours TP 2 / TP 1: step "
          f"{o[2] / R['ours1'][2]:.2f}, parameters {o[1] / R['ours1'][1]:.3f}\n")
PY
