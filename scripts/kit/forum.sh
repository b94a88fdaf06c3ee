#!/usr/bin/env bash
# The GPU kit's forum check: "my model takes twice the memory under DDP", ours (bin/forum_repro) beside
# PyTorch's own run (py/forum_repro.py) on this machine's torch, 2 ranks over Gloo, views off and on.
#   forum.sh cuda   # the caching allocator's numbers: 4,004,352 on the device, 8,008,704 wrapped in DDP
#   forum.sh cpu    # the CPU ruler's: 4,004,000 and 8,008,000
# Run by run.sh (which sets LD_LIBRARY_PATH and TCH_DIST_MEMORY_LIB); prints one PASS or FAIL line.
set -uo pipefail
kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
device=${1:?usage: forum.sh cuda|cpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
two() { "$kit/bin/tchrun" --standalone --nproc-per-node 2 -- "$@"; }
for view in off on; do
  two "$kit/bin/forum_repro" --view $view --device "$device" >"$work/rust-$view" 2>&1 ||
    { echo "FAIL forum-$device: tch-dist run failed: $(tail -2 "$work/rust-$view" | tr '\n' ' ')"; exit 1; }
  two "$py" "$kit/py/forum_repro.py" --view $view --device "$device" >"$work/torch-$view" 2>&1 ||
    { echo "FAIL forum-$device: PyTorch run failed: $(tail -2 "$work/torch-$view" | tr '\n' ' ')"; exit 1; }
done
"$py" - "$work" "$device" <<'PY'
import os, re, sys
work, device = sys.argv[1], sys.argv[2]
def load(name):
    rows = {}
    for line in open(os.path.join(work, name)):
        m = re.match(r"^\[rank\d+\]: rank (\d+) (.+) (\d+)$", line.strip())
        if m:
            rows[(int(m.group(1)), m.group(2))] = int(m.group(3))
    return rows
expect = {"cuda": (4004352, 8008704), "cpu": (4004000, 8008000)}[device]
shown = []
for view in ("off", "on"):
    t, r = load(f"torch-{view}"), load(f"rust-{view}")
    if not t or t != r:
        print(f"FAIL forum-{device}: views {view}: PyTorch {sorted(t.items())} vs tch-dist {sorted(r.items())}")
        sys.exit(1)
    got = (r[(0, "model on device")], r[(0, "wrapped in DDP")])
    if got != expect:
        print(f"FAIL forum-{device}: views {view}: {got} but the forum's numbers are {expect}")
        sys.exit(1)
    shown.append(f"views {view}: after backward {r[(0, 'after one backward')]:,}")
print(f"PASS forum-{device}: every stage on both ranks equal to PyTorch's; model {expect[0]:,}, wrapped "
      f"{expect[1]:,}; " + "; ".join(shown))
PY
