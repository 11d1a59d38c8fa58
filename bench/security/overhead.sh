#!/usr/bin/env bash
# What credentials cost (docs/security.md, "Overhead"): the same closed-loop RAG load against a
# local cluster with its default credentials (API keys, tenant scopes, mutual TLS between router,
# workers and cache server) and without (--insecure), alternated ROUNDS times in one run, over
# the public gRPC API and the OpenAI HTTP API. Prints one summary line per point and writes the
# loadgen summaries to OUT (JSON lines).
#
#   bench/security/overhead.sh [ROUNDS=2] [REQUESTS=300] [CONCURRENCY=4] [OUT=overhead.jsonl]
# The shapes fit stories260K (vocabulary 512, context 512): gRPC: 3 documents of 96 token ids and
# a 16-token question a request (MAX_ID bounds the ids, default 512); HTTP: 2 TinyStories
# paragraphs of ~250 characters pasted into chat messages.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
ROUNDS=${1:-2}; REQUESTS=${2:-300}; CONC=${3:-4}; OUT=${4:-overhead.jsonl}
BIN=${SPARSEX_BIN_DIR:-$ROOT/build/bin}
: >"$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for mode in secure insecure; do
    RUN=$(mktemp -d /tmp/spx-overhead-XXXXXX)
    flag=(); [ "$mode" = insecure ] && flag=(--insecure)
    SPARSEX_RUN_DIR=$RUN SPARSEX_BIN_DIR=$BIN "$ROOT/deploy/local/cluster.sh" up --workers 1 \
      --cache-servers 1 --grpc-port 0 --http-port 0 "${flag[@]}" >/dev/null 2>&1
    # shellcheck disable=SC1091
    . "$RUN/cluster.env"
    for api in grpc openai; do
      target=$ROUTER_GRPC; [ "$api" = openai ] && target=$ROUTER_HTTP
      s="$RUN/$api.json"
      shape=(--workload rag --min_id 3 --max_id "${MAX_ID:-512}" --doc_tokens 96
             --docs_per_request 3 --question_tokens 16)
      [ "$api" = openai ] && shape=(--workload textrag --doc_chars 250 --docs_per_request 2)
      "$BIN/sparsex-loadgen" --target "$target" --api "$api" "${shape[@]}" \
        --concurrency "$CONC" --requests "$REQUESTS" --warmup 10 --max_tokens 8 \
        --api_key "${API_KEY:-}" --out "$s" >"$RUN/$api.log" 2>&1 ||
        echo "loadgen exited $? (log: $RUN/$api.log)" >&2
      python3 - "$s" "$mode" "$api" "$r" >>"$OUT" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
s = s[0] if isinstance(s, list) else s
print(json.dumps({"mode": sys.argv[2], "api": sys.argv[3], "round": int(sys.argv[4]), "summary": s}))
PY
      python3 - "$s" "$mode" "$api" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
s = s[0] if isinstance(s, list) else s
def g(*ks):
    for k in ks:
        if k in s: return s[k]
    return None
print("%-8s %-6s completed %s errors %s  rate %.2f req/s  TTFT p50 %s p99 %s ms" % (
    sys.argv[2], sys.argv[3], g("completed"), g("errors", "failed"),
    g("completed_rate", "throughput_rps", "rate") or 0.0,
    g("ttft_p50_ms"), g("ttft_p99_ms")))
PY
    done
    SPARSEX_RUN_DIR=$RUN "$ROOT/deploy/local/cluster.sh" down --clean >/dev/null 2>&1
  done
done
