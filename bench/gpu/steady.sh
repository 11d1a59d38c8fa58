#!/usr/bin/env bash
# At full size: reuse under a stream of new document orderings on the GPU machine.
# One CUDA worker (synthetic llama3-8b), one cache server and the router; sparsex-loadgen sends
# at least 1,000 RAG requests (Poisson arrivals), each 4 documents drawn with Zipf popularity
# from a pool of 64 x 2000 tokens plus a fresh 64-token question. The load generator draws
# every request's documents and their order from one seeded stream, so each request is a new
# random ordering (the analysis counts how many repeat). Every tier is bounded well below the
# pool's KV (2000 tokens of llama3-8b: 250 MiB in bf16 on the device tier, 500 MiB in fp32 in
# the host store; the pool: 16000 / 32000 MiB): device tier 3000 MiB, host store 6000 MiB, the
# cache server 4 GiB of memory and 4 GiB of disk. Reported per window of 100 requests (by send
# order): reused share ((reused + exact-prefix tokens) / prompt tokens, as
# tests/scheduler/steady_state_test.cc), TTFT p50 / p99, errors; the weakest window after the
# warm-up window over the best (must be >= 0.9); memory peaks (sampled every second from the
# worker's and the cache server's /metrics, and nvidia-smi) against their bounds.
# Writes to $OUT: steady.log, steady.json (bench/gpu/steady_windows.py analyze),
# steady_records.jsonl and steady_loadgen.json (loadgen), steady_memory.jsonl (samples),
# steady_orderings.txt (every request's documents in order, loadgen --dry_run), metrics.txt
# (counters at the end).
# Exit status: the analysis' (0: every check passed, 1: a check failed, 2: no records).
#
#   OUT=/tmp/out bench/gpu/steady.sh                  # GPU machine, staged bundle (.stage)
#
# Knobs (environment; defaults for cuda, then cpu):
#   SPX_STEADY_DEVICE       cuda                 cuda | cpu
#   SPX_STEADY_MODEL        synthetic:llama3-8b  synthetic:tiny
#   SPX_STEADY_BIN          ""                   a local bin dir (binaries of a local build, this
#                                                tree's deploy/local/cluster.sh) instead of the
#                                                staged bundle
#   SPX_STEADY_REQUESTS     1000                 300
#   SPX_STEADY_WINDOW       100
#   SPX_STEADY_RATE         4                              Poisson arrivals, requests/s
#   SPX_STEADY_CONCURRENCY  ""                   (set: closed loop with this many clients)
#   SPX_STEADY_DURATION_S   300                  120       stop sending after this long
#   SPX_STEADY_POOL         64
#   SPX_STEADY_DOCS         4                              documents per request
#   SPX_STEADY_DOC_TOKENS   2000                 200
#   SPX_STEADY_QUESTION_TOKENS 64                16
#   SPX_STEADY_ZIPF         1.0
#   SPX_STEADY_SEED         19                             the request stream (pool seed: 7)
#   SPX_STEADY_MAX_TOKENS   4
#   SPX_STEADY_KV_BLOCKS    4096                 1024      paged KV, 16 tokens a block
#   SPX_STEADY_DEVICE_MB    3000                 0         device tier bound
#   SPX_STEADY_HOST_MB      6000                 4         host store bound
#   SPX_STEADY_CACHE_SERVERS 1                             0: no cache cluster
#   SPX_STEADY_CACHE_MEMORY 4G                   4M        the cache server's memory arena
#   SPX_STEADY_CACHE_DISK   4G                   4M        its disk tier (RocksDB) bound
#   SPX_STEADY_WORKER_ARGS  ""                             extra sparsex-worker flags (win)
#   SPX_STEADY_LOADGEN_ARGS ""                             extra loadgen flags (win)
#   SPX_STEADY_ORACLE_DOCS  device tier's docs,pool/2  ""  k list: flatness of a cache always
#                                                holding the k most popular documents
# The worker runs with --gate 0: on random weights the correctness gate's replays disagree
# with any reuse and would disable it (docs/benchmarks.md, "The correctness gate on random
# weights"). A CPU smoke run of the script with a local build:
#   SPX_STEADY_DEVICE=cpu SPX_STEADY_BIN=$PWD/build/bin OUT=/tmp/steady bench/gpu/steady.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/spx-steady-out}
mkdir -p "$OUT"
LOG=$OUT/steady.log
T0=$(date +%s)
stamp() { echo "[steady.sh +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

DEVICE=${SPX_STEADY_DEVICE:-cuda}
if [ -n "${SPX_STEADY_BIN:-}" ]; then
  BIN=$SPX_STEADY_BIN CLUSTER=$ROOT/deploy/local/cluster.sh
else
  . "$ROOT/bench/gpu/staged_env.sh"
  BIN=$SPX/bin CLUSTER=$SPX/cluster.sh
fi
pick() { [ "$DEVICE" = cuda ] && echo "$1" || echo "$2"; }  # the cuda or the cpu default
MODEL=${SPX_STEADY_MODEL:-$(pick synthetic:llama3-8b synthetic:tiny)}
REQS=${SPX_STEADY_REQUESTS:-$(pick 1000 300)}
WINDOW=${SPX_STEADY_WINDOW:-100}
RATE=${SPX_STEADY_RATE:-4}
CONC=${SPX_STEADY_CONCURRENCY:-}
DURATION=${SPX_STEADY_DURATION_S:-$(pick 300 120)}
DOC_TOKENS=${SPX_STEADY_DOC_TOKENS:-$(pick 2000 200)}
QTOKENS=${SPX_STEADY_QUESTION_TOKENS:-$(pick 64 16)}
MAX_TOKENS=${SPX_STEADY_MAX_TOKENS:-4}
KV_BLOCKS=${SPX_STEADY_KV_BLOCKS:-$(pick 4096 1024)}
DEVICE_MB=${SPX_STEADY_DEVICE_MB:-$(pick 3000 0)}
HOST_MB=${SPX_STEADY_HOST_MB:-$(pick 6000 4)}
# The oracle's sizes (steady_windows.py --oracle_docs): the documents the device tier holds
# (Llama-3-8B: 128 KiB of bf16 K/V per token) and half the pool.
ORACLE_DOCS=${SPX_STEADY_ORACLE_DOCS:-$(pick "$((DEVICE_MB * 8 / DOC_TOKENS)),$((${SPX_STEADY_POOL:-64} / 2))" "")}
CACHES=${SPX_STEADY_CACHE_SERVERS:-1}
CACHE_MEMORY=${SPX_STEADY_CACHE_MEMORY:-$(pick 4G 4M)}
CACHE_DISK=${SPX_STEADY_CACHE_DISK:-$(pick 4G 4M)}
TIMEOUT_MS=30000
# The tiny model's vocabulary is 1000 ids: keep the documents' ids inside it.
IDS=$(pick "" "--min_id 3 --max_id 900")
WORKLOAD="--workload rag --pool ${SPX_STEADY_POOL:-64} --zipf ${SPX_STEADY_ZIPF:-1.0} \
  --docs_per_request ${SPX_STEADY_DOCS:-4} --doc_tokens $DOC_TOKENS --question_tokens $QTOKENS \
  --pool_seed 7 --seed ${SPX_STEADY_SEED:-19} --content numbers $IDS"
LOAD="--rate $RATE"
[ -n "$CONC" ] && LOAD="--concurrency $CONC"
WORKER_ARGS="--kv_blocks $KV_BLOCKS --device_tier_mb $DEVICE_MB --host_store_mb $HOST_MB --gate=0 \
  $(pick "--prefill_chunk 4096" "") ${SPX_STEADY_WORKER_ARGS:-}"
stamp "$MODEL on $DEVICE: $REQS requests ($LOAD), pool ${SPX_STEADY_POOL:-64} x $DOC_TOKENS tokens; \
device tier ${DEVICE_MB} MiB, host store ${HOST_MB} MiB, cache server $CACHE_MEMORY memory + $CACHE_DISK disk"
[ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; } >>"$LOG" 2>&1

# cluster.sh starts the cache server with fixed flags: a bin dir whose sparsex-cache-server
# execs the real one with the disk bound added (exec: the PID cluster.sh records stays the
# server's).
RUN=/tmp/spx-steady-run
SBIN=/tmp/spx-steady-bin
rm -rf "$RUN" "$SBIN" && mkdir -p "$SBIN"
for b in sparsex-worker sparsex-router sparsex-loadgen; do ln -s "$BIN/$b" "$SBIN/$b"; done
printf '#!/usr/bin/env bash\nexec %q "$@" --disk_capacity=%q\n' "$BIN/sparsex-cache-server" "$CACHE_DISK" \
  >"$SBIN/sparsex-cache-server"
chmod +x "$SBIN/sparsex-cache-server"
SHM_BEFORE=$(ls /dev/shm 2>/dev/null | grep -c '^ucx_shm_posix_')

SAMPLER=
cleanup() {  # also on an early exit: nothing of this run keeps running
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null && wait "$SAMPLER" 2>/dev/null
  SAMPLER=
  timeout 120 "$CLUSTER" down --run-dir "$RUN" >>"$LOG" 2>&1
}
trap cleanup EXIT

stamp "cluster up"
if ! SPARSEX_MODELS=/nonexistent timeout 300 "$CLUSTER" up --insecure --run-dir "$RUN" --bin-dir "$SBIN" \
    --model "$MODEL" --device "$DEVICE" --workers 1 --cache-servers "$CACHES" --cache-memory "$CACHE_MEMORY" \
    --timeout 240 --grpc-port 0 --http-port 0 --worker-args "$WORKER_ARGS" >>"$LOG" 2>&1; then
  stamp "cluster up failed"; tail -n 30 "$RUN"/*.log >>"$LOG" 2>&1
  exit 2
fi
. "$RUN/cluster.env"

# Every request's documents in order (the same seeded stream the run sends; index = send order).
# shellcheck disable=SC2086
timeout 60 "$SBIN/sparsex-loadgen" $WORKLOAD --dry_run "$REQS" ${SPX_STEADY_LOADGEN_ARGS:-} \
  >"$OUT/steady_orderings.txt" 2>>"$LOG" || stamp "loadgen --dry_run exit $?"

SARGS="--worker $WORKER0_METRICS --pid worker=$WORKER0_PID"
[ "$CACHES" -gt 0 ] && SARGS="$SARGS --cache $CACHE0_METRICS --pid cache=$CACHE0_PID"
[ "$DEVICE" = cuda ] && SARGS="$SARGS --gpu"
rm -f "$OUT/steady_memory.jsonl"
# shellcheck disable=SC2086
python3 "$ROOT/bench/gpu/steady_windows.py" sample $SARGS --interval 1 \
  --max_s $((DURATION + TIMEOUT_MS / 1000 + 120)) --out "$OUT/steady_memory.jsonl" 2>>"$LOG" &
SAMPLER=$!
sleep 2  # a sample or two of the idle worker: the GPU memory before the load

stamp "loadgen: $REQS requests"
LG_T0=$(date +%s.%N)
# --duration_s stops sending in time for the process to end (and write its records) before the
# outer timeout, which is only the backstop.
# shellcheck disable=SC2086
timeout $((DURATION + TIMEOUT_MS / 1000 + 60)) "$SBIN/sparsex-loadgen" --target "$ROUTER_GRPC" \
  --reuse on $WORKLOAD $LOAD --requests "$REQS" --duration_s "$DURATION" --max_tokens "$MAX_TOKENS" \
  --timeout_ms "$TIMEOUT_MS" --progress=false --out "$OUT/steady_loadgen.json" \
  --records "$OUT/steady_records.jsonl" ${SPX_STEADY_LOADGEN_ARGS:-} >>"$LOG" 2>&1 ||
  stamp "loadgen exit $?"
sleep 2
kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null; SAMPLER=

{ echo "## worker"; curl -s --max-time 5 "http://$WORKER0_METRICS/metrics" | grep -E '^sparsex_worker_' | grep -v _bucket
  [ "$CACHES" -gt 0 ] && { echo "## cache server"; curl -s --max-time 5 "http://$CACHE0_METRICS/metrics" | grep -E '^sparsex_cache_' | grep -v _bucket; }
} >"$OUT/metrics.txt" 2>&1
grep -h "error\|Error" "$RUN"/worker0.log | tail -n 10 >>"$LOG" 2>&1
cleanup
trap - EXIT
SHM_AFTER=$(ls /dev/shm 2>/dev/null | grep -c '^ucx_shm_posix_')
[ "$SHM_AFTER" -gt "$SHM_BEFORE" ] && stamp "/dev/shm: $((SHM_AFTER - SHM_BEFORE)) more ucx_shm_posix_* files than before the run"
stamp "cluster down; analysis"

python3 "$ROOT/bench/gpu/steady_windows.py" analyze --records "$OUT/steady_records.jsonl" \
  --memory "$OUT/steady_memory.jsonl" --orderings "$OUT/steady_orderings.txt" --t0 "$LG_T0" \
  --window "$WINDOW" --min_requests "$REQS" --host_bound $((HOST_MB << 20)) \
  --device_bound $((DEVICE_MB << 20)) --oracle_docs "$ORACLE_DOCS" --out "$OUT/steady.json" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
stamp "done (analysis exit $rc)"
exit "$rc"
