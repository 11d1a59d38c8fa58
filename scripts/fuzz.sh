#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/, clang, ASan + UBSan) into build-fuzz/ and runs each:
# first its committed corpus (tests/fuzz/corpus/<name>/: seeds and regress-* inputs of fixed
# crashes) once, then fuzzing for a bounded time. Fails on any crash, sanitizer report, leak,
# timeout (10 s per input) or out-of-memory; the input that did it is left in $FUZZ_OUT.
#
#   scripts/fuzz.sh                  # every target, 20 s each (what scripts/test.sh runs)
#   scripts/fuzz.sh 600 gguf         # one target, 10 minutes
#   FUZZ_SEED=0 scripts/fuzz.sh 300  # a random seed (default 1: the same inputs every run)
#
# Environment: FUZZ_BUILD_DIR (build-fuzz), FUZZ_JOBS (targets at once, 2), FUZZ_SEED (1),
# FUZZ_OUT (build-fuzz/out: new corpus entries, crash inputs, logs), JOBS (build jobs, 2).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-20}
shift || true
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
OUT=${FUZZ_OUT:-$BUILD/out}
SEED=${FUZZ_SEED:-1}
PAR=${FUZZ_JOBS:-2}

command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (scripts/setup.sh installs it)"; exit 1; }
cmake -S tests/fuzz -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$BUILD" -j"${JOBS:-2}"

if [ $# -gt 0 ]; then
  TARGETS=("$@")
else
  TARGETS=()
  for f in tests/fuzz/*_fuzz.cc; do n=$(basename "$f" _fuzz.cc); TARGETS+=("$n"); done
fi
mkdir -p "$OUT"

run_one() {
  local name=$1 bin="$BUILD/${1}_fuzz" seeds="tests/fuzz/corpus/$1" work="$OUT/$1/corpus"
  local log="$OUT/$1/fuzz.log"
  mkdir -p "$work" "$OUT/$name/artifacts"
  local opts=(-timeout=10 -rss_limit_mb=2048 -max_len=65536 -seed="$SEED"
              -artifact_prefix="$OUT/$name/artifacts/" -print_final_stats=1)
  # detect_leaks: a loader that leaks on an error path is a finding too.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
  if ! "$bin" "${opts[@]}" -runs=0 "$seeds" >"$log" 2>&1; then
    echo "fuzz: $name: the committed corpus fails (see $log)"; tail -40 "$log"; return 1
  fi
  if ! "$bin" "${opts[@]}" -max_total_time="$SECONDS_PER_TARGET" "$work" "$seeds" >>"$log" 2>&1; then
    echo "fuzz: $name: FAILED (see $log; input in $OUT/$name/artifacts/)"; tail -60 "$log"; return 1
  fi
  local runs cov
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
  echo "fuzz: $name: ok, ${runs:-?} executions in ${SECONDS_PER_TARGET} s, $cov"
}

fail=0
pids=()
names=()
for t in "${TARGETS[@]}"; do
  [ -x "$BUILD/${t}_fuzz" ] || { echo "fuzz: no target $t"; exit 1; }
  run_one "$t" & pids+=($!); names+=("$t")
  if [ ${#pids[@]} -ge "$PAR" ]; then
    wait "${pids[0]}" || fail=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ $fail -ne 0 ]; then echo "fuzz: FAILED"; exit 1; fi
echo "fuzz: all ${#TARGETS[@]} targets passed"
