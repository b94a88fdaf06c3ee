#!/usr/bin/env bash
# The fault-injection drills of tests/faults.rs, timed, as the table in docs/failures.md: for each fault,
# how long until every rank had ended, and the first error line (trimmed). Collective timeout 10 s,
# tchrun's grace period 2 s.
#   scripts/faults.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --example fault_drill --bin tchrun
export TCH_DIST_TIMEOUT_SECS=10 RUST_BACKTRACE=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
drill() { # drill NAME RANKS MODE FAULT [ARGS...]
  local name=$1 ranks=$2 mode=$3 fault=$4; shift 4
  local start end
  start=$(date +%s.%N)
  TDX_FAULT=$fault target/debug/tchrun --standalone --nproc-per-node "$ranks" --grace-secs 2 -- \
    target/debug/examples/fault_drill --mode "$mode" --steps 8 "$@" >"$out/$name" 2>&1 || true
  end=$(date +%s.%N)
  echo "$name $(echo "$end - $start" | bc)" >>"$out/times"
}
drill stop-ddp 3 ddp stop@1:3
drill stop-zero2 3 zero2 stop@1:3
drill stop-pipeline 2 pipeline stop@1:3
drill kill-bucket 3 ddp killbucket@1:2
drill kill-store 3 ddp killbucket@0:2
drill mismatch 3 ddp mismatch@2:2
drill stage-fails 2 pipeline badloss@1:2
drill ckpt-unwritable 2 ddp none@0:0 --ckpt /dev/null/ckpt.safetensors
python3 - "$out" <<'PY'
import os, re, sys
out = sys.argv[1]
times = dict(l.split() for l in open(os.path.join(out, "times")))
what = {
    "stop-ddp": "rank 1 of 3 stopped (SIGSTOP) during DDP",
    "stop-zero2": "rank 1 of 3 stopped during ZeRO-2",
    "stop-pipeline": "stage 1 of a 2-stage pipeline stopped",
    "kill-bucket": "rank 1 of 3 killed (SIGKILL) mid-bucket",
    "kill-store": "rank 0 (the TCPStore's host) killed mid-bucket",
    "mismatch": "rank 2 calls an allreduce of another shape",
    "stage-fails": "stage 1's loss fails (bad target shape)",
    "ckpt-unwritable": "checkpoint directory unwritable",
}
def first_error(text):
    for pat in (r"\[rank\d\]: Error: .*", r"tchrun: rank \d .*failed with [^;]*"):
        m = re.search(pat, text)
        if m:
            line = m.group(0)
            return line[:230] + ("…" if len(line) > 230 else "")
    return "(no error line)"
def culprit(text):
    # tchrun's merge of the flight dumps; else what the errors say; else the first rank to fail
    for pat, fmt in ((r"tchrun:   culprit: (.*)", "{} (flight recorder)"),
                     (r"the odd one out: (rank \d+)", "{} (agreement check)"),
                     (r"Error: .*?: (rank \d+) failed:", "{} (its error, passed on)"),
                     (r"tchrun: (rank \d+) .*failed", "{} (the first to end)")):
        m = re.search(pat, text)
        if m:
            return fmt.format(m.group(1))
    return "?"
print("| fault | every rank ended after (s) | culprit named | first error |")
print("|---|---:|---|---|")
for name, label in what.items():
    t = open(os.path.join(out, name)).read()
    print(f"| {label} | {float(times[name]):.1f} | {culprit(t)} | {first_error(t).replace('|', '/')} |")
PY
