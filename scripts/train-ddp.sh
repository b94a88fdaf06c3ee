#!/usr/bin/env bash
# Trains examples/train_ddp.rs (scikit-learn's 8x8 digits, MLP) on 1 process and on 2 DDP ranks with the
# same global batch, and prints both final test accuracies.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example train_ddp --bin tchrun
bin=target/release/examples/train_ddp
run() { target/release/tchrun --standalone --nproc-per-node "$1" -- $bin "${@:2}"; }
echo "== single process"
run 1 "$@" | tee /tmp/tdx-train-1.log
echo "== 2 ranks, DDP"
run 2 "$@" | tee /tmp/tdx-train-2.log
echo "== summary"
grep -h "^\[rank0\]: final" /tmp/tdx-train-1.log /tmp/tdx-train-2.log
