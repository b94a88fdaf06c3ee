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
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --release --example pipeline --bin tchrun
export TCH_DIST_MEMORY_LIB=$PWD/target/release/libtch_dist_memory.so
bin=target/release/examples/pipeline
STEPS=${STEPS:-8}
ROUNDS=${ROUNDS:-7}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
ours() { # ours SCHEDULE M ROUND
  $bin --schedule "$1" --microbatches "$2" --steps "$STEPS" >"$out/ours_$1_$2_$3"
}
theirs() { # theirs SCHEDULE M ROUND: PyTorch's line, prefixed with the round
  local line
  line=$(ranks 2 "$TCH_DIST_PYTHON_BIN" scripts/bench_pipeline.py --schedule "$1" --microbatches "$2" --steps "$STEPS")
  [ -n "$line" ] || { echo "bench_pipeline.py printed nothing ($1, m=$2)" >&2; exit 1; }
  echo "$3 $line" >>"$out/torch_$1_$2"
}
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  $bin --unsplit --threads 1 --steps "$STEPS" | awk '{print $2}' >>"$out/unsplit1"
  $bin --unsplit --threads 2 --steps "$STEPS" | awk '{print $2}' >>"$out/unsplit2"
  for sched in gpipe 1f1b; do
    for m in 2 4 8 16; do
      if ((r % 2)); then
        ours "$sched" "$m" "$r"
        theirs "$sched" "$m" "$r"
      else
        theirs "$sched" "$m" "$r"
        ours "$sched" "$m" "$r"
      fi
    done
  done
done
"$TCH_DIST_PYTHON_BIN" - "$out" "$ROUNDS" <<'PY'
import glob, os, re, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = st.median
nums = lambda f: [float(l) for l in open(os.path.join(out, f)) if l.strip()]
u1, u2 = med(nums("unsplit1")), med(nums("unsplit2"))
print(f"unsplit model, one process: {u1:.1f} samples/s with 1 thread, {u2:.1f} samples/s with 2 threads\n")
rows = []
for sched in ("gpipe", "1f1b"):
    for m in (2, 4, 8, 16):
        ours = []
        for f in sorted(glob.glob(os.path.join(out, f"ours_{sched}_{m}_*")), key=lambda f: int(f.rsplit("_", 1)[1])):
            text = open(f).read()
            head = text.splitlines()[0]
            tput = float(re.search(r"([\d.]+) samples/s", head).group(1))
            bub, form = map(float, re.search(r"bubble ([\d.]+) \(formula ([\d.]+)\)", head).groups())
            idle = float(re.search(r"idle ([\d.]+)", text).group(1))
            sts = re.findall(r"stage (\d): peak ([\d.]+) MB \(([\d.]+) MB above its parameters\), (\d+) microbatch", text)
            ours.append((tput, bub, form, idle, float(sts[0][2]), float(sts[1][2]), f"{sts[0][3]} / {sts[1][3]}",
                         max(float(sts[0][1]), float(sts[1][1]))))
        torch = sorted(tuple(map(float, l.split())) for l in open(os.path.join(out, f"torch_{sched}_{m}")) if l.strip())
        torch = [x[1:] for x in torch]  # ordered by round, the round dropped
        paired = [o[0] / t[0] for o, t in zip(ours, torch)]
        col = lambda v, i: med([x[i] for x in v])
        rows.append((sched, m, col(ours, 0), col(ours, 1), ours[0][2], col(ours, 3), col(ours, 4), col(ours, 5),
                     ours[0][6], col(torch, 0), col(torch, 1), col(ours, 7), med([max(x[2:]) / 1e6 for x in torch]),
                     med(paired), sum(p >= 1.0 for p in paired), len(paired)))
print("| schedule | m | samples/s | vs unsplit, 1 thread | vs unsplit, 2 threads | bubble (spans) | bubble formula | stage 0 MB above params | stage 1 MB above params | in flight (stage 0 / 1) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for s, m, t, b, f, _, s0, s1, fl, *_ in rows:
    print(f"| {s} | {m} | {t:.0f} | {t / u1:.2f} | {t / u2:.2f} | {b:.3f} | {f:.3f} | {s0:.2f} | {s1:.2f} | {fl} |")
print("\nAgainst torch.distributed.pipelining, same run:\n")
print("| schedule | m | ours samples/s | PyTorch samples/s | **samples/s ours / PyTorch** (median of rounds' ratios) | rounds >= 1.0 | ratio of medians | ours idle | PyTorch idle | idle difference | ours peak MB | PyTorch peak MB | **peak ours / PyTorch** |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for s, m, t, _, _, idle, _, _, _, tt, ti, pk, tpk, pr, above, n in rows:
    print(f"| {s} | {m} | {t:.0f} | {tt:.0f} | **{pr:.3f}** | {above} of {n} | {t / tt:.3f} | {idle:.3f} | {ti:.3f} | "
          f"{idle - ti:+.3f} | {pk:.2f} | {tpk:.2f} | **{pk / tpk:.3f}** |")
print("(peaks: the larger stage's, during the steps)")
print(f"\n({rounds} rounds; medians)")
PY
