#!/usr/bin/env bash
# Sets up (first run: the torch venv, ~3 min) and runs every test: unit, integration (threads, processes,
# Python interop, parity with PyTorch), doc tests; then builds the `cuda` feature and runs the GPU tests,
# which print "skipped: no CUDA device" on a machine without one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh

echo "== cargo test (default features)"
# Some tests run the examples (forum repro, training); build them first, whatever cargo test filters.
cargo build --examples
cargo test -- --skip cuda_

echo "== cuda feature: build and link every target, run the GPU tests"
cargo build --features cuda --all-targets
cargo test --features cuda --test cuda -- --nocapture

echo "== scripts/gpu-check.sh (reports whether a GPU is present)"
scripts/gpu-check.sh
