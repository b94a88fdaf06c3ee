#!/usr/bin/env bash
# Sets up (first run: the torch venvs, ~3 min each) and runs every test: unit, integration (threads,
# processes, Python interop, parity with PyTorch), doc tests; the multi-rank suites again under the strict
# NCCL mode; then builds the `cuda` feature and runs the
# GPU tests, which print "skipped: no CUDA device" on a machine without one; builds everything against
# libtorch 2.11 too; and builds the GPU kit and rehearses it (scripts/gpu-kit.sh --rehearse).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh

echo "== rustfmt, clippy (default and cuda features), rustdoc: all clean"
cargo fmt --check
cargo clippy -q --all-targets -- -D warnings
cargo clippy -q --all-targets --features cuda -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc -q --no-deps

echo "== cargo test (default features)"
# Some tests run the examples (forum repro, training); build them first, whatever cargo test filters.
cargo build --examples
cargo test -- --skip cuda_

echo "== the multi-rank suites again in the strict NCCL mode (NCCL's ordering rules over Gloo's point-to-point)"
# Python peers speak plain Gloo, so the interop suites stay out; tests/strict_nccl.rs sets the mode itself.
strict_suites=(amp checkpoint checkpoint_reshard checkpoint_sharded clip collectives ddp ddp_join ddp_memory
  ddp_powersgd failures faults fsdp fsdp_memory gpt gpu_kit mesh mesh_3d pipeline pipeline_memory recompute tp
  tp_attention tp_sequence tp_vocab zero)
TCH_DIST_STRICT_NCCL=1 cargo test "${strict_suites[@]/#/--test=}" -- --skip cuda_

echo "== cuda feature: build and link every target, run the GPU tests"
cargo build --features cuda --all-targets
cargo test --features cuda --test cuda -- --nocapture

echo "== libtorch 2.11 (tch 0.24): build the crate, every target, with the cuda feature"
scripts/build-torch.sh 2.11.0 build --features cuda --all-targets

echo "== GPU kit: built for the lent GPU machine's torch (2.11.0), rehearsed here without cargo"
scripts/gpu-kit.sh --rehearse
