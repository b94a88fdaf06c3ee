#!/usr/bin/env bash
# Creates (once) the Python venv that provides libtorch (2.13.0, or $TCH_DIST_TORCH_VERSION) for tch and the reference PyTorch for the
# parity tests. It lives outside the repo so every clone (CI's fresh one included) reuses the 4.7 GB install.
# Idempotent: a stamp file records a finished install; a second run returns in well under a second.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=env.sh
source "$here/env.sh"

stamp="$TCH_DIST_VENV/.tch-dist-setup-$TCH_DIST_SETUP_VERSION"
if [ -f "$stamp" ]; then
  exit 0
fi

echo "setup: creating venv with torch==$TCH_DIST_TORCH_VERSION in $TCH_DIST_VENV (first run only, ~3 min)" >&2
mkdir -p "$(dirname "$TCH_DIST_VENV")"
py=${TCH_DIST_PYTHON:-python3}
if [ ! -x "$TCH_DIST_VENV/bin/python" ]; then
  "$py" -m venv "$TCH_DIST_VENV"
fi
"$TCH_DIST_VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch: libtorch for tch and the reference implementation for parity tests.
# nvidia-cuda-crt / nvidia-cuda-cccl: header-only wheels torch does not pull in, needed to compile the
# NCCL part of the shim (`--features cuda`); small, so installed always and CI can build that feature.
# numpy, scikit-learn: data for the training example (the 8x8 digits ship inside scikit-learn).
# safetensors: to show that PyTorch users can open our checkpoints.
# matplotlib: the benchmark charts (scripts/bench-memory.sh).
# transformers (pinned): the Hugging Face checkpoint parity tests (tests/models/hf.rs) build, save and run
# a tiny Llama with it.
"$TCH_DIST_VENV/bin/python" -m pip install -q \
  "torch==$TCH_DIST_TORCH_VERSION" \
  "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85" \
  numpy scikit-learn safetensors matplotlib "transformers==5.23.0"
"$TCH_DIST_VENV/bin/python" - <<'PY'
import torch, torch.distributed as dist
import os
want = os.environ["TCH_DIST_TORCH_VERSION"]
assert torch.__version__.split("+")[0] == want, (torch.__version__, want)
assert dist.is_gloo_available()
PY
touch "$stamp"
echo "setup: done" >&2
