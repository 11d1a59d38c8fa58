#!/usr/bin/env bash
# The main job: sets up, builds, and runs SparseX on the small real model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export SPARSEX_MODELS=${SPARSEX_MODELS:-$(cd .. && pwd)/shared/models}
scripts/build.sh
MODEL="$SPARSEX_MODELS/stories260K/stories260K.gguf"
echo "== greedy generation with stories260K on the CPU backend"
build/bin/sparsex generate --model "$MODEL" --prompt "Once upon a time" --max-tokens 64 --temperature 0
