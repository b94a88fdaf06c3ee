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
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example bench_memory --bin tchrun
export TCH_DIST_MEMORY_LIB=$PWD/target/release/libtch_dist_memory.so
ROUNDS=${ROUNDS:-3}
PNG=${PNG:-docs/bench-memory.png}
if [ -n "${KEEP:-}" ]; then
  out=$KEEP && mkdir -p "$out" && rm -f "$out"/*
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
run() { # run NAME CMD...: two ranks, rank 0's output to $out/NAME
  local name=$1; shift
  ranks 2 "$@" >>"$out/$name"
}
rust=target/release/examples/bench_memory
py="$TCH_DIST_PYTHON_BIN scripts/bench_memory.py"
# NAME SIDE ARGS...: in this order in odd rounds, in reverse in even ones (so neither side always goes first)
runs=(
  "torch_default py --mode default"
  "torch_views py --mode views"
  "torch_zero py --mode zero"
  "torch_zero_views py --mode zero_views"
  "ours_ddp rust --mode ddp"
  "ours_zero1 rust --mode zero1"
  "ours_zero2_25 rust --mode zero2"
  "ours_zero2 rust --mode zero2 --bucket-mb 4"
  "ours_zero2_bf16 rust --mode zero2 --bf16 --bucket-mb 4"
  "torch_fsdp2 py --mode fsdp2"
  "ours_zero3 rust --mode zero3"
  "torch_fsdp2_keep py --mode fsdp2_keep"
  "ours_zero3_keep rust --mode zero3 --keep"
  "ours_zero3_ckpt rust --mode zero3 --checkpoint"
  "ours_zero3_bf16 rust --mode zero3 --bf16"
  "torch_fsdp2_fused py --mode fsdp2 --fused"
  "ours_zero3_fused rust --mode zero3 --fused"
)
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  order=("${runs[@]}")
  if ((r % 2 == 0)); then
    order=()
    for ((i = ${#runs[@]} - 1; i >= 0; i--)); do order+=("${runs[$i]}"); done
  fi
  for spec in "${order[@]}"; do
    read -r name side args <<<"$spec"
    # shellcheck disable=SC2086  # args are words
    if [ "$side" = py ]; then run "$name" $py $args; else run "$name" $rust $args; fi
  done
done
"$TCH_DIST_PYTHON_BIN" scripts/bench_memory_report.py "$out" "$PNG"
