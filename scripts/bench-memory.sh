#!/usr/bin/env bash
# Memory benchmark: ZeRO-1/2/3 (FSDP) and mixed precision against PyTorch (DDP, ZeroRedundancyOptimizer,
# FSDP2), same run, same ruler. 24 Linear(1024, 1024)
# layers with ReLU (25.2M parameters), AdamW, batch 16 per rank, 2 ranks over Gloo, one intra-op thread per
# rank. Peak = the CPU ruler's peak (tch-dist's counting allocator, loaded by PyTorch through ctypes) from
# start to end of each process, the larger of the two ranks; step time = median of 5 steps after 2 warm-up
# steps, median over rounds; a ratio of step times is the median of the rounds' own ratios (the ratio of
# the medians beside it). Prints a Markdown table; writes docs/bench-memory.png (PNG=... to change).
#   scripts/bench-memory.sh        # ROUNDS=3 by default; KEEP=DIR keeps each run's raw lines in DIR
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init --memory-lib bench_memory
ROUNDS=${ROUNDS:-3}
PNG=${PNG:-docs/bench-memory.png}
bench_out
rust=target/release/examples/bench_memory
py="$TCH_DIST_PYTHON_BIN scripts/bench_memory.py"
# in this order in odd rounds, in reverse in even ones (so neither side always goes first)
runs=(
  "run torch_default 2 $py --mode default"
  "run torch_views 2 $py --mode views"
  "run torch_zero 2 $py --mode zero"
  "run torch_zero_views 2 $py --mode zero_views"
  "run ours_ddp 2 $rust --mode ddp"
  "run ours_zero1 2 $rust --mode zero1"
  "run ours_zero2_25 2 $rust --mode zero2"
  "run ours_zero2 2 $rust --mode zero2 --bucket-mb 4"
  "run ours_zero2_bf16 2 $rust --mode zero2 --bf16 --bucket-mb 4"
  "run torch_fsdp2 2 $py --mode fsdp2"
  "run ours_zero3 2 $rust --mode zero3"
  "run torch_fsdp2_keep 2 $py --mode fsdp2_keep"
  "run ours_zero3_keep 2 $rust --mode zero3 --keep"
  "run ours_zero3_ckpt 2 $rust --mode zero3 --checkpoint"
  "run ours_zero3_bf16 2 $rust --mode zero3 --bf16"
  "run torch_fsdp2_fused 2 $py --mode fsdp2 --fused"
  "run ours_zero3_fused 2 $rust --mode zero3 --fused"
)
bench_rounds alternate "${runs[@]}"
"$TCH_DIST_PYTHON_BIN" scripts/bench_memory_report.py "$out" "$PNG"
