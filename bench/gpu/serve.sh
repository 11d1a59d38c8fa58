#!/usr/bin/env bash
# The serving benchmark on the GPU machine: the whole cluster (etcd, cache server, CUDA
# worker(s), router) on 127.0.0.1, driven by sparsex-loadgen over the public gRPC API, for each
# mode (reuse on: segment reuse + exact prefix caching; reuse off: exact prefix caching only, as
# vLLM's automatic prefix caching) on a fresh cluster each, warmed up, then a sweep of arrival
# rates. Writes to $OUT: serve.log, serving_<workload>_<mode><tag>.json (loadgen summaries),
# metrics.txt (worker and cache-server counters after each sweep, appended).
#
# The binaries come staged from a Debian machine (bench/gpu/stage_serve.sh -> .stage/
# serve.tar.gz; the device call carries .stage). Knobs (environment):
#   SPX_SERVE_WORKLOADS   "rag"            rag | chat | agents | chatcap | agents64, space separated
#   SPX_SERVE_MODES       "off on"
#   SPX_SERVE_RATES_OFF   "1 2 4"          req/s per sweep point (reuse off)
#   SPX_SERVE_RATES_ON    "1 2 4 8"        req/s per sweep point (reuse on)
#   SPX_SERVE_REQUESTS    30               requests per sweep point
#   SPX_SERVE_WARMUP      16               closed-loop requests before the sweep (not measured)
#   SPX_SERVE_PRIME       2                rag: every pool document this many times before the
#                                          sweep (loadgen --prime; the GPU worker stores a
#                                          segment at its second miss), so the first point is warm
#   SPX_SERVE_MODEL       synthetic:llama3-8b
#   SPX_SERVE_WORKER_ARGS (GPU sizes: 256K tokens of paged KV, 30 GB device tier)
#   SPX_SERVE_LOADGEN_ARGS extra loadgen flags (all workloads; later flags win)
#   SPX_SERVE_TAG         ""               suffix of the JSON names (several runs in one $OUT)
#   SPX_SERVE_DEVICE      cuda             (cpu: a local smoke run of this script)
#   SPX_SERVE_CACHE_MEMORY 32G             the cache server's memory arena
#   SPX_SERVE_SECURE      0                1: the cluster with its default credentials (mutual TLS,
#                                          API keys, tenant scopes; docs/security.md), the loadgen
#                                          sending the API key; 0: cluster.sh --insecure
#   SPX_SERVE_PACK        0                1: at the end, the serving_*.json records are added to
#                                          $OUT/serving_records.tar (a device call returns at
#                                          most 8 files; several runs in one call exceed it)
#
#   OUT=/tmp/out bench/gpu/serve.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=serve
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader; nproc; free -g | head -2; } >>"$LOG" 2>&1

MODEL=${SPX_SERVE_MODEL:-synthetic:llama3-8b}
WORKER_ARGS=${SPX_SERVE_WORKER_ARGS:---kv_blocks 16384 --prefill_chunk 4096 --device_tier_mb 30000 --host_store_mb 16000}
REQS=${SPX_SERVE_REQUESTS:-30}
WARM=${SPX_SERVE_WARMUP:-16}

workload_args() {  # 8-16K-token prompts of random token ids (the synthetic model's tokenizer)
  case "$1" in
    rag) echo "--workload rag --pool 32 --zipf 1.0 --docs_per_request 4 --doc_tokens 2000 --question_tokens 64 --pool_seed 7" ;;
    chat) echo "--workload chat --sessions 16 --system_tokens 1024 --turn_tokens 1500 --max_history_tokens 12000" ;;
    agents) echo "--workload agents --agents 8 --shared_tokens 8000 --instr_tokens 512 --turn_tokens 400 --max_history_tokens 4000" ;;
    # Chat whose history window slides: 4 sessions reach the 8000-token cap within the warmup,
    # so from then on every turn drops the oldest pair and the history is no longer a prefix.
    chatcap) echo "--workload chat --sessions 4 --system_tokens 1024 --turn_tokens 2000 --max_history_tokens 8000" ;;
    # Many agents, each speaking rarely: an agent's own prefix (instructions + shared context) is
    # evicted before its next turn; the shared 8000-token context is common to all of them.
    agents64) echo "--workload agents --agents 64 --shared_tokens 8000 --instr_tokens 512 --turn_tokens 400 --max_history_tokens 4000" ;;
  esac
}

RUN=/tmp/spx-run
for wl in ${SPX_SERVE_WORKLOADS:-rag}; do
  for mode in ${SPX_SERVE_MODES:-off on}; do
    rates=${SPX_SERVE_RATES_ON:-1 2 4 8}
    [ "$mode" = off ] && rates=${SPX_SERVE_RATES_OFF:-1 2 4}
    rm -rf "$RUN"
    stamp "$wl reuse $mode: cluster up"
    sec=(--insecure); [ "${SPX_SERVE_SECURE:-0}" = 1 ] && sec=()
    if ! SPARSEX_MODELS=/nonexistent timeout 300 "$SPX/cluster.sh" up "${sec[@]}" --run-dir "$RUN" --bin-dir "$SPX/bin" \
        --model "$MODEL" --device "${SPX_SERVE_DEVICE:-cuda}" --cache-servers 1 --cache-memory "${SPX_SERVE_CACHE_MEMORY:-32G}" --timeout 240 \
        --grpc-port 0 --http-port 0 --worker-args "$WORKER_ARGS" >>"$LOG" 2>&1; then
      stamp "cluster up failed"; tail -n 30 "$RUN"/*.log >>"$LOG" 2>&1
      "$SPX/cluster.sh" down --run-dir "$RUN" >>"$LOG" 2>&1; continue
    fi
    . "$RUN/cluster.env"
    sweep=$(echo $rates | tr ' ' ',')
    stamp "$wl reuse $mode: warmup $WARM, sweep $sweep x $REQS requests"
    # shellcheck disable=SC2046
    timeout 420 "$SPX/bin/sparsex-loadgen" --target "$ROUTER_GRPC" --reuse "$mode" $(workload_args "$wl") \
      --content numbers --max_tokens 32 --requests "$REQS" --warmup "$WARM" --sweep "$sweep" \
      --sweep_vary_seed --prime "${SPX_SERVE_PRIME:-2}" --timeout_ms 60000 --progress=false --out "$OUT/serving_${wl}_${mode}${SPX_SERVE_TAG:-}.json" \
      --api_key "${API_KEY:-}" \
      ${SPX_SERVE_LOADGEN_ARGS:-} >>"$LOG" 2>&1 || stamp "loadgen exit $?"
    { echo "## $wl reuse $mode ${SPX_SERVE_TAG:-}"; curl -s "http://$WORKER0_METRICS/metrics" | grep -E '^sparsex_worker_(fetch|fetched|segments|reused|recomputed|prefix|new|prompt|writeback|ttft_seconds_(sum|count)|queue|pending_stores|unspilled|stores_dropped|iterations|engine_|gate|reuse_disabled)' ;
      curl -s "http://$CACHE0_METRICS/metrics" | grep -E '^sparsex_cache_(memory|disk|hits|misses|evictions|corrupt|bytes)' ; } \
      | grep -v _bucket >>"$OUT/metrics.txt" 2>&1
    grep -h "cache cluster:\|error\|Error" "$RUN"/worker0.log | tail -n 5 >>"$LOG" 2>&1
    "$SPX/cluster.sh" down --run-dir "$RUN" >>"$LOG" 2>&1
  done
done
stamp "done"
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, glob, sys, os
print(f"{'workload':8} {'mode':9} {'rate':>5} {'ok':>4} {'err':>4} {'ttft50':>8} {'ttft99':>8} {'tpot50':>7} {'tpot99':>7} {'reused':>6} {'goodput':>7}")
for f in sorted(glob.glob(os.path.join(sys.argv[1], 'serving_*.json'))):
    recs = json.load(open(f))
    for r in (recs if isinstance(recs, list) else [recs]):
        g = lambda k: r.get(k) if r.get(k) is not None else float('nan')
        print(f"{r['workload']:8} {r['mode']:9} {g('rate'):5.1f} {r['completed']:4d} {r['errors']:4d} "
              f"{g('ttft_p50_ms'):8.0f} {g('ttft_p99_ms'):8.0f} {g('tpot_p50_ms'):7.1f} {g('tpot_p99_ms'):7.1f} "
              f"{g('reused_share'):6.2f} {str(r['goodput_ok']):>7}")
PY
if [ "${SPX_SERVE_PACK:-0}" = 1 ] && ls "$OUT"/serving_*.json >/dev/null 2>&1; then
  (cd "$OUT" && tar rf serving_records.tar serving_*.json && rm -f serving_*.json) &&
    stamp "records added to serving_records.tar"
fi
