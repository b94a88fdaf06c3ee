#!/usr/bin/env bash
# Trains examples/cnn_ddp.rs (a small ResNet with batch norm, scikit-learn's 8x8 digits) in one process
# (tch's BatchNorm), on 2 DDP ranks with SyncBatchNorm and on 2 DDP ranks with each rank's batch norm its
# own, with the same global batch of 64; prints each run's final test accuracy and the largest loss
# difference from one process, and plots the three loss curves.
#   scripts/cnn.sh                 # EPOCHS=20, PNG=docs/cnn-loss.png; PROFILE=debug skips the release build
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
PROFILE=${PROFILE:-release}
flag=$([ "$PROFILE" = release ] && echo --release || true)
cargo build -q $flag --example cnn_ddp --bin tchrun
EPOCHS=${EPOCHS:-20}
PNG=${PNG:-docs/cnn-loss.png}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { "target/$PROFILE/tchrun" --standalone --nproc-per-node "$1" -- "target/$PROFILE/examples/cnn_ddp" --epochs "$EPOCHS" "${@:2}"; }
echo "== one process" >&2
run 1 --losses "$out/one" | tee "$out/one.log" >&2
echo "== 2 ranks, DDP + SyncBatchNorm" >&2
run 2 --losses "$out/sync" | tee "$out/sync.log" >&2
echo "== 2 ranks, DDP, each rank's batch norm its own" >&2
run 2 --losses "$out/local" --local-bn | tee "$out/local.log" >&2
for r in one sync local; do echo "$r: $(sed -n 's/^\[rank0\]: final //p' "$out/$r.log")"; done
"$TCH_DIST_PYTHON_BIN" - "$out" "$PNG" <<'PY'
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
out, png = sys.argv[1], sys.argv[2]
def load(n):
    return [tuple(float(x) for x in l.split()) for l in open(f"{out}/{n}") if l.strip()]
one, sync, local = load("one"), load("sync"), load("local")
for name, run in [("SyncBatchNorm", sync), ("local batch norm", local)]:
    d = [abs(a[1] - b[1]) for a, b in zip(one, run)]
    print(f"{name}: largest loss difference from one process {max(d):.2e} (first 10 steps {max(d[:10]):.2e})")
fig, ax = plt.subplots(figsize=(8, 4.5))
ax.plot([s for s, _ in one], [l for _, l in one], label="1 process, tch's BatchNorm", linewidth=3, alpha=0.5)
ax.plot([s for s, _ in sync], [l for _, l in sync], label="2 ranks, DDP + SyncBatchNorm", linestyle="--")
ax.plot([s for s, _ in local], [l for _, l in local], label="2 ranks, DDP, per-rank batch norm", linestyle=":")
ax.set_xlabel("step (global batch 64)")
ax.set_ylabel("cross-entropy")
ax.set_yscale("log")
ax.set_title("ResNet (2 blocks, 16 channels), scikit-learn's 8x8 digits")
ax.legend()
fig.tight_layout()
fig.savefig(png, dpi=100)
print(f"chart: {png}")
PY
