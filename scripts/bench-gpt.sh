#!/usr/bin/env bash
# GPT benchmark: examples/gpt.rs (4 layers, d 128, 4 heads, context 64, global batch 16 sequences,
# 2 microbatches, byte-level on CPython's pydoc_data/topics.py) in one process, TP 2, PP 2, DP 2 and the
# pp 2 x dp 2 x tp 2 mesh (8 processes: this 2-core machine runs them 4 to a core). Tokens per second over
# STEPS steps after 3 warm-up steps; per rank, parameter bytes and the peak of tch-dist's counting
# allocator, the largest over the ranks. ROUNDS rounds (default 3), medians. Parameters per rank should
# scale as 1/(tp x pp): the embedding, positions and the unsplit LayerNorms keep it a little above.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example gpt --bin tchrun
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-3}
corpus=$("$TCH_DIST_PYTHON_BIN" -c 'import pydoc_data.topics as t; print(t.__file__)')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
configs=("1 1 1" "1 1 2" "2 1 1" "1 2 1" "2 2 2")
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  for c in "${configs[@]}"; do
    read -r pp dp tp <<<"$c"
    n=$((pp * dp * tp))
    ranks_all $n target/release/examples/gpt --corpus "$corpus" --pp $pp --dp $dp --tp $tp \
      --steps $((STEPS + 3)) --bench 3 | grep '^bench' >"$out/${pp}_${dp}_${tp}_$r"
  done
done
"$TCH_DIST_PYTHON_BIN" - "$out" "${configs[@]}" <<'PY'
import glob, os, statistics as st, sys
out, configs = sys.argv[1], sys.argv[2:]
print("| mesh (pp x dp x tp) | processes | tokens/s | parameter MB per rank (largest) | x one process | 1/(tp x pp) | peak MB per rank (largest) |")
print("|---|---:|---:|---:|---:|---:|---:|")
base = None
for c in configs:
    pp, dp, tp = map(int, c.split())
    tput, params, peaks = [], [], []
    for f in glob.glob(os.path.join(out, f"{pp}_{dp}_{tp}_*")):
        rows = [l.split() for l in open(f)]
        tput += [float(r[2]) for r in rows if r[1] == "tokens_per_s"]
        params.append(max(int(r[4]) for r in rows if r[1] == "rank"))
        peaks.append(max(int(r[6]) for r in rows if r[1] == "rank"))
    p = st.median(params)
    base = base or p
    print(f"| {pp} x {dp} x {tp} | {pp * dp * tp} | {st.median(tput):.0f} | {p / 1e6:.3f} | {p / base:.3f} | "
          f"{1 / (tp * pp):.3f} | {st.median(peaks) / 1e6:.1f} |")
PY
