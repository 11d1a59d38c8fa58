#!/usr/bin/env bash
# The demo: RAG requests through a local SparseX cluster on 127.0.0.1 (etcd, a cache server, a
# worker on the CPU backend, the router), sent by scripts/demo_client.py over the router's
# OpenAI-compatible HTTP API. Each request is 3 documents drawn with Zipf popularity from a
# pool, in random order, each document a segment, then a fresh question; each is sent without
# reuse (full prefill, exact prefix cache only) and with reuse, on the same prompt. Two parts:
#   text       stories260K on TinyStories text: real text, and fidelity (the first token and
#              the 24-token greedy continuation compared with and without reuse).
#   synthetic  synthetic:demo (12 layers, random weights) on documents of random token ids: a
#              model large enough that prefill is most of the time to first token on 2 cores,
#              so the figures show what reuse saves (time to first token with and without
#              reuse, and the share of prompt tokens reused).
# The models are checked first, before anything is installed or built.
#
# Knobs (environment): DEMO_PARTS ("text synthetic"), SPARSEX_MODELS (../shared/models),
# DEMO_SETUP (1: run scripts/setup.sh), DEMO_BUILD (1: run scripts/build.sh),
# DEMO_DEVICE (cpu; cuda on a machine with a GPU and a CUDA build).
#   text:      DEMO_REQUESTS (12), DEMO_POOL (20 documents), DEMO_MAX_TOKENS (24)
#   synthetic: DEMO_SYN_REQUESTS (6), DEMO_SYN_POOL (6 documents), DEMO_SYN_DOC_TOKENS (700)
set -euo pipefail
cd "$(dirname "$0")/.."
export SPARSEX_MODELS=${SPARSEX_MODELS:-$(cd .. && pwd)/shared/models}
PARTS=${DEMO_PARTS:-text synthetic}

# ---- 1. the models, before anything else ---------------------------------------------------
if [[ " $PARTS " == *" text "* ]]; then
  missing=()
  for f in stories260K/stories260K.gguf tinystories-text/tinystories_sample.txt; do
    [ -s "$SPARSEX_MODELS/$f" ] || missing+=("$SPARSEX_MODELS/$f")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    cat >&2 <<EOF
demo: these files are missing (SPARSEX_MODELS=$SPARSEX_MODELS):
$(printf '  %s\n' "${missing[@]}")
Get them, or point SPARSEX_MODELS at a folder that has them (README.md, "Models"):
  stories260K/stories260K.gguf  Karpathy's 260K-parameter TinyStories model, e.g.
    mkdir -p $SPARSEX_MODELS/stories260K && curl -fL -o $SPARSEX_MODELS/stories260K/stories260K.gguf \\
      https://huggingface.co/ggml-org/models-moved/resolve/main/tinyllamas/stories260K.gguf
    (sha256 270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d)
  tinystories-text/tinystories_sample.txt  any English text with blank lines between paragraphs
    (the tests use the start of the TinyStories train split, roneneldan/TinyStories).
Or run only the part that needs no files:  DEMO_PARTS=synthetic scripts/demo.sh
EOF
    exit 2
  fi
fi

# ---- 2. packages and build -----------------------------------------------------------------
[ "${DEMO_SETUP:-1}" = 0 ] || scripts/setup.sh
[ "${DEMO_BUILD:-1}" = 0 ] || scripts/build.sh

export SPARSEX_BIN_DIR=${SPARSEX_BIN_DIR:-$PWD/build/bin}
export SPARSEX_INSECURE=1   # every process on 127.0.0.1: no certificates or API keys needed
DEVICE=${DEMO_DEVICE:-cpu}
BASE_RUN_DIR=${SPARSEX_RUN_DIR:-$(mktemp -d /tmp/sparsex-demo.XXXXXX)}
RUN_DIR=""
cleanup() { [ -z "$RUN_DIR" ] || SPARSEX_RUN_DIR=$RUN_DIR deploy/local/cluster.sh down || true; }
trap cleanup EXIT

up() {  # up NAME cluster.sh-args...: starts a cluster in its own run dir, reads cluster.env
  RUN_DIR="$BASE_RUN_DIR/$1"; shift
  SPARSEX_RUN_DIR=$RUN_DIR deploy/local/cluster.sh up --device "$DEVICE" "$@"
  # shellcheck disable=SC1091
  . "$RUN_DIR/cluster.env"
}
down() { SPARSEX_RUN_DIR=$RUN_DIR deploy/local/cluster.sh down; RUN_DIR=""; }

# ---- 3. stories260K on real text: fidelity ---------------------------------------------------
if [[ " $PARTS " == *" text "* ]]; then
  echo "== part 1: stories260K on TinyStories text (${DEVICE} backend): fidelity"
  up text --workers 1 --cache-servers 1
  python3 scripts/demo_client.py --http "$ROUTER_HTTP" --api-key "${API_KEY:-}" \
    --docs "$SPARSEX_MODELS/tinystories-text/tinystories_sample.txt" --pool "${DEMO_POOL:-20}" \
    --requests "${DEMO_REQUESTS:-12}" --compare-outputs "${DEMO_MAX_TOKENS:-24}" \
    --json "$BASE_RUN_DIR/text.json"
  down
fi

# ---- 4. a model where prefill dominates: the gain ------------------------------------------
if [[ " $PARTS " == *" synthetic "* ]]; then
  echo "== part 2: synthetic:demo (12 layers, ${DEVICE} backend): ${DEMO_SYN_POOL:-6} documents of ${DEMO_SYN_DOC_TOKENS:-700} tokens, 3 per request"
  # The correctness gate compares reuse with full prefill on sampled requests; on random
  # weights the logits are nearly flat, so it would disable reuse (docs/reliability.md).
  up synthetic --workers 1 --cache-servers 1 --model synthetic:demo --worker-args "--gate 0"
  python3 scripts/demo_client.py --http "$ROUTER_HTTP" --api-key "${API_KEY:-}" \
    --synthetic-docs "${DEMO_SYN_POOL:-6}" --doc-tokens "${DEMO_SYN_DOC_TOKENS:-700}" \
    --requests "${DEMO_SYN_REQUESTS:-6}" --json "$BASE_RUN_DIR/synthetic.json"
  down
fi
echo "== done (logs and JSON in $BASE_RUN_DIR)"
