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
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init --memory-lib bench_tp
bin=target/release/examples/bench_tp
ROUNDS=${ROUNDS:-7}
bench_out
py="$TCH_DIST_PYTHON_BIN scripts/bench_tp.py"
round() {
  local r=$1 block
  for block in mlp attention; do
    run "ours1_$block" 1 $bin --block $block
    alternate "$r" "run ours2_$block 2 $bin --block $block" "run torch2_$block 2 $py --block $block"
  done
}
bench_rounds round
bench_report "$out" <<'PY'
import sys
from benchlib import Runs, median, ratios, table_head, table_row

runs = Runs(sys.argv[1])


def load(name):
    rows = runs.rows(name)
    # "tp N param_bytes B step S peak P"
    return (int(rows[0][1]), int(rows[0][3]), runs.median(name, 5), max(int(r[7]) for r in rows), len(rows),
            runs.column(name, 5))


for block, title in (("mlp", "Megatron MLP d=1024, h=8192, batch 64"),
                     ("attention", "self-attention d=1024, 16 heads, batch 8 x sequence 128")):
    R = {n: load(f"{n}_{block}") for n in ("ours1", "ours2", "torch2")}
    print(f"{title}, SGD; {R['ours2'][4]} rounds\n")
    table_head("run", "TP size", "parameter MB per rank", "peak MB per rank", "step (s)")
    for n, label in (("ours1", "tch-dist"), ("ours2", "tch-dist"), ("torch2", "PyTorch DTensor TP")):
        tp, b, t, peak, *_ = R[n]
        table_row(label, tp, f"{b / 1e6:.1f}", f"{peak / 1e6:.1f}", f"{t:.4f}")
    o, p = R["ours2"], R["torch2"]
    paired = ratios(o[5], p[5])  # each round's pair ran back to back
    print(f"\nTP 2, ours / PyTorch DTensor: parameters {o[1] / p[1]:.3f}, peak {o[3] / p[3]:.3f} (goal <= 1), "
          f"step {median(paired):.3f} (goal <= 1; median of the rounds' ratios, {sum(x <= 1 for x in paired)} "
          f"of {len(paired)} rounds <= 1; ratio of medians {o[2] / p[2]:.3f}); ours TP 2 / TP 1: step "
          f"{o[2] / R['ours1'][2]:.2f}, parameters {o[1] / R['ours1'][1]:.3f}\n")
PY
