#!/usr/bin/env bash
# Context parallelism, tch-dist against PyTorch's own (torch.distributed.tensor.experimental.context_parallel
# with head-tail load balancing), same run, same shapes: causal attention's forward and backward over
# [1, 8 heads, 2048 tokens, 64] on 2 ranks (Gloo, one thread each), and the whole sequence in one process
# (ATen's fused CPU flash kernel, in both); ours also with its agreement checks at first use only
# (TCH_DIST_VERIFY=once, the default on NCCL; Gloo's checks every call). Each round runs every configuration once, in a
# fixed order (ours, then PyTorch's, then one process each); each figure is the median over rounds of
# each run's median step. PyTorch on CPU needs its CPU flash kernel registered with its ring code (see
# scripts/bench_context_parallel.py); without it, the error this prints first.
#   scripts/bench-context-parallel.sh            # ROUNDS=3 BENCH_SEQ=2048 BENCH_HEADS=8 BENCH_DIM=64
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init bench_context_parallel
ROUNDS=${ROUNDS:-3}
RANKS=${RANKS:-2}
export OMP_NUM_THREADS=1
bench_out
echo "PyTorch's context_parallel as shipped, on CPU:" >&2
BENCH_TORCH_PATCH=0 BENCH_STEPS=1 target/release/tchrun --standalone --nproc-per-node "$RANKS" -- \
  "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py 2>&1 | grep -m1 -o "NotImplementedError: .*" >&2 || true
round() { # the ranks' stderr dropped
  run ours "$RANKS" target/release/examples/bench_context_parallel
  TCH_DIST_VERIFY=once run ours_once "$RANKS" target/release/examples/bench_context_parallel
  BENCH_ROTATE=alltoall run torch_ring "$RANKS" "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py
  BENCH_ROTATE=allgather run torch_allgather "$RANKS" "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py
  run ours_one 1 target/release/examples/bench_context_parallel
  run torch_one 1 "$TCH_DIST_PYTHON_BIN" scripts/bench_context_parallel.py
} 2>/dev/null
bench_rounds round
bench_report "$out" "$RANKS" <<'PY'
import sys
from benchlib import Runs, table_head, table_row
runs, ranks = Runs(sys.argv[1]), sys.argv[2]
m = {n: runs.median(n) for n in runs.names()}
print(f"\ncausal attention, forward + backward, seconds per step (median over rounds)\n")
table_head("run", "tch-dist", "PyTorch", "ratio PyTorch/ours")
for label, ours, torch in ((f"{ranks} ranks, ring (PyTorch: rotate alltoall)", "ours", "torch_ring"),
                           (f"{ranks} ranks, PyTorch rotate allgather", "ours", "torch_allgather"),
                           (f"{ranks} ranks, ring, ours checked at first use only (TCH_DIST_VERIFY=once, NCCL's default)",
                            "ours_once", "torch_ring"),
                           ("1 process, whole sequence (fused SDPA)", "ours_one", "torch_one")):
    table_row(label, f"{m[ours]:.3f}", f"{m[torch]:.3f}", f"{m[torch] / m[ours]:.2f}")
PY
