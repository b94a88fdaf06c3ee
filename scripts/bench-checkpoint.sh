#!/usr/bin/env bash
# Checkpoint benchmark: tch-dist's sharded checkpoints against torch.distributed.checkpoint (dcp.save,
# dcp.async_save, dcp.load), same run, same model and AdamW state: the bench-memory model (24
# Linear(1024, 1024), 25.2M parameters, ~302 MB of parameters and AdamW state), on 2 and 3 ranks over Gloo,
# one intra-op thread per rank, as DDP (everything replicated: each side writes every tensor once) and as
# ZeRO-3 / FSDP2 (each rank writes its shards). Per process: REPS repetitions of a synchronous save, an
# asynchronous save (stall: until the call returns; total: until committed) and a load; the slowest
# rank's time, median over repetitions, then median over ROUNDS rounds; each
# round runs both sides once per world size, in a fixed order (ours DDP, DCP DDP, FSDP2, ours ZeRO-3).
#   scripts/bench-checkpoint.sh          # ROUNDS=3 REPS=3; DIR=... where to write (default: a temp dir)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init bench_checkpoint
ROUNDS=${ROUNDS:-3}
REPS=${REPS:-3}
dir=${DIR:-$(mktemp -d)}
# shellcheck disable=SC2016  # run at exit
bench_out '[ -n "${DIR:-}" ] || rm -rf "$dir"'
rust=target/release/examples/bench_checkpoint
py="$TCH_DIST_PYTHON_BIN scripts/bench_checkpoint.py"
round() {
  local n
  for n in 2 3; do
    run "ours_ddp_$n" $n $rust --mode ddp --dir "$dir" --reps "$REPS"
    run "torch_ddp_$n" $n $py --mode ddp --dir "$dir" --reps "$REPS"
    run "torch_fsdp2_$n" $n $py --mode fsdp2 --dir "$dir" --reps "$REPS"
    run "ours_zero3_$n" $n $rust --mode zero3 --dir "$dir" --reps "$REPS"
  done
}
bench_rounds round
bench_report "$out" <<'PY'
import sys
from benchlib import Runs, medians, table_head, table_row
runs = Runs(sys.argv[1])
table_head("layout", "ranks", "", "save s", "async stall s", "async total s", "load s", "MB on disk", align="lrl")
for ours, theirs, label in (("ours_ddp", "torch_ddp", "DDP"), ("ours_zero3", "torch_fsdp2", "ZeRO-3 / FSDP2")):
    for n in (2, 3):
        a, b = medians(runs.rows(f"{ours}_{n}")), medians(runs.rows(f"{theirs}_{n}"))
        fmt = lambda v: [f"{x:.3f}" for x in v[:4]] + [f"{v[4] / 1e6:.1f}"]
        table_row(label, n, "tch-dist", *fmt(a))
        table_row(label, n, "DCP", *fmt(b))
        table_row(label, n, "**ratio**", *(f"**{x / y:.2f}**" for x, y in zip(a, b)))
print(f"\n({len(runs.rows('ours_zero3_3'))} rounds; ratio = tch-dist / DCP, lower is better for times)")
PY
