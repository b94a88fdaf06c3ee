#!/usr/bin/env bash
# Builds tch-dist against another libtorch than the default 2.13.0, leaving the repo's own Cargo.lock alone:
#   scripts/build-torch.sh 2.11.0 [cargo arguments...]      (default arguments: build --all-targets)
# e.g. scripts/build-torch.sh 2.11.0 build --features cuda --all-targets
# The venv for that torch comes from scripts/setup.sh; the tch version that pairs with it from
# locks/torch-<version>.lock (2.11.0 and 2.12.0: tch 0.24; 2.13.0 is the repo's own Cargo.lock). The build
# runs in target/torch-<version>/src, a copy of the working tree that keeps file times (so rebuilds are
# incremental); its binaries land in target/torch-<version>/src/target/.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/build-torch.sh TORCH_VERSION [cargo arguments...]}
shift
[ $# -gt 0 ] || set -- build --all-targets
lock=locks/torch-$version.lock
if [ "$version" != 2.13.0 ] && [ ! -f "$lock" ]; then
  echo "build-torch: no $lock: supported libtorch versions are 2.11.0, 2.12.0 and 2.13.0" >&2
  exit 2
fi
export TCH_DIST_TORCH_VERSION=$version
scripts/setup.sh
source scripts/env.sh
if [ "$version" = 2.12.0 ]; then
  # tch has no release for 2.12 (0.25 was never published); 0.24's bindings build against it.
  export LIBTORCH_BYPASS_VERSION_CHECK=1
fi
copy=target/torch-$version/src
mkdir -p "$copy"
# tracked and new files (not ignored ones), with their times
want=$(mktemp) have=$(mktemp)
trap 'rm -f "$want" "$have"' EXIT
git ls-files --cached --others --exclude-standard | sort >"$want"
tr '\n' '\0' <"$want" | xargs -0 cp -p --parents -t "$copy"
# files gone from the tree go from the copy too (a stale tests/x.rs would still be built)
(cd "$copy" && find . -path ./target -prune -o -type f -printf '%P\n' | sort) >"$have"
comm -23 "$have" "$want" | while IFS= read -r f; do rm -f "$copy/$f"; done
[ "$version" = 2.13.0 ] || cp -p "$lock" "$copy/Cargo.lock"
cd "$copy"
echo "build-torch: torch $version, $(grep -A1 '^name = "tch"$' Cargo.lock | tail -1 | tr -d ' ')" >&2
cargo "$@"
