# Sourced by every script: where the torch venv lives and what the build and the binaries need.
# Override TCH_DIST_CACHE to move the venv (default: ~/.cache/tch-dist, or $XDG_CACHE_HOME/tch-dist).
# TCH_DIST_TORCH_VERSION picks the libtorch (2.13.0 by default; 2.11.0 and 2.12.0 are supported, each in a
# venv of its own; the tch version that pairs with it is chosen by scripts/torch-version.sh).
export TCH_DIST_TORCH_VERSION=${TCH_DIST_TORCH_VERSION:-2.13.0}
TCH_DIST_SETUP_VERSION=4
export TCH_DIST_CACHE=${TCH_DIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tch-dist}
export TCH_DIST_VENV=$TCH_DIST_CACHE/venv-torch-$TCH_DIST_TORCH_VERSION
export TCH_DIST_PYTHON_BIN="$TCH_DIST_VENV/bin/python"
# torch-sys finds libtorch through the venv's python (LIBTORCH_USE_PYTORCH), so the venv goes first on PATH.
export VIRTUAL_ENV="$TCH_DIST_VENV"
export PATH="$TCH_DIST_VENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
unset LIBTORCH LIBTORCH_LIB LIBTORCH_INCLUDE 2>/dev/null || true
# Two cores: keep the build from starving the test processes it spawns.
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

# Starting ranks: every script goes through tchrun (build it first: cargo build [--release] --bin tchrun).
#   ranks N CMD...      N ranks of CMD on this machine; rank 0's output, without tchrun's "[rank0]: " prefix
#   ranks_all N CMD...  every rank's output, prefixes removed
# TCHRUN picks the binary (default target/release/tchrun).
ranks() {
  local n=$1; shift
  "${TCHRUN:-target/release/tchrun}" --standalone --nproc-per-node "$n" -- "$@" | sed -n 's/^\[rank0\]: //p'
}
ranks_all() {
  local n=$1; shift
  "${TCHRUN:-target/release/tchrun}" --standalone --nproc-per-node "$n" -- "$@" | sed -E 's/^\[rank[0-9]+\]: //'
}
