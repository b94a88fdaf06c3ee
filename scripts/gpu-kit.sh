#!/usr/bin/env bash
# Builds the GPU kit on this (CPU) machine: stripped binaries with the `cuda` feature for the lent GPU
# machine's torch (2.11.0 unless --torch says otherwise), the PyTorch twins, and the runner, in one
# folder (gpu-kit/, ignored by git, at most 40 MiB) that needs nothing there but python3 with torch:
#   scripts/gpu-kit.sh [--torch 2.11.0] [--rehearse]
#   then, on the GPU machine: bash gpu-kit/run.sh     (the device tool: carry ["gpu-kit"])
# --rehearse then runs gpu-kit/run.sh here the way the GPU machine would: from a copy outside the
# repository, with that torch's python3 first on PATH and cargo out of reach. GPU checks say
# "SKIP ...: no CUDA device"; the kit's own checks (binaries load, PyTorch twins run, report written)
# must pass.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=2.11.0
rehearse=0
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) torch=${2:?--torch needs a version}; shift 2 ;;
    --rehearse) rehearse=1; shift ;;
    *) echo "gpu-kit: unknown argument $1" >&2; exit 2 ;;
  esac
done

echo "== gpu-kit: building for torch $torch (cuda feature)"
scripts/build-torch.sh "$torch" build --features cuda --example gpu_kit --example forum_repro --bin tchrun
built=target/torch-$torch/src/target/debug
kit=gpu-kit
rm -rf "$kit"
mkdir -p "$kit/bin" "$kit/py"
for b in examples/gpu_kit examples/forum_repro tchrun libtch_dist_memory.so; do
  strip -o "$kit/bin/$(basename "$b")" "$built/$b"
done
cp scripts/kit/run.sh scripts/kit/forum.sh "$kit/"
cp scripts/kit/torch_gpu.py scripts/forum_repro.py scripts/pyutil.py scripts/memory_ruler.py "$kit/py/"
echo "tch-dist $(git describe --always --dirty 2>/dev/null || echo unknown), built for torch $torch on $(date -u +%Y-%m-%d)" >"$kit/VERSION"
size=$(du -sk "$kit" | cut -f1)
echo "gpu-kit: $kit/ is $((size / 1024)) MiB ($size KiB): $(ls "$kit/bin" | tr '\n' ' ')"
if [ "$size" -gt $((40 * 1024)) ]; then
  echo "gpu-kit: FAIL: larger than 40 MiB" >&2
  exit 1
fi

[ $rehearse = 1 ] || exit 0
echo "== gpu-kit: rehearsal (a copy outside the repository, torch $torch's python3, no cargo)"
TCH_DIST_TORCH_VERSION=$torch
source scripts/env.sh
away=$(mktemp -d)
trap 'rm -rf "$away"' EXIT
cp -r "$kit" "$away/gpu-kit"
mkdir -p "$away/out"
# What the GPU machine has: python3 with torch, coreutils; no cargo, no repository, no target/.
(cd "$away" && env -i HOME="$HOME" PATH="$TCH_DIST_VENV/bin:/usr/bin:/bin" OUT="$away/out" bash gpu-kit/run.sh) || {
  echo "gpu-kit: FAIL: the rehearsal failed" >&2
  exit 1
}
report=$away/out/gpu-kit-report.txt
[ -s "$report" ] || { echo "gpu-kit: FAIL: no report written" >&2; exit 1; }
# On a machine without a GPU every GPU check must say so, not pass.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  for c in nccl-refuses-cpu-tensors ddp-views-on zero2 async-wait streams sync-free-steps gloo-2proc-ddp-views-on \
    gloo-2proc-ddp-views-off gloo-2proc-zero2 gloo-2proc-fsdp-prefetch gloo-2proc-fsdp-offload \
    gloo-2proc-fsdp-no-reshard gloo-2proc-pipeline-1f1b gloo-2proc-sync-bn \
    gloo-2proc-tp-attention-dropout forum-cuda bench-ddp; do
    grep -q "^SKIP $c: no CUDA device" "$report" || { echo "gpu-kit: FAIL: $c did not report 'SKIP $c: no CUDA device'" >&2; exit 1; }
  done
  for c in selfcheck python-torch tchrun forum-cpu; do
    grep -q "^PASS $c" "$report" || { echo "gpu-kit: FAIL: $c did not pass" >&2; exit 1; }
  done
fi
# The kit's checks with the CPU standing in for the GPU, on this torch: every comparison runs here too.
torchlib=$("$TCH_DIST_PYTHON_BIN" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
for c in $(LD_LIBRARY_PATH=$torchlib "$away/gpu-kit/bin/gpu_kit" list); do
  line=$(LD_LIBRARY_PATH=$torchlib "$away/gpu-kit/bin/gpu_kit" check "$c" --device cpu) || true
  echo "  cpu stand-in: $line"
  case "$line" in PASS*|SKIP*) ;; *) echo "gpu-kit: FAIL: $c with the CPU standing in" >&2; exit 1 ;; esac
done
grep -q "^NOT COVERED on one GPU: NCCL with 2+ ranks" "$report" || { echo "gpu-kit: FAIL: the report does not say what one GPU cannot show" >&2; exit 1; }
echo "gpu-kit: rehearsal passed; report:"
sed 's/^/  /' "$report"
