#!/usr/bin/env bash
# Configures and builds SparseX into build/ (binaries in build/bin). Extra args go to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-2}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} "$@" >/dev/null
cmake --build build -j"$JOBS"
