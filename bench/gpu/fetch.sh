#!/usr/bin/env bash
# Segment KV across workers on the GPU machine: two CUDA workers on the one GPU
# and one cache server. Worker A serves a 32K-token RAG prompt (8 documents of 4000 tokens + a
# 256-token question) and stores the documents; their KV is copied to the host store and
# written back to the cache server. Then A is killed (kill -9), so the router can only send the
# same documents, in other orders, to B: B's first request fetches the 8 segments from the cache
# server before its reuse prefill (--fetch_wait_ms -1: it waits for the whole fetch, or, with
# --cache_fetch_stream, the default, only for its start); its later
# ones find them in its own tiers. B has served two requests on other documents before the fetch
# (warm, like a worker in service). Reported: B's worker TTFT with the fetch vs from its own GPU
# tier (target: at most 1.3x), the fetched bytes and the transfer rate, and a reuse-off (full
# prefill) request on B as the baseline of the same call.
# Writes to $OUT: fetch.log, fetch_<step>.json(l) (loadgen summaries and records), fetch.json,
# metrics.txt (B's and the cache server's counters).
#
#   OUT=/tmp/out bench/gpu/fetch.sh
# Knobs: SPX_FETCH_DEVICE (cuda), SPX_FETCH_MODEL (synthetic:llama3-8b), SPX_FETCH_DOC_TOKENS
# (4000), SPX_FETCH_CACHE_MEMORY (32G), SPX_FETCH_WORKER_ARGS (below), SPX_FETCH_LOADGEN_ARGS
# (extra loadgen flags), SPX_FETCH_SECURE (0; 1: the cluster's default credentials, mutual TLS
# on the control plane and API keys, docs/security.md). A CPU
# smoke run of the script: SPX_FETCH_DEVICE=cpu SPX_FETCH_MODEL=synthetic:tiny
# SPX_FETCH_DOC_TOKENS=600 SPX_FETCH_CACHE_MEMORY=2G SPX_FETCH_LOADGEN_ARGS="--min_id 3
# --max_id 900" (the default 32G arena does not fit a small machine: the cache server is
# killed, and the shared-memory file UCX made for its arena stays in /dev/shm until removed).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=fetch
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS

# Two workers share the GPU: 64K tokens of paged KV and a 12 GB device tier each.
WORKER_ARGS=${SPX_FETCH_WORKER_ARGS:---kv_blocks 4096 --prefill_chunk 4096 --device_tier_mb 12000 --host_store_mb 20000 --fetch_wait_ms -1 --store_after_misses 1}
RUN=/tmp/spx-fetch-run
rm -rf "$RUN"
stamp "cluster up: 2 workers, 1 cache server"
sec=(--insecure); [ "${SPX_FETCH_SECURE:-0}" = 1 ] && sec=()
if ! SPARSEX_MODELS=/nonexistent timeout 300 "$SPX/cluster.sh" up "${sec[@]}" --run-dir "$RUN" --bin-dir "$SPX/bin" \
    --model "${SPX_FETCH_MODEL:-synthetic:llama3-8b}" --device "${SPX_FETCH_DEVICE:-cuda}" --workers 2 --cache-servers 1 --cache-memory "${SPX_FETCH_CACHE_MEMORY:-32G}" \
    --timeout 240 --grpc-port 0 --http-port 0 --worker-args "$WORKER_ARGS" >>"$LOG" 2>&1; then
  stamp "cluster up failed"; tail -n 30 "$RUN"/*.log >>"$LOG" 2>&1
  "$SPX/cluster.sh" down --run-dir "$RUN" >>"$LOG" 2>&1; exit 1
fi
. "$RUN/cluster.env"

# One request per step; the pool holds exactly the 8 documents, each request sends all 8 in
# an order its seed draws.
send() {  # step seed reuse [pool-seed]
  timeout 120 "$SPX/bin/sparsex-loadgen" --target "$ROUTER_GRPC" --reuse "$3" --workload rag \
    --pool 8 --docs_per_request 8 --doc_tokens "${SPX_FETCH_DOC_TOKENS:-4000}" --question_tokens 256 --pool_seed "${4:-5}" \
    --seed "$2" --content numbers --max_tokens 8 --concurrency 1 --requests 1 --timeout_ms 100000 \
    --progress=false --out "$OUT/fetch_$1.json" --records "$OUT/fetch_$1.jsonl" --api_key "${API_KEY:-}" \
    ${SPX_FETCH_LOADGEN_ARGS:-} >>"$LOG" 2>&1 ||
    stamp "loadgen $1 exit $?"
}
metric() {  # metrics-address name-regex: the sum of the matching samples
  curl -s "http://$1/metrics" | grep -E "^$2" | awk '{s += $NF} END {print s + 0}'
}
wait_written_back() {  # metrics-address: until 8 segments are written back and none is left
  # unspilled (at most 120 s); sets ok and left
  for _ in $(seq 1 120); do
    ok=$(metric "$1" 'sparsex_worker_writeback_total\{result="ok"')
    left=$(metric "$1" 'sparsex_worker_unspilled_segments')
    [ "${ok%.*}" -ge 8 ] && [ "${left%.*}" -eq 0 ] && break
    sleep 1
  done
}
# One warm request only: a second one may be routed to B (load), which would then compute and
# store the documents itself.
send warm1 1 on
A=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readline())['worker'])" "$OUT/fetch_warm1.jsonl")
stamp "warmed on $A"
case "$A" in worker-0) AI=0; BI=1 ;; *) AI=1; BI=0 ;; esac
AM=$(eval echo "\$WORKER${AI}_METRICS"); BM=$(eval echo "\$WORKER${BI}_METRICS")
AP=$(eval echo "\$WORKER${AI}_PID")
# The spill to the host store runs when A is idle; the write-back follows it.
wait_written_back "$AM"
stamp "A wrote back $ok segments ($left unspilled); cache server: $(metric "$CACHE0_METRICS" 'sparsex_cache_used_bytes') bytes; B holds $(metric "$BM" 'sparsex_worker_host_segments') segments"
kill -9 "$AP"
stamp "A (pid $AP) killed"
for _ in $(seq 1 30); do
  curl -s "http://$ROUTER_HTTP/healthz" | grep -q '"healthy_workers":1' && break
  sleep 0.5
done
# B warms up on 8 other documents first (a computing and a reusing request, then its spill and
# write-back), so the fetch request below pays for the fetch, not for B's first requests ever
# (cuBLAS and allocator warm-up: a cold worker's first 32K prefill took ~0.7 s more).
send warmB1 11 on 6
send warmB2 12 on 6
wait_written_back "$BM"
stamp "B warmed: wrote back $ok segments ($left unspilled)"
fb0=$(metric "$BM" 'sparsex_worker_fetch_bytes_total'); fs0=$(metric "$BM" 'sparsex_worker_fetch_seconds_sum')
fi0=$(metric "$BM" 'sparsex_worker_fetch_in_place_bytes_total')
send fetch 3 on
fb1=$(metric "$BM" 'sparsex_worker_fetch_bytes_total'); fs1=$(metric "$BM" 'sparsex_worker_fetch_seconds_sum')
fi1=$(metric "$BM" 'sparsex_worker_fetch_in_place_bytes_total')
for s in 4 5 6; do send "tier$s" "$s" on; done
send full 7 off
curl -s "http://$BM/metrics" | grep -E '^sparsex_worker_(fetch|fetched|segments|streamed|stream_restarts|stream_seconds|stream_memory|engine_seconds|host_segments|writeback|gate|queue)' | grep -v _bucket >>"$OUT/metrics.txt"
grep -h "cache cluster\|fetch\|error" "$RUN"/worker*.log | tail -n 20 >>"$LOG" 2>&1
curl -s "http://$CACHE0_METRICS/metrics" | grep -E '^sparsex_cache_' | grep -v _bucket >>"$OUT/metrics.txt"
"$SPX/cluster.sh" down --run-dir "$RUN" >>"$LOG" 2>&1
python3 - "$OUT" "$A" "$fb0" "$fb1" "$fs0" "$fs1" "$fi0" "$fi1" <<'PY' | tee -a "$LOG"
import json, os, sys, statistics
out, a = sys.argv[1], sys.argv[2]
fb0, fb1, fs0, fs1, fi0, fi1 = map(float, sys.argv[3:9])
def rec(step):
    p = os.path.join(out, f"fetch_{step}.jsonl")
    return json.loads(open(p).readline()) if os.path.exists(p) else None
r = {"model": os.environ.get("SPX_FETCH_MODEL", "synthetic:llama3-8b"), "warmed_on": a, "steps": {}}
for step in ["warm1", "warmB1", "warmB2", "fetch", "tier4", "tier5", "tier6", "full"]:
    x = rec(step)
    if not x: continue
    u = x.get("usage") or {}
    r["steps"][step] = {"worker": x.get("worker"), "code": x.get("code"), "ttft_ms": x.get("ttft_ms"),
                        "worker_ttft_ms": u.get("worker_ttft_ms"), "queue_ms": u.get("queue_ms"),
                        "prompt_tokens": u.get("prompt_tokens"), "reused_tokens": u.get("reused_tokens"),
                        "segments_fetched": u.get("segments_fetched"), "fetch_failures": u.get("fetch_failures"),
                        "segments_streamed": u.get("segments_streamed"),
                        "stream_wait_ms": u.get("stream_wait_ms"), "stream_upload_ms": u.get("stream_upload_ms")}
tier = [r["steps"][s]["worker_ttft_ms"] for s in ("tier4", "tier5", "tier6")
        if s in r["steps"] and r["steps"][s]["worker_ttft_ms"]]
f = r["steps"].get("fetch", {}).get("worker_ttft_ms")
r["fetch_bytes"] = fb1 - fb0
r["in_place_bytes"] = fi1 - fi0  # landed in the pinned block with no decode copy
r["fetch_seconds"] = fs1 - fs0
r["fetch_gb_per_s"] = (fb1 - fb0) / (fs1 - fs0) / 1e9 if fs1 > fs0 else None
if tier and f:
    r["tier_ttft_median_ms"] = statistics.median(tier)
    r["fetch_over_tier"] = f / statistics.median(tier)
json.dump(r, open(os.path.join(out, "fetch.json"), "w"), indent=1)
print(json.dumps(r, indent=1))
PY
stamp "done"
