#!/usr/bin/env bash
# Launch counts against PyTorch in the same run: examples/gpt.rs (4 blocks, d 128, 4 heads, context 64,
# 4 rows per rank; foreach AdamW and clipping) under DDP (2 ranks), FSDP (2 ranks, a unit per layer) and
# HSDP (2 x 2), in the strict NCCL mode (the path NCCL takes: one collective per FSDP unit), against
# PyTorch's twin (scripts/launches_ref.py: DDP, FSDP2 with a unit for the embeddings, each block and the
# head, HSDP over a 2-D mesh). After 2 warm-up steps, per step and rank over 3: the collectives posted (our
# flight recorder; torch.profiler's c10d events) and the outermost ATen operators called (a RecordFunction
# callback in our shim; torch.profiler's aten events). One line per layout:
#   launches LAYOUT: collectives ours/PyTorch R1 (a vs b), aten ops ours/PyTorch R2 (c vs d)
# and exit 1 when a ratio is above 1.0. tests/models/launches.rs runs it smaller in CI.
#   scripts/bench-launches.sh [launches.py options, e.g. --layers 8 --d 256]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
# counts, not times: the debug build counts what the release build does
cargo build -q --example gpt --bin tchrun
"$TCH_DIST_PYTHON_BIN" scripts/launches.py --tchrun target/debug/tchrun --gpt target/debug/examples/gpt "$@"
