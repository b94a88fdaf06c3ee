#!/usr/bin/env bash
# DDP benchmark: tch-dist against PyTorch DDP in the same run. MLP 1024-4096-4096-1024 (25.2M parameters,
# 100.7 MB), batch 32 per rank, SGD, 2 ranks over Gloo, one intra-op thread per rank. Step time is the
# median of 8 steps after 2 warm-up steps; memory is the peak counted by one CPU ruler in every process
# (tch-dist's counting allocator; PyTorch loads it through ctypes). Each round runs every
# configuration once, in the order of `round` below (PyTorch's single and DDP runs first); ranks start
# under tchrun. PowerSGD rows: rank 4, warm start, error feedback, from the third step on, one bucket
# (PyTorch's hook over Gloo aborts with several: its callbacks order the collectives differently per rank).
#   scripts/bench-ddp.sh           # ROUNDS=3 by default
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init --memory-lib bench_ddp
ROUNDS=${ROUNDS:-3}
bench_out
rust=target/release/examples/bench_ddp
py="$TCH_DIST_PYTHON_BIN scripts/bench_ddp.py"
round() {
  run torch_single 1 $py --no-ddp
  run torch_default 2 $py --view off
  run torch_view 2 $py --view on
  run ours_single 1 $rust --no-ddp
  run ours_default 2 $rust
  run ours_norec 2 env TCH_DIST_TRACE_ENTRIES=0 $rust
  run ours_timeline 2 env TCH_DIST_TIMELINE_DIR="$out/timeline" $rust
  run ours_noview 2 $rust --view off
  run torch_powersgd 2 $py --view off --powersgd 4 --bucket-mb 128
  run ours_powersgd 2 $rust --powersgd 4 --bucket-mb 128
}
bench_rounds round
bench_report "$out" <<'PY'
import sys
from benchlib import Runs, table_head, table_row
runs = Runs(sys.argv[1])
extra = ("flight", "timeline")  # the recorders' cost lines, beside the step lines
def load(n):
    return runs.median(n, 0, skip=extra), max(int(r[1]) for r in runs.rows(n, skip=extra))
R = {n: load(n) for n in ["torch_single", "torch_default", "torch_view", "ours_single", "ours_default", "ours_norec", "ours_timeline", "ours_noview", "torch_powersgd", "ours_powersgd"]}
ratio = {n: runs.rows(n, skip=extra)[0][2] for n in ["torch_powersgd", "ours_powersgd"]}
ops, us = (runs.median("ours_default", i, only="flight") for i in (1, 2))
tl_ev, tl_us = (runs.median("ours_timeline", i, only="timeline") for i in (1, 2))
params = 1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 1024 + 1024
pbytes = params * 4
base_t, base_m = R["torch_default"]
names = {
    "torch_default": "PyTorch DDP (default, views off)",
    "torch_view": "PyTorch DDP, gradient_as_bucket_view=True",
    "ours_default": "tch-dist DDP (default, views on)",
    "ours_norec": "tch-dist DDP, flight recorder off",
    "ours_timeline": "tch-dist DDP, timeline on (TCH_DIST_TIMELINE_DIR)",
    "ours_noview": "tch-dist DDP, views off",
    "torch_powersgd": "PyTorch DDP + powerSGD_hook (rank 4)",
    "ours_powersgd": "tch-dist DDP + PowerSgd (rank 4)",
}
print(f"MLP 1024-4096-4096-1024: {params:,} parameters ({pbytes / 1e6:.1f} MB), 2 ranks, Gloo, batch 32/rank\n")
table_head("run", "step (s)", "step / PyTorch default", "peak MB", "peak / PyTorch default",
           "DDP overhead over single process (MB)", "overhead / param size")
for k, label in names.items():
    t, m = R[k]
    single = R["ours_single" if k.startswith("ours") else "torch_single"][1]
    table_row(label, f"{t:.3f}", f"{t / base_t:.2f}", f"{m / 1e6:.1f}", f"{m / base_m:.2f}", f"{(m - single) / 1e6:.1f}",
              f"{(m - single) / pbytes:.2f}")
print(f"\nsingle process peaks: PyTorch {R['torch_single'][1] / 1e6:.1f} MB, tch-dist {R['ours_single'][1] / 1e6:.1f} MB")
ours_t, ours_m = R["ours_default"]
tv_m = R["torch_view"][1]
print(f"step time ours/PyTorch default: {ours_t / base_t:.2f} (goal <= 1.0)")
print(f"peak ours vs PyTorch views on: {ours_m / tv_m:.3f} (goal <= 1.0)")
print(f"peak saved vs PyTorch default: {(base_m - ours_m) / pbytes:.2f} x parameter size (goal >= 1.0)")
print(f"flight recorder: step time with it / without it {ours_t / R['ours_norec'][0]:.3f} (goal <= 1.01; this machine's noise is ±10%);")
print(f"  directly: {ops:.1f} operations recorded per step x {us:.2f} us each = {ops * us / 1e6 / ours_t:.5%} of the step")
print(f"timeline: step time with it / without it {R['ours_timeline'][0] / ours_t:.3f} (goal <= 1.01);")
print(f"  directly: {tl_ev:.1f} events recorded per step x {tl_us:.2f} us each = {tl_ev * tl_us / 1e6 / ours_t:.5%} of the step")
print(f"PowerSGD rank 4: compression {ratio['ours_powersgd']}x (PyTorch's hook: {ratio['torch_powersgd']}x), "
      f"step time ours/PyTorch {R['ours_powersgd'][0] / R['torch_powersgd'][0]:.2f}")
PY
