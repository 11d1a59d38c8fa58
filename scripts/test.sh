#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds everything and runs the whole test suite (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export SPARSEX_MODELS=${SPARSEX_MODELS:-$(cd .. && pwd)/shared/models}
scripts/build.sh
ctest --test-dir build --output-on-failure -j${JOBS:-2} --timeout 900
