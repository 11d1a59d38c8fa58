#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds everything and runs the whole test suite (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export SPARSEX_MODELS=${SPARSEX_MODELS:-$(cd .. && pwd)/shared/models}
# The real-client tests (npm openai, @grpc/grpc-js) fail rather than skip when npm cannot
# install their packages: a suite that passes has run them. SPARSEX_REQUIRE_NPM=0 offline.
export SPARSEX_REQUIRE_NPM=${SPARSEX_REQUIRE_NPM:-1}
scripts/build.sh
ctest --test-dir build --output-on-failure -j${JOBS:-2} --timeout 900
# The libFuzzer targets (tests/fuzz, clang with ASan + UBSan, a build of their own): each
# target's committed corpus, then 20 s of fuzzing from a fixed seed (docs/reliability.md).
scripts/fuzz.sh "${FUZZ_SECONDS:-20}"
# The sanitizer builds (scripts/sanitize.sh, gcc, CPU only): unit + e2e tests under ASan + UBSan
# (build-asan/), the concurrency tests under TSan (build-tsan/); ~25 minutes on 2 cores with a
# cold ccache (docs/reliability.md, "Sanitizers"). SANITIZE=0 skips them; SANITIZE=asan or tsan
# runs one.
case "${SANITIZE:-1}" in
  0) echo "test: sanitizers skipped (SANITIZE=0)";;
  1|all) scripts/sanitize.sh all;;
  *) scripts/sanitize.sh "$SANITIZE";;
esac
