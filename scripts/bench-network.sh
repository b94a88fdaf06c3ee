#!/usr/bin/env bash
# DDP where the network is the bound: tch-dist against PyTorch DDP in the same run, on two nodes emulated
# by scripts/shaped-links.sh (a namespace per node, the link between them shaped by tc tbf to RATE in each
# direction; ranks of one node talk over its unshaped loopback). The model and steps are bench-ddp.sh's:
# MLP 1024-4096-4096-1024 (25.2M parameters, 100.7 MB of gradients), batch 32 per rank, SGD, one intra-op
# thread per rank; the median of 8 steps after 2 warm-up ones. Per rate and layout (2 nodes x 1 rank,
# 2 nodes x 2 ranks): plain DDP, the fp16 and bf16 compression hooks, PowerSGD rank 4 (one 128 MB
# bucket, as bench-ddp.sh), and the compute alone (no DDP, every rank running) from which the exposed
# communication (step minus compute) is read. Then, on 2 nodes x 2 ranks, FSDP over all four ranks
# against HSDP (shard within a node, replicate across), ours and FSDP2, with the bytes that cross the
# link per step (bench-memory.sh's model: 24 Linear(1024, 1024), AdamW). PyTorch's ranks bind their node's
# address with GLOO_SOCKET_IFNAME=lo (shaped-links.sh puts it first there), ours with tchrun
# --local-addr. Each round runs every configuration once, in a fixed order (PyTorch's before ours
# for each). Needs root, ip and tc.
#   scripts/bench-network.sh                 # ROUNDS=2, RATES="1gbit 10gbit", LAYOUTS="1 2"
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"
bench_init --memory-lib bench_ddp bench_memory
ROUNDS=${ROUNDS:-2}
RATES=${RATES:-"1gbit 10gbit"}
LAYOUTS=${LAYOUTS:-"1 2"}
net="tdxnet$$"
# shellcheck disable=SC2016  # run at exit
bench_out 'scripts/shaped-links.sh down "$net" 2>/dev/null || true'
scripts/shaped-links.sh check || { echo "bench-network: no network namespaces with tc tbf here (root, ip, tc)" >&2; exit 2; }
scripts/shaped-links.sh up "$net" 2 0
port=29600
rust=$PWD/target/release/examples/bench_ddp
py="env GLOO_SOCKET_IFNAME=lo $TCH_DIST_PYTHON_BIN $PWD/scripts/bench_ddp.py"
rust_fsdp="env BENCH_LINK=1 $PWD/target/release/examples/bench_memory --mode zero3"
py_fsdp="env BENCH_LINK=1 GLOO_SOCKET_IFNAME=lo $TCH_DIST_PYTHON_BIN $PWD/scripts/bench_memory.py --mode fsdp2"
tchrun=$PWD/target/release/tchrun
job() { # job NAME RANKS_PER_NODE CMD...: CMD on both nodes as one job; rank 0's result line to $out/NAME
  local name=$1 n=$2 k
  shift 2
  port=$((port + 1))
  for k in 1 2; do
    scripts/shaped-links.sh exec "$net" "$k" "$tchrun" --nnodes 2 --node-rank $((k - 1)) --nproc-per-node "$n" \
      --master-addr 127.0.1.1 --master-port "$port" --local-addr "127.0.$k.1" -- "$@" >"$out/last.node$k" 2>&1 &
  done
  wait
  sed -n 's/^\[rank0\]: //p' "$out/last.node1" | grep -E '^([0-9]|link )' >>"$out/$name" ||
    { cat "$out/last.node1" "$out/last.node2" >&2; exit 1; }
}
round() { # round R: every rate and layout
  local r=$1 rate n k
  for rate in $RATES; do
    scripts/shaped-links.sh mend "$net" 1 "$rate"
    for n in $LAYOUTS; do
      echo "round $r/$ROUNDS: $rate, 2 nodes x $n" >&2
      k="$rate.$n"
      job "torch_compute.$k" "$n" $py --no-ddp
      job "ours_compute.$k" "$n" "$rust" --no-ddp
      job "torch_ddp.$k" "$n" $py --view off
      job "ours_ddp.$k" "$n" "$rust"
      job "torch_fp16.$k" "$n" $py --view off --hook fp16
      job "ours_fp16.$k" "$n" "$rust" --hook fp16
      job "torch_bf16.$k" "$n" $py --view off --hook bf16
      job "ours_bf16.$k" "$n" "$rust" --hook bf16
      job "torch_powersgd.$k" "$n" $py --view off --powersgd 4 --bucket-mb 128
      job "ours_powersgd.$k" "$n" "$rust" --powersgd 4 --bucket-mb 128
    done
    echo "round $r/$ROUNDS: $rate, FSDP and HSDP on 2 nodes x 2" >&2
    job "torch_fsdp.$rate" 2 $py_fsdp
    job "ours_fsdp.$rate" 2 $rust_fsdp
    job "torch_hsdp.$rate" 2 $py_fsdp --hsdp 2
    job "ours_hsdp.$rate" 2 $rust_fsdp --hsdp 2
  done
}
bench_rounds -q round
bench_report "$out" "$RATES" "$LAYOUTS" <<'PY'
import sys
from benchlib import Runs, table_head, table_row
runs, rates, layouts = Runs(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
def step(name):
    return runs.median(name, 0, skip="link")
def link(name):
    return runs.median(name, 1, only="link")
params = 1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 1024 + 1024
print(f"MLP 1024-4096-4096-1024 ({params:,} parameters), batch 32/rank, SGD, Gloo; two nodes on one link shaped "
      "in each direction; medians of 8 steps per run, over the rounds\n")
for rate in rates:
    for n in layouts:
        k = f"{rate}.{n}"
        world = 2 * int(n)
        # what one ring allreduce of every gradient puts on each direction of the link (Gloo's ring: 2(N-1)/N
        # of the data leaves each rank; with 2 ranks per node the ring crosses the link once each way)
        bits = float(rate.replace("gbit", "e9").replace("mbit", "e6"))
        wire = 2 * (world - 1) / world * params * 4 * 8 / bits
        print(f"### {rate}, 2 nodes x {n} rank(s): the gradients' allreduce alone is about {wire:.2f} s on the wire\n")
        table_head("run", "PyTorch step (s)", "tch-dist step (s)", "tch-dist / PyTorch", "exposed communication, PyTorch (s)",
                   "exposed, tch-dist (s)")
        tc, oc = step(f"torch_compute.{k}"), step(f"ours_compute.{k}")
        table_row("compute alone (no DDP)", f"{tc:.3f}", f"{oc:.3f}", f"{oc / tc:.2f}", "", "")
        for run, label in [("ddp", "DDP"), ("fp16", "DDP + fp16 compression"), ("bf16", "DDP + bf16 compression"),
                           ("powersgd", "DDP + PowerSGD rank 4")]:
            t, o = step(f"torch_{run}.{k}"), step(f"ours_{run}.{k}")
            table_row(label, f"{t:.3f}", f"{o:.3f}", f"{o / t:.2f}", f"{t - tc:.3f}", f"{o - oc:.3f}")
        print()
    print(f"### {rate}, 2 nodes x 2 ranks: FSDP across the nodes against HSDP (24 Linear(1024, 1024), AdamW, batch 16/rank)\n")
    table_head("run", "PyTorch FSDP2 step (s)", "tch-dist step (s)", "tch-dist / PyTorch", "PyTorch MB across the link per step",
               "tch-dist MB per step")
    for run, label in [("fsdp", "FSDP: shard over all 4 ranks"), ("hsdp", "HSDP: shard within a node, replicate across")]:
        t, o = step(f"torch_{run}.{rate}"), step(f"ours_{run}.{rate}")
        table_row(label, f"{t:.3f}", f"{o:.3f}", f"{o / t:.2f}", f"{link(f'torch_{run}.{rate}') / 1e6:.1f}",
                  f"{link(f'ours_{run}.{rate}') / 1e6:.1f}")
    print()
PY
