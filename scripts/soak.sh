#!/usr/bin/env bash
# Soak: many small training steps on 2 ranks (examples/soak.rs under tchrun) in each mode (DDP, ZeRO-2,
# bfloat16 autocast under DDP, a 2-stage pipeline), and rank 0's resident memory after 1,000 steps and at
# the end: it must not grow by more than 1%. tests/launch/soak.rs runs a short version (500 steps) in CI.
#   scripts/soak.sh               # 20,000 steps per mode (about 90 s each here)
#   STEPS=5000 scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example soak --bin tchrun
STEPS=${STEPS:-20000}
AT=${AT:-1000}
status=0
echo "| mode | steps | RSS after $AT steps (MB) | RSS after $STEPS steps (MB) | change |"
echo "|---|---:|---:|---:|---:|"
for mode in ddp zero2 amp pipeline; do
  out=$(ranks 2 target/release/examples/soak --mode $mode --steps "$STEPS" --report-at "$AT")
  line=$(python3 - "$mode" "$STEPS" "$AT" "$out" <<'PY'
import sys
mode, steps, at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rss = {int(l.split()[1]): int(l.split()[2]) for l in out.splitlines() if l.startswith("rss ")}
a, b = rss[at], rss[steps]
change = (b - a) / a
print(f"| {mode} | {steps:,} | {a / 1e6:.1f} | {b / 1e6:.1f} | {100 * change:+.2f}% |", "GROWS" if change > 0.01 else "")
PY
)
  echo "${line% *}"
  case "$line" in *GROWS) status=1 ;; esac
done
[ $status = 0 ] && echo "soak: no mode grew by more than 1%" || echo "soak: FAIL: memory grows"
exit $status
