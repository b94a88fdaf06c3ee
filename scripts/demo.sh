#!/usr/bin/env bash
# The main demo: the forum question "my model takes twice the memory under DDP" answered by running it.
# Runs the forum's program (Linear(1000, 1000), 2 ranks over Gloo) in PyTorch (scripts/forum_repro.py)
# and in Rust with tch-dist (examples/forum_repro.rs), with gradient_as_bucket_view off and on, and prints
# rank 0's memory at each step side by side. On CPU both processes use the same ruler: tch-dist's
# counting allocator (tch-dist-sys/csrc/memory.cpp), loaded into PyTorch through ctypes.
#   scripts/demo.sh                 # CPU
#   scripts/demo.sh --device cuda   # on a GPU machine (both ranks share cuda:0)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
device=cpu
[ "${1:-}" = "--device" ] && device=${2:-cpu}
features=""
[ "$device" = cuda ] && features="--features cuda"
cargo build -q $features --example forum_repro --bin tchrun
export TCH_DIST_MEMORY_LIB=$PWD/target/debug/libtch_dist_memory.so
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

export TCHRUN=target/debug/tchrun
run2() { # run2 OUTFILE CMD...: ranks 0 and 1 of one group under tchrun; both ranks' lines go to OUTFILE
  local file=$1; shift
  ranks_all 2 "$@" >"$file"
}

for view in off on; do
  run2 "$out/torch-$view" "$TCH_DIST_PYTHON_BIN" scripts/forum_repro.py --view $view --device $device
  run2 "$out/rust-$view" target/debug/examples/forum_repro --view $view --device $device
done

"$TCH_DIST_PYTHON_BIN" - "$out" "$device" <<'PY'
import os, sys
out, device = sys.argv[1], sys.argv[2]
def load(name):
    rows = {}
    for line in open(os.path.join(out, name)):
        parts = line.split()
        if parts and parts[0] == "rank":
            rows[(int(parts[1]), " ".join(parts[2:-1]))] = int(parts[-1])
    return rows
print(f"Forum repro: Linear(1000, 1000), 2 ranks over Gloo, device {device}; bytes allocated on each rank")
print("(CPU: one counting allocator measures both processes; CUDA: the caching allocator's memory_allocated)\n")
ok = True
for view in ("off", "on"):
    t, r = load(f"torch-{view}"), load(f"rust-{view}")
    print(f"gradient_as_bucket_view={view}")
    print(f"  {'rank':<5}{'stage':<26}{'PyTorch DDP':>14}{'tch-dist DDP':>14}  equal")
    for key in sorted(t, key=lambda k: (k[0], list(t).index(k))):
        eq = t[key] == r.get(key)
        ok &= eq
        print(f"  {key[0]:<5}{key[1]:<26}{t[key]:>14,}{r.get(key, -1):>14,}  {'yes' if eq else 'NO'}")
    for line in open(os.path.join(out, f"rust-{view}")):
        if line.startswith("breakdown rank 0"):
            print("  tch-dist", line.strip())
    print()
print("Why: DDP allocates a flat gradient bucket as large as the parameters at construction (2x);")
print("after backward the gradients add a third copy unless gradient_as_bucket_view makes them views")
print("into the buckets. tch-dist turns gradient_as_bucket_view on by default.")
print("all stages equal:", "yes" if ok else "NO")
sys.exit(0 if ok else 1)
PY
