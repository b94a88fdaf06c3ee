#!/usr/bin/env bash
# Pipeline benchmark: 2 stage processes on this machine (one intra-op thread each, so stages do not fight
# for the 2 cores), GPipe and 1F1B, m in {2, 4, 8, 16}, against the unsplit model in the same run.
# Model: examples/pipeline.rs's MLP (16 x Linear(1024, 1024) + tanh), batch 256, SGD, 8 steps.
# Per-stage memory is each stage process's peak from the memory module, above its parameters (gradients,
# one parameter-size, plus activations).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example pipeline --bin tchrun
bin=target/release/examples/pipeline
STEPS=${STEPS:-8}
u1=$($bin --unsplit --threads 1 --steps "$STEPS" | awk '{print $2}')
u2=$($bin --unsplit --threads 2 --steps "$STEPS" | awk '{print $2}')
echo "unsplit model, one process: $u1 samples/s with 1 thread, $u2 samples/s with 2 threads"
echo
echo "| schedule | m | samples/s | vs unsplit, 1 thread | vs unsplit, 2 threads | bubble measured | bubble formula | stage 0 MB above params | stage 1 MB above params | in flight (stage 0 / 1) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
for sched in gpipe 1f1b; do
  for m in 2 4 8 16; do
    out=$($bin --schedule $sched --microbatches $m --steps "$STEPS")
    python3 - "$sched" "$m" "$u1" "$u2" <<PY
import re, sys
sched, m, u1, u2 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
out = """$out"""
head = out.splitlines()[0]
tput = float(re.search(r"([\d.]+) samples/s", head).group(1))
bub, form = re.search(r"bubble ([\d.]+) \(formula ([\d.]+)\)", head).groups()
st = re.findall(r"stage (\d): peak [\d.]+ MB \(([\d.]+) MB above its parameters\), (\d+) microbatch", out)
print(f"| {sched} | {m} | {tput:.0f} | {tput / u1:.2f} | {tput / u2:.2f} | {bub} | {form} | {st[0][1]} | {st[1][1]} | {st[0][2]} / {st[1][2]} |")
PY
  done
done
