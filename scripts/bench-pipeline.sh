#!/usr/bin/env bash
# Pipeline benchmark: 2 stage processes on this machine (one intra-op thread each, so stages do not fight
# for the 2 cores), GPipe and 1F1B, m in {2, 4, 8, 16}, against PyTorch's torch.distributed.pipelining
# (ScheduleGPipe, Schedule1F1B: scripts/bench_pipeline.py) with the same model, batch, m and steps, and
# against the unsplit model, in the same run; ROUNDS rounds (default 7) alternate ours and PyTorch's (ours
# first in odd rounds, PyTorch's first in even ones), and every figure is the median over rounds. The
# headline ratio is the median of the rounds' own ratios (each round's pair runs back to back, so slow
# drifts of this shared machine cancel); the ratio of the medians is printed beside it.
# Model: examples/pipeline.rs's MLP (16 x Linear(1024, 1024) + tanh), batch 256, SGD, STEPS steps (8).
# Idle = 1 - CPU time / wall time of each stage process (one thread each), mean over the stages: the same
# ruler for both (PyTorch's schedules record no timeline); our span-measured bubble is shown too.
# Per-stage memory is each stage process's peak during the steps (tch-dist's counting allocator, loaded by
# PyTorch too), absolute and above its parameters.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init --memory-lib pipeline
bin=target/release/examples/pipeline
STEPS=${STEPS:-8}
ROUNDS=${ROUNDS:-7}
bench_out
ours() { # ours SCHEDULE M ROUND
  $bin --schedule "$1" --microbatches "$2" --steps "$STEPS" >"$out/ours_$1_$2_$3"
}
theirs() { # theirs SCHEDULE M ROUND: PyTorch's line, prefixed with the round
  local line
  line=$(ranks 2 "$TCH_DIST_PYTHON_BIN" scripts/bench_pipeline.py --schedule "$1" --microbatches "$2" --steps "$STEPS")
  [ -n "$line" ] || { echo "bench_pipeline.py printed nothing ($1, m=$2)" >&2; exit 1; }
  echo "$3 $line" >>"$out/torch_$1_$2"
}
round() { # round R: ours and PyTorch's back to back at each point
  local r=$1 sched m
  $bin --unsplit --threads 1 --steps "$STEPS" | awk '{print $2}' >>"$out/unsplit1"
  $bin --unsplit --threads 2 --steps "$STEPS" | awk '{print $2}' >>"$out/unsplit2"
  for sched in gpipe 1f1b; do
    for m in 2 4 8 16; do
      alternate "$r" "ours $sched $m $r" "theirs $sched $m $r"
    done
  done
}
bench_rounds round
bench_report "$out" "$ROUNDS" <<'PY'
import os, re, sys
from benchlib import Runs, median as med, ratios, table_head, table_row
runs, rounds = Runs(sys.argv[1]), int(sys.argv[2])
u1, u2 = runs.median("unsplit1"), runs.median("unsplit2")
print(f"unsplit model, one process: {u1:.1f} samples/s with 1 thread, {u2:.1f} samples/s with 2 threads\n")
rows = []
for sched in ("gpipe", "1f1b"):
    for m in (2, 4, 8, 16):
        ours = []
        for name in sorted(runs.names(f"ours_{sched}_{m}_*"), key=lambda f: int(f.rsplit("_", 1)[1])):
            text = open(os.path.join(runs.folder, name)).read()
            head = text.splitlines()[0]
            tput = float(re.search(r"([\d.]+) samples/s", head).group(1))
            bub, form = map(float, re.search(r"bubble ([\d.]+) \(formula ([\d.]+)\)", head).groups())
            idle = float(re.search(r"idle ([\d.]+)", text).group(1))
            sts = re.findall(r"stage (\d): peak ([\d.]+) MB \(([\d.]+) MB above its parameters\), (\d+) microbatch", text)
            ours.append((tput, bub, form, idle, float(sts[0][2]), float(sts[1][2]), f"{sts[0][3]} / {sts[1][3]}",
                         max(float(sts[0][1]), float(sts[1][1]))))
        torch = sorted(tuple(map(float, r)) for r in runs.rows(f"torch_{sched}_{m}"))
        torch = [x[1:] for x in torch]  # ordered by round, the round dropped
        paired = ratios([o[0] for o in ours], [t[0] for t in torch])
        col = lambda v, i: med([x[i] for x in v])
        rows.append((sched, m, col(ours, 0), col(ours, 1), ours[0][2], col(ours, 3), col(ours, 4), col(ours, 5),
                     ours[0][6], col(torch, 0), col(torch, 1), col(ours, 7), med([max(x[2:]) / 1e6 for x in torch]),
                     med(paired), sum(p >= 1.0 for p in paired), len(paired)))
table_head("schedule", "m", "samples/s", "vs unsplit, 1 thread", "vs unsplit, 2 threads", "bubble (spans)", "bubble formula",
           "stage 0 MB above params", "stage 1 MB above params", "in flight (stage 0 / 1)", align="lrrrrrrrrl")
for s, m, t, b, f, _, s0, s1, fl, *_ in rows:
    table_row(s, m, f"{t:.0f}", f"{t / u1:.2f}", f"{t / u2:.2f}", f"{b:.3f}", f"{f:.3f}", f"{s0:.2f}", f"{s1:.2f}", fl)
print("\nAgainst torch.distributed.pipelining, same run:\n")
table_head("schedule", "m", "ours samples/s", "PyTorch samples/s", "**samples/s ours / PyTorch** (median of rounds' ratios)",
           "rounds >= 1.0", "ratio of medians", "ours idle", "PyTorch idle", "idle difference", "ours peak MB",
           "PyTorch peak MB", "**peak ours / PyTorch**")
for s, m, t, _, _, idle, _, _, _, tt, ti, pk, tpk, pr, above, n in rows:
    table_row(s, m, f"{t:.0f}", f"{tt:.0f}", f"**{pr:.3f}**", f"{above} of {n}", f"{t / tt:.3f}", f"{idle:.3f}", f"{ti:.3f}",
              f"{idle - ti:+.3f}", f"{pk:.2f}", f"{tpk:.2f}", f"**{pk / tpk:.3f}**")
print("(peaks: the larger stage's, during the steps)")
print(f"\n({rounds} rounds; medians)")
PY
