#!/usr/bin/env bash
# Context parallelism, tch-dist against PyTorch's own (torch.distributed.tensor.experimental.context_parallel
# with head-tail load balancing), same run, same shapes: causal attention's forward and backward over
# [1, 8 heads, 2048 tokens, 64] on 2 ranks (Gloo, one thread each), and the whole sequence in one process
# (ATen's fused CPU flash kernel, in both); ours also with its agreement checks at first use only
# (TCH_DIST_VERIFY=once, the default on NCCL; Gloo's checks every call). Rounds alternate; each figure is the median over rounds of
# each run's median step. PyTorch on CPU needs its CPU flash kernel registered with its ring code (see
# scripts/bench_context_parallel.py); without it, the error this prints first.
#   scripts/bench-context-parallel.sh            # ROUNDS=3 BENCH_SEQ=2048 BENCH_HEADS=8 BENCH_DIM=64
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build --release --example bench_context_parallel --bin tchrun -q
ROUNDS=${ROUNDS:-3}
RANKS=${RANKS:-2}
export OMP_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { # run NAME RANKS CMD...: rank 0's figure to $out/NAME
  local name=$1 n=$2; shift 2
  target/release/tchrun --standalone --nproc-per-node "$n" -- "$@" 2>/dev/null | sed 's/^\[rank0\]: //' >>"$out/$name"
}
echo "PyTorch's context_parallel as shipped, on CPU:" >&2
BENCH_TORCH_PATCH=0 BENCH_STEPS=1 target/release/tchrun --standalone --nproc-per-node "$RANKS" -- \
  "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py 2>&1 | grep -m1 -o "NotImplementedError: .*" >&2 || true
for round in $(seq "$ROUNDS"); do
  echo "round $round/$ROUNDS" >&2
  run ours "$RANKS" target/release/examples/bench_context_parallel
  TCH_DIST_VERIFY=once run ours_once "$RANKS" target/release/examples/bench_context_parallel
  BENCH_ROTATE=alltoall run torch_ring "$RANKS" "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py
  BENCH_ROTATE=allgather run torch_allgather "$RANKS" "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py
  run ours_one 1 target/release/examples/bench_context_parallel
  run torch_one 1 "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py
done
"$TCH_DIST_PYTHON_BIN" - "$out" "$RANKS" <<'PY'
import os, statistics, sys
out, ranks = sys.argv[1], sys.argv[2]
m = {n: statistics.median(float(x) for x in open(os.path.join(out, n))) for n in os.listdir(out)}
print(f"\ncausal attention, forward + backward, seconds per step (median over rounds)\n")
print("| run | tch-dist | PyTorch | ratio PyTorch/ours |")
print("|---|---:|---:|---:|")
print(f"| {ranks} ranks, ring (PyTorch: rotate alltoall) | {m['ours']:.3f} | {m['torch_ring']:.3f} | {m['torch_ring'] / m['ours']:.2f} |")
print(f"| {ranks} ranks, PyTorch rotate allgather | {m['ours']:.3f} | {m['torch_allgather']:.3f} | {m['torch_allgather'] / m['ours']:.2f} |")
print(f"| {ranks} ranks, ring, ours checked at first use only (TCH_DIST_VERIFY=once, NCCL's default) | {m['ours_once']:.3f} | {m['torch_ring']:.3f} | {m['torch_ring'] / m['ours_once']:.2f} |")
print(f"| 1 process, whole sequence (fused SDPA) | {m['ours_one']:.3f} | {m['torch_one']:.3f} | {m['torch_one'] / m['ours_one']:.2f} |")
PY
