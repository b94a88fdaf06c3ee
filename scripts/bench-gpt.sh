#!/usr/bin/env bash
# GPT benchmark: examples/gpt.rs (4 layers, d 128, 4 heads, context 64, global batch 16 sequences,
# 2 microbatches, byte-level on CPython's pydoc_data/topics.py) in one process, TP 2, PP 2, DP 2 and the
# pp 2 x dp 2 x tp 2 mesh (8 processes: this 2-core machine runs them 4 to a core). Tokens per second over
# STEPS steps after 3 warm-up steps; per rank, parameter bytes and the peak of tch-dist's counting
# allocator, the largest over the ranks. ROUNDS rounds (default 3), medians. Parameters per rank should
# scale as 1/(tp x pp): the embedding, positions and the unsplit LayerNorms keep it a little above.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init gpt
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-3}
corpus=$("$TCH_DIST_PYTHON_BIN" -c 'import pydoc_data.topics as t; print(t.__file__)')
bench_out
configs=("1 1 1" "1 1 2" "2 1 1" "1 2 1" "2 2 2")
round() { # every rank's bench lines, a file per mesh and round
  local c pp dp tp n
  for c in "${configs[@]}"; do
    read -r pp dp tp <<<"$c"
    n=$((pp * dp * tp))
    ranks_all $n target/release/examples/gpt --corpus "$corpus" --pp $pp --dp $dp --tp $tp \
      --steps $((STEPS + 3)) --bench 3 | grep '^bench' >"$out/${pp}_${dp}_${tp}_$1"
  done
}
bench_rounds round
bench_report "$out" "${configs[@]}" <<'PY'
import sys
from benchlib import Runs, median, table_head, table_row
runs, configs = Runs(sys.argv[1]), sys.argv[2:]
table_head("mesh (pp x dp x tp)", "processes", "tokens/s", "parameter MB per rank (largest)", "x one process",
           "1/(tp x pp)", "peak MB per rank (largest)")
base = None
for c in configs:
    pp, dp, tp = map(int, c.split())
    tput, params, peaks = [], [], []
    for name in runs.names(f"{pp}_{dp}_{tp}_*"):
        rows = runs.rows(name)
        tput += [float(r[2]) for r in rows if r[1] == "tokens_per_s"]
        params.append(max(int(r[4]) for r in rows if r[1] == "rank"))
        peaks.append(max(int(r[6]) for r in rows if r[1] == "rank"))
    p = median(params)
    base = base or p
    table_row(f"{pp} x {dp} x {tp}", pp * dp * tp, f"{median(tput):.0f}", f"{p / 1e6:.3f}", f"{p / base:.3f}",
              f"{1 / (tp * pp):.3f}", f"{median(peaks) / 1e6:.1f}")
PY
