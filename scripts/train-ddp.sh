#!/usr/bin/env bash
# Trains examples/train_ddp.rs (scikit-learn's 8x8 digits, MLP) on 1 process and on 2 DDP ranks with the
# same global batch, and prints both final test accuracies.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example train_ddp
bin=target/release/examples/train_ddp
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
echo "== single process"
MASTER_ADDR=127.0.0.1 MASTER_PORT=$(port) WORLD_SIZE=1 RANK=0 $bin "$@" | tee /tmp/tdx-train-1.log
echo "== 2 ranks, DDP"
p=$(port)
MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=1 $bin "$@" >/dev/null &
MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=0 $bin "$@" | tee /tmp/tdx-train-2.log
wait
echo "== summary"
grep -h "final" /tmp/tdx-train-1.log /tmp/tdx-train-2.log
