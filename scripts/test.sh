#!/usr/bin/env bash
# Sets up (first run: the torch venvs, ~3 min each) and runs every test: unit, integration (threads,
# processes, Python interop, parity with PyTorch), doc tests, Rust's multi-rank suites under the strict
# NCCL mode; then runs the `cuda` feature's GPU tests, which print "skipped: no CUDA device" on a machine
# without one; compiles every target against libtorch 2.11 too; and builds the GPU kit for it and
# rehearses it (scripts/gpu-kit.sh --rehearse).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh

echo "== rustfmt, clippy (default and cuda features), rustdoc, import circles: all clean"
cargo fmt --check
cargo clippy -q --all-targets -- -D warnings
# the libraries as a user's crate gets them: without the tests' features (testing, plot)
cargo clippy -q --lib -p tch-dist -p tch-dist-sys -- -D warnings
cargo clippy -q --all-targets --features cuda -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc -q --no-deps
# the layers stay layers: no file of src/ reaches back to itself through its imports
python3 scripts/import_circles.py

echo "== cargo test (default features), every multi-rank suite in the strict NCCL mode"
# Some tests run the examples (forum repro, training); build them first, whatever cargo test filters.
cargo build --bins --examples
# One test binary per area (tests/<area>/main.rs, a module per file; tests/cuda.rs needs the cuda feature).
# The strict mode (NCCL's ordering rules over Gloo's point-to-point) is what CI runs Rust's ranks under.
# Python peers speak plain Gloo, so the interop binary runs plain; collectives (with failures) runs in both
# modes (plain point-to-point, its agreement checks); tests/training/strict_nccl.rs compares the two itself.
plain_suites=(interop)
both_suites=(collectives)
strict_suites=()
for f in tests/*/main.rs; do
  n=$(basename "$(dirname "$f")")
  [[ " ${plain_suites[*]} " == *" $n "* ]] || strict_suites+=("--test=$n")
done
TCH_DIST_STRICT_NCCL=1 cargo test --lib --bins "${strict_suites[@]}" -- --skip cuda_
plain=("${plain_suites[@]}" "${both_suites[@]}")
cargo test "${plain[@]/#/--test=}" -- --skip cuda_
cargo test --doc

echo "== production runs on NCCL, modelled on Gloo: the strict mode, agreement checks at each kind's first use only"
echo "   (TCH_DIST_VERIFY=once: checks never act as barriers that hide an order), NCCL's own flat collectives (no rings)"
# the modules (files) that run again so, in their area's binaries: every rank must decide alike
once_binaries=(collectives ddp sharding training pipeline tp)
once_modules=(collectives:: ddp:: zero:: clip:: fsdp:: pipeline:: context_parallel::ring_attention mesh:: parallel_dims::)
TCH_DIST_STRICT_NCCL=1 TCH_DIST_VERIFY=once TCH_DIST_COLLECTIVES=native \
  cargo test "${once_binaries[@]/#/--test=}" -- --skip cuda_ "${once_modules[@]}"

echo "== cuda feature: the GPU tests, linked against libtorch_cuda (clippy above compiled every target)"
cargo test --features cuda --test cuda -- --nocapture

echo "== libtorch 2.11 (tch 0.24): every target compiles with the cuda feature (the kit below links)"
scripts/build-torch.sh 2.11.0 check --features cuda --all-targets

echo "== GPU kit: built for the lent GPU machine's torch (2.11.0), rehearsed here without cargo"
scripts/gpu-kit.sh --rehearse
