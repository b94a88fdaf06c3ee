#!/usr/bin/env bash
# The fault-injection drills of tests/launch/faults.rs, timed, as the table in docs/failures.md: for each fault,
# how long until every rank had ended, and the first error line (trimmed). Collective timeout 10 s
# (600 s, the default, for the drills of the heartbeat, the loop check and launch mistakes), tchrun's
# grace period 2 s.
#   scripts/faults.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
cargo build -q --example fault_drill --bin tchrun
export TCH_DIST_TIMEOUT_SECS=10 RUST_BACKTRACE=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
timed() { # timed NAME CMD...: runs CMD, its output to $out/NAME, its time to $out/times
  local name=$1; shift
  local start end
  start=$(date +%s.%N)
  "$@" >"$out/$name" 2>&1 || true
  end=$(date +%s.%N)
  echo "$name $(echo "$end - $start" | bc)" >>"$out/times"
}
drill() { # drill NAME RANKS MODE FAULT [ARGS...]
  local name=$1 ranks=$2 mode=$3 fault=$4; shift 4
  timed "$name" env TDX_FAULT="$fault" target/debug/tchrun --standalone --nproc-per-node "$ranks" --grace-secs 2 -- \
    target/debug/examples/fault_drill --mode "$mode" --steps 8 "$@"
}
by_hand() { # by_hand RANK:WORLD...: the drill's ranks started without a launcher, at one store
  local port=$((20000 + RANDOM % 20000)) pids=() rw
  for rw in "$@"; do
    RANK=${rw%:*} WORLD_SIZE=${rw#*:} MASTER_ADDR=127.0.0.1 MASTER_PORT=$port target/debug/examples/fault_drill &
    pids+=($!)
  done
  wait "${pids[@]}"
}
launchers() { # two tchrun launchers of 2 nodes, with 1 and 2 processes per node
  local port=$((20000 + RANDOM % 20000)) pids=() node
  for node in 0 1; do
    target/debug/tchrun --nnodes 2 --node-rank $node --nproc-per-node $((node + 1)) --master-addr 127.0.0.1 \
      --master-port $port --grace-secs 2 -- target/debug/examples/fault_drill &
    pids+=($!)
  done
  wait "${pids[@]}"
}
drill stop-ddp 3 ddp stop@1:3
drill stop-zero2 3 zero2 stop@1:3
drill stop-pipeline 2 pipeline stop@1:3
drill kill-bucket 3 ddp killbucket@1:2
drill kill-store 3 ddp killbucket@0:2
drill mismatch 3 ddp mismatch@2:2
drill stage-fails 2 pipeline badloss@1:2
drill ckpt-unwritable 2 ddp none@0:0 --ckpt /dev/null/ckpt.safetensors
drill torch-error 2 ddp torcherr@1:2
export TCH_DIST_TIMEOUT_SECS=600
TCH_DIST_HEARTBEAT_TIMEOUT_SECS=3 drill heartbeat-ddp 3 ddp stop@1:3
TCH_DIST_HEARTBEAT_TIMEOUT_SECS=3 drill heartbeat-fsdp 3 fsdp stop@1:3
TCH_DIST_HEARTBEAT_TIMEOUT_SECS=2 drill slow-rank 3 ddp sleep@1:3
drill sample-ddp 2 ddp sample@0:3
drill sample-fsdp 2 fsdp sample@0:3
drill uneven-ddp 2 ddp extra@1:5
drill uneven-fsdp 2 fsdp extra@1:5
timed world-size by_hand 0:2 1:3
timed duplicate-rank by_hand 0:3 1:3 1:3
timed launchers launchers
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
    "torch-error": "a libtorch error in rank 1 (shapes that do not broadcast)",
    "heartbeat-ddp": "rank 1 of 3 stopped during DDP, collective timeout 600 s, heartbeat timeout 3 s",
    "heartbeat-fsdp": "the same during FSDP",
    "slow-rank": "rank 1 of 3 sleeps 6 s, heartbeat timeout 2 s (the job must succeed)",
    "sample-ddp": "rank 0 runs an extra DDP forward (sampling), timeout 600 s",
    "sample-fsdp": "the same under FSDP",
    "uneven-ddp": "rank 1 runs 5 more steps than rank 0 (no join), DDP",
    "uneven-fsdp": "the same under FSDP",
    "world-size": "WORLD_SIZE=2 on rank 0, 3 on rank 1 (started by hand)",
    "duplicate-rank": "RANK=1 given to two of three processes",
    "launchers": "two tchrun launchers, --nproc-per-node 1 and 2",
}
def first_error(text):
    if "Error" not in text and text.count("]: done") >= 2:
        return "(none: every rank printed done)"
    for pat in (r"\[rank\d\]: Error: .*", r"^Error: .*", r"tchrun: rank \d .*failed with [^;]*"):
        m = re.search(pat, text, re.M)
        if m:
            line = m.group(0)
            return line[:230] + ("…" if len(line) > 230 else "")
    return "(no error line)"
def culprit(text):
    # tchrun's merge of the flight dumps; else what the errors say; else the first rank to fail
    for pat, fmt in ((r"tchrun: culprit: (rank \d+) \(([^)]*)\)", "{} ({})"),
                     (r"tchrun:   culprit: (.*)", "{} (flight recorder)"),
                     (r"the odd one out: (rank \d+)", "{} (agreement check)"),
                     (r"Error: .*?: (rank \d+) failed:", "{} (its error, passed on)"),
                     (r"tchrun: (rank \d+) .*failed", "{} (the first to end)")):
        m = re.search(pat, text)
        if m:
            return fmt.format(*m.groups())
    return "-"
print("| fault | every rank ended after (s) | culprit named | first error |")
print("|---|---:|---|---|")
for name, label in what.items():
    t = open(os.path.join(out, name)).read()
    print(f"| {label} | {float(times[name]):.1f} | {culprit(t)} | {first_error(t).replace('|', '/')} |")
PY
