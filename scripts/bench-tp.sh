#!/usr/bin/env bash
# Tensor-parallel benchmark: Megatron MLP (d=1024, h=8192: 16.8M parameters), batch 64, SGD, one thread
# per rank, at TP size 1 and 2 in the same run. Parameter bytes per rank come from the memory module.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example bench_tp --bin tchrun
bin=target/release/examples/bench_tp
one=$(ranks 1 $bin)
two=$(ranks 2 $bin)
python3 - "$one" "$two" <<'PY'
import sys
rows = [l.split() for l in sys.argv[1:]]
base_b, base_t = int(rows[0][3]), float(rows[0][5])
print("| TP size | parameter MB per rank | vs TP 1 | step (s) | vs TP 1 |")
print("|---:|---:|---:|---:|---:|")
for r in rows:
    b, t = int(r[3]), float(r[5])
    print(f"| {r[1]} | {b / 1e6:.1f} | {b / base_b:.3f} | {t:.4f} | {t / base_t:.2f} |")
PY
