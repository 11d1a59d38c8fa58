#!/usr/bin/env bash
# The main job: sets up, builds, starts a local SparseX cluster on 127.0.0.1 (etcd, a cache
# server, a worker on the CPU backend with stories260K, the router), runs a RAG workload
# (TinyStories documents drawn with Zipf popularity, in random order) through the public gRPC
# API, prints a table (TTFT with and without reuse, reused / recomputed / new tokens, fidelity
# against full prefill on a sample), then stops the cluster.
#
# Knobs (environment): DEMO_REQUESTS (60), DEMO_WORKERS (1), DEMO_POOL (40 documents),
# DEMO_ZIPF (1.1), DEMO_DOCS_PER_REQUEST (3), DEMO_MAX_TOKENS (24), DEMO_FIDELITY_EVERY (3),
# DEMO_DEVICE (cpu; cuda on a machine with a GPU and a CUDA build: the same cluster with a CUDA
# worker; docs/operations.md "Serving on the GPU machine" for the 8B serving benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export SPARSEX_MODELS=${SPARSEX_MODELS:-$(cd .. && pwd)/shared/models}
scripts/build.sh

export SPARSEX_RUN_DIR=${SPARSEX_RUN_DIR:-$(mktemp -d /tmp/sparsex-demo.XXXXXX)}
export SPARSEX_BIN_DIR=${SPARSEX_BIN_DIR:-$PWD/build/bin}
cleanup() { deploy/local/cluster.sh down --clean || true; }
trap cleanup EXIT

echo "== starting the local cluster (stories260K, ${DEMO_DEVICE:-cpu} backend)"
deploy/local/cluster.sh up --workers "${DEMO_WORKERS:-1}" --cache-servers 1 --device "${DEMO_DEVICE:-cpu}"
# shellcheck disable=SC1091
. "$SPARSEX_RUN_DIR/cluster.env"

echo "== RAG workload through the router (gRPC $ROUTER_GRPC; OpenAI HTTP on $ROUTER_HTTP)"
"$SPARSEX_BIN_DIR/sparsex-rag" --target "$ROUTER_GRPC" \
  --docs "$SPARSEX_MODELS/tinystories-text/tinystories_sample.txt" \
  --requests "${DEMO_REQUESTS:-60}" --pool "${DEMO_POOL:-40}" --zipf "${DEMO_ZIPF:-1.1}" \
  --docs_per_request "${DEMO_DOCS_PER_REQUEST:-3}" --max_tokens "${DEMO_MAX_TOKENS:-24}" \
  --fidelity_every "${DEMO_FIDELITY_EVERY:-3}" --json "$SPARSEX_RUN_DIR/rag.json"

echo "== one OpenAI-compatible request"
curl -sS "http://$ROUTER_HTTP/v1/completions" \
  -d '{"model":"stories260K","prompt":"Once upon a time","max_tokens":24,"temperature":0}'
echo
echo "== router metrics (excerpt)"
curl -sS "http://$ROUTER_HTTP/metrics" |
  grep -E '^sparsex_router_(requests_total|reused_tokens_total|new_tokens_total|recomputed_tokens_total|routing_decisions_total)' |
  grep -v ' 0$' || true
echo "== stopping the cluster"
