# Sourced by the benchmark scripts (scripts/bench-*.sh): the driver they share for the build, the runs,
# the rounds and the report. Each script keeps what it measures; this file keeps how.
#   bench_init [--memory-lib] EXAMPLE...
#       cd to the repository root, scripts/setup.sh, source scripts/env.sh, cargo build --release of the
#       examples and tchrun; --memory-lib: export TCH_DIST_MEMORY_LIB (the counting allocator, the CPU
#       ruler that PyTorch's processes load through ctypes)
#   bench_out [CLEANUP]
#       $out: a temp folder of run files, removed at exit after CLEANUP (a command, run at exit too);
#       KEEP=DIR: DIR instead (new, empty, or one a benchmark made), its files removed first and the
#       new ones kept
#   run NAME WORLD CMD...
#       WORLD ranks of CMD under tchrun; rank 0's output appended to $out/NAME (one line per round)
#   bench_rounds [-q] FN ARGS...
#       FN R ARGS... for each round R of $ROUNDS, after "round R/ROUNDS" on stderr (-q: FN says it)
#   alternate R CMD...
#       the commands (strings, run by eval) in the order given in odd rounds, reversed in even ones, so
#       that neither side always goes first
#   bench_report "$out" ARGS... <<'PY' ... PY
#       the Python on stdin with those arguments, scripts/ on its path: it imports the reading, median and
#       table helpers from scripts/benchlib.py
# shellcheck shell=bash

bench_init() {
  local memory_lib=0 build=(--bin tchrun) arg
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
  scripts/setup.sh
  # shellcheck source-path=SCRIPTDIR source=env.sh
  source scripts/env.sh
  for arg in "$@"; do
    if [ "$arg" = --memory-lib ]; then memory_lib=1; else build+=(--example "$arg"); fi
  done
  cargo build -q --release "${build[@]}"
  if ((memory_lib)); then
    export TCH_DIST_MEMORY_LIB=$PWD/target/release/libtch_dist_memory.so
  fi
}

bench_out() {
  if [ -n "${KEEP:-}" ]; then
    out=$KEEP
    # only a folder a benchmark made (marked) or an empty one is emptied: never a folder of the user's
    if [ -d "$out" ] && [ ! -e "$out/.bench-keep" ] && [ -n "$(ls -A "$out")" ]; then
      echo "KEEP=$out: not empty and not a benchmark's folder; give a new or empty folder" >&2
      exit 1
    fi
    mkdir -p "$out"
    find "$out" -maxdepth 1 -type f ! -name .bench-keep -delete
    touch "$out/.bench-keep"
    # shellcheck disable=SC2064  # CLEANUP is the caller's command, fixed now
    trap "${1:-:}" EXIT
  else
    out=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "${1:-:}"'; rm -rf "$out"' EXIT
  fi
}

run() {
  local name=$1 world=$2
  shift 2
  ranks "$world" "$@" >>"$out/$name"
}

bench_rounds() {
  local quiet=0 r
  if [ "$1" = -q ]; then
    quiet=1
    shift
  fi
  for r in $(seq "$ROUNDS"); do
    ((quiet)) || echo "round $r/$ROUNDS" >&2
    "$1" "$r" "${@:2}"
  done
}

alternate() {
  local r=$1 i
  shift
  if ((r % 2)); then
    for ((i = 1; i <= $#; i++)); do eval "${!i}"; done
  else
    for ((i = $#; i >= 1; i--)); do eval "${!i}"; done
  fi
}

bench_report() {
  PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" "$TCH_DIST_PYTHON_BIN" - "$@"
}
