#!/usr/bin/env bash
# Collective bandwidth, tch-dist against torch.distributed (Gloo), 2 processes on this machine, same run:
# allreduce, and all_to_all_single in equal chunks. Rounds alternate ours / PyTorch; each size reports
# the median over rounds. Prints a Markdown table per operation.
#   scripts/bench-collectives.sh            # 4 KiB .. 64 MiB, 3 rounds, both operations
#   ROUNDS=5 BENCH_SECONDS=1 BENCH_OPS=all_to_all scripts/bench-collectives.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build --release --example bench_collectives --bin tchrun -q
export BENCH_SIZES=${BENCH_SIZES:-4096,16384,65536,262144,1048576,4194304,16777216,67108864}
export BENCH_SECONDS=${BENCH_SECONDS:-0.5}
ROUNDS=${ROUNDS:-3}
BENCH_OPS=${BENCH_OPS:-allreduce all_to_all}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run2() { # run2 NAME CMD...: two ranks, rank 0's output to $out/NAME
  local name=$1; shift
  ranks 2 "$@" >>"$out/$name"
}

for op in $BENCH_OPS; do
  for round in $(seq "$ROUNDS"); do
    echo "$op, round $round/$ROUNDS: tch-dist (checks on), tch-dist (checks off), PyTorch" >&2
    BENCH_OP=$op TCH_DIST_VERIFY=1 run2 "$op.ours_checked" target/release/examples/bench_collectives
    BENCH_OP=$op TCH_DIST_VERIFY=0 run2 "$op.ours" target/release/examples/bench_collectives
    BENCH_OP=$op run2 "$op.torch" "$TCH_DIST_PYTHON_BIN" scripts/bench_collectives.py
  done
done

"$TCH_DIST_PYTHON_BIN" - "$out" $BENCH_OPS <<'PY'
import statistics, sys, os
out = sys.argv[1]
def load(name):
    d = {}
    for line in open(os.path.join(out, name)):
        size, t = line.split()
        d.setdefault(int(size), []).append(float(t))
    return {k: statistics.median(v) for k, v in d.items()}
def human(b):
    return f"{b // 1048576} MiB" if b >= 1048576 else f"{b // 1024} KiB"
for op in sys.argv[2:]:
    ours, checked, torch = load(f"{op}.ours"), load(f"{op}.ours_checked"), load(f"{op}.torch")
    print(f"\n{op}, 2 ranks (GB/s: bytes of each rank's tensor per second)\n")
    print("| size | PyTorch GB/s | tch-dist GB/s | ratio ours/PyTorch | tch-dist with agreement checks GB/s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for s in sorted(torch):
        bw = lambda t: s / t / 1e9
        print(f"| {human(s)} | {bw(torch[s]):.3f} | {bw(ours[s]):.3f} | {torch[s] / ours[s]:.2f} | {bw(checked[s]):.3f} | {torch[s] / checked[s]:.2f} |")
PY
