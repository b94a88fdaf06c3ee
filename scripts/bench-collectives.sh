#!/usr/bin/env bash
# Collective bandwidth, tch-dist against torch.distributed (Gloo), 2 processes on this machine, same run:
# allreduce, and all_to_all_single in equal chunks. Each round runs ours (checks on, then
# off), then PyTorch, in that order; each size reports
# the median over rounds. Prints a Markdown table per operation.
#   scripts/bench-collectives.sh            # 4 KiB .. 64 MiB, 3 rounds, both operations
#   ROUNDS=5 BENCH_SECONDS=1 BENCH_OPS=all_to_all scripts/bench-collectives.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init bench_collectives
export BENCH_SIZES=${BENCH_SIZES:-4096,16384,65536,262144,1048576,4194304,16777216,67108864}
export BENCH_SECONDS=${BENCH_SECONDS:-0.5}
ROUNDS=${ROUNDS:-3}
BENCH_OPS=${BENCH_OPS:-allreduce all_to_all}
bench_out
round() { # round R OP
  local op=$2
  echo "$op, round $1/$ROUNDS: tch-dist (checks on), tch-dist (checks off), PyTorch" >&2
  BENCH_OP=$op TCH_DIST_VERIFY=1 run "$op.ours_checked" 2 target/release/examples/bench_collectives
  BENCH_OP=$op TCH_DIST_VERIFY=0 run "$op.ours" 2 target/release/examples/bench_collectives
  BENCH_OP=$op run "$op.torch" 2 "$TCH_DIST_PYTHON_BIN" scripts/bench_collectives.py
}
for op in $BENCH_OPS; do
  bench_rounds -q round "$op"
done
# shellcheck disable=SC2086  # the operations are words
bench_report "$out" $BENCH_OPS <<'PY'
import sys
from benchlib import Runs, median, table_head, table_row
runs = Runs(sys.argv[1])
def load(name):
    d = {}
    for size, t in runs.rows(name):
        d.setdefault(int(size), []).append(float(t))
    return {k: median(v) for k, v in d.items()}
def human(b):
    return f"{b // 1048576} MiB" if b >= 1048576 else f"{b // 1024} KiB"
for op in sys.argv[2:]:
    ours, checked, torch = load(f"{op}.ours"), load(f"{op}.ours_checked"), load(f"{op}.torch")
    print(f"\n{op}, 2 ranks (GB/s: bytes of each rank's tensor per second)\n")
    table_head("size", "PyTorch GB/s", "tch-dist GB/s", "ratio ours/PyTorch", "tch-dist with agreement checks GB/s",
               "ratio", align="r")
    for s in sorted(torch):
        bw = lambda t: f"{s / t / 1e9:.3f}"
        table_row(human(s), bw(torch[s]), bw(ours[s]), f"{torch[s] / ours[s]:.2f}", bw(checked[s]),
                  f"{torch[s] / checked[s]:.2f}")
PY
