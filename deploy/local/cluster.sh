#!/usr/bin/env bash
# Local SparseX cluster on 127.0.0.1: etcd, cache server(s), worker(s) and the router.
#
#   deploy/local/cluster.sh up     [options]   start everything, wait until healthy
#   deploy/local/cluster.sh status [options]   processes and router health
#   deploy/local/cluster.sh down   [options]   stop everything (SIGTERM, then SIGKILL) by PID
#
# Options (environment variable in brackets, default after the colon):
#   --run-dir DIR        [SPARSEX_RUN_DIR]   : /tmp/sparsex-cluster-$USER   pid files, logs, data
#   --bin-dir DIR        [SPARSEX_BIN_DIR]   : <repo>/build/bin
#   --model PATH         [SPARSEX_MODEL]     : $SPARSEX_MODELS/stories260K/stories260K.gguf
#   --workers N          [SPARSEX_WORKERS]   : 1
#   --cache-servers N    [SPARSEX_CACHE_SERVERS] : 1 (0: no cache cluster)
#   --device cpu|cuda    [SPARSEX_DEVICE]    : cpu
#   --cache-memory SIZE  [SPARSEX_CACHE_MEMORY]: 256M on cpu, 16G on cuda   each cache server's
#                                              memory arena (an 8B model's 2000-token segment is
#                                              512 MiB of fp32 KV)
#   --grpc-port P        [SPARSEX_GRPC_PORT] : 50051 (0 or busy: a free port)
#   --http-port P        [SPARSEX_HTTP_PORT] : 8000  (0 or busy: a free port)
#   --worker-args "..."  [SPARSEX_WORKER_ARGS]: extra sparsex-worker flags
#   --router-args "..."  [SPARSEX_ROUTER_ARGS]: extra sparsex-router flags
#   --timeout S          [SPARSEX_UP_TIMEOUT]: 60   seconds to wait for health
#   --tenants "a b"      [SPARSEX_TENANTS]   : default   one API key per tenant
#   --insecure           [SPARSEX_INSECURE=1]: no credentials: plaintext, no API keys (every
#                                              process on 127.0.0.1, --insecure_loopback)
#
# Credentials (default): deploy/local/make-credentials.sh makes a CA, one certificate per role
# (mutual TLS between router, workers and cache servers), a scope key and an API key per tenant
# under <run-dir>/credentials; API_KEY (the first tenant's) and API_KEY_<tenant> go to
# cluster.env. Send "Authorization: Bearer $API_KEY" (docs/security.md).
#   --clean                                  down: also remove the run dir
#
# `up` writes <run-dir>/cluster.env (ROUTER_GRPC, ROUTER_HTTP, ETCD, WORKER<i>_GRPC,
# WORKER<i>_METRICS, WORKER<i>_PID, CACHE<i>_GRPC, CACHE<i>_METRICS, ...) for scripts and tests.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CMD=${1:-}
[ $# -gt 0 ] && shift
RUN_DIR=${SPARSEX_RUN_DIR:-/tmp/sparsex-cluster-${USER:-$(id -un)}}
BIN_DIR=${SPARSEX_BIN_DIR:-$REPO/build/bin}
MODELS=${SPARSEX_MODELS:-$(cd "$REPO/.." && pwd)/shared/models}
MODEL=${SPARSEX_MODEL:-$MODELS/stories260K/stories260K.gguf}
WORKERS=${SPARSEX_WORKERS:-1}
CACHES=${SPARSEX_CACHE_SERVERS:-1}
DEVICE=${SPARSEX_DEVICE:-cpu}
CACHE_MEMORY=${SPARSEX_CACHE_MEMORY:-}
GRPC_PORT=${SPARSEX_GRPC_PORT:-50051}
HTTP_PORT=${SPARSEX_HTTP_PORT:-8000}
WORKER_ARGS=${SPARSEX_WORKER_ARGS:-}
ROUTER_ARGS=${SPARSEX_ROUTER_ARGS:-}
TIMEOUT=${SPARSEX_UP_TIMEOUT:-60}
TENANTS=${SPARSEX_TENANTS:-default}
INSECURE=${SPARSEX_INSECURE:-0}
CLEAN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir) RUN_DIR=$2; shift 2 ;;
    --bin-dir) BIN_DIR=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --cache-servers) CACHES=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --cache-memory) CACHE_MEMORY=$2; shift 2 ;;
    --grpc-port) GRPC_PORT=$2; shift 2 ;;
    --http-port) HTTP_PORT=$2; shift 2 ;;
    --worker-args) WORKER_ARGS=$2; shift 2 ;;
    --router-args) ROUTER_ARGS=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --tenants) TENANTS=$2; shift 2 ;;
    --insecure) INSECURE=1; shift ;;
    --clean) CLEAN=1; shift ;;
    *) echo "cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

log() { echo "cluster: $*" >&2; }
[ -n "$CACHE_MEMORY" ] || { [ "$DEVICE" = cuda ] && CACHE_MEMORY=16G || CACHE_MEMORY=256M; }
die() { echo "cluster: error: $*" >&2; exit 1; }

# A free TCP port on 127.0.0.1 (the kernel picks it).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}
port_busy() {
  python3 -c 'import socket,sys
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try: s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError: sys.exit(0)
sys.exit(1)' "$1"
}
json_field() {  # json_field FILE KEY
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
}
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# start NAME CMD...: runs CMD in its own session, logs to NAME.log, pid in NAME.pid.
start() {
  local name=$1; shift
  setsid "$@" >"$RUN_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN_DIR/$name.pid"
}

# wait_file NAME FILE: waits for FILE while NAME's process lives.
wait_file() {
  local name=$1 file=$2 pid deadline=$((SECONDS + TIMEOUT))
  pid=$(cat "$RUN_DIR/$name.pid")
  while [ ! -s "$file" ]; do
    if ! alive "$pid"; then
      tail -n 20 "$RUN_DIR/$name.log" >&2 || true
      die "$name exited during startup (log: $RUN_DIR/$name.log)"
    fi
    [ $SECONDS -lt $deadline ] || die "$name not ready after ${TIMEOUT}s (log: $RUN_DIR/$name.log)"
    sleep 0.1
  done
}

http_get() {  # http_get URL -> body (exit 1 on failure / non-2xx)
  curl -fsS --max-time 2 "$1"
}

stop_all() {
  [ -d "$RUN_DIR" ] || return 0
  # Reverse start order: router, workers (drain), cache servers, etcd.
  local order=() f
  [ -f "$RUN_DIR/router.pid" ] && order+=("$RUN_DIR/router.pid")
  for f in "$RUN_DIR"/worker*.pid; do [ -f "$f" ] && order+=("$f"); done
  for f in "$RUN_DIR"/cache*.pid; do [ -f "$f" ] && order+=("$f"); done
  [ -f "$RUN_DIR/etcd.pid" ] && order+=("$RUN_DIR/etcd.pid")
  for f in "${order[@]}"; do
    local pid; pid=$(cat "$f")
    if alive "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  for f in "${order[@]}"; do
    local pid n=0; pid=$(cat "$f")
    while alive "$pid" && [ $n -lt 150 ]; do sleep 0.1; n=$((n + 1)); done
    if alive "$pid"; then
      log "$(basename "$f" .pid) (pid $pid) did not stop in 15 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
}

case "$CMD" in
  up)
    for b in sparsex-worker sparsex-router; do
      [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b not found (build first: scripts/build.sh)"
    done
    [ "$CACHES" -eq 0 ] || [ -x "$BIN_DIR/sparsex-cache-server" ] ||
      die "$BIN_DIR/sparsex-cache-server not found"
    command -v etcd >/dev/null || die "etcd not found (scripts/setup.sh installs etcd-server)"
    case "$MODEL" in synthetic:*) ;; *) [ -e "$MODEL" ] || die "model $MODEL not found (set SPARSEX_MODELS or --model)" ;; esac
    if [ -f "$RUN_DIR/etcd.pid" ] && alive "$(cat "$RUN_DIR/etcd.pid")"; then
      die "a cluster is already running in $RUN_DIR (cluster.sh down first)"
    fi
    rm -rf "$RUN_DIR"
    mkdir -p "$RUN_DIR"
    UP_OK=0
    trap 'if [ "$UP_OK" != 1 ]; then log "startup failed, stopping what was started"; stop_all; fi' EXIT
    ENV="$RUN_DIR/cluster.env"
    : >"$ENV"

    # credentials
    CACHE_SEC=(); WORKER_SEC=(); ROUTER_SEC=()
    if [ "$INSECURE" = 1 ]; then
      CACHE_SEC=(--insecure_loopback); WORKER_SEC=(--insecure_loopback)
      ROUTER_SEC=(--insecure_loopback)
      log "no credentials (--insecure): plaintext on 127.0.0.1, no API keys"
    else
      CRED="$RUN_DIR/credentials"
      # shellcheck disable=SC2086
      "$(dirname "$0")/make-credentials.sh" "$CRED" $TENANTS
      tls() { echo --tls_ca="$CRED/tls/ca.pem" --tls_cert="$CRED/tls/$1.pem" --tls_key="$CRED/tls/$1-key.pem"; }
      read -r -a CACHE_SEC <<<"$(tls cache)"
      read -r -a WORKER_SEC <<<"$(tls worker) --kv_mac_key_file=$CRED/kv_mac.key"
      read -r -a ROUTER_SEC <<<"$(tls router) --api_keys_file=$CRED/api_keys.json --scope_key_file=$CRED/scope.key"
      first=1
      for t in $TENANTS; do
        k=$(cat "$CRED/api_key.$t")
        [ $first = 1 ] && echo "API_KEY=$k" >>"$ENV"
        echo "API_KEY_$(echo "$t" | tr 'a-z-' 'A-Z_')=$k" >>"$ENV"
        first=0
      done
      echo "CREDENTIALS=$CRED" >>"$ENV"
      log "credentials in $CRED (CA, certificates, API keys for: $TENANTS)"
    fi

    # etcd
    ETCD_PORT=$(free_port); ETCD_PEER=$(free_port)
    start etcd etcd --name sparsex --data-dir "$RUN_DIR/etcd-data" \
      --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
      --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
      --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" \
      --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
      --initial-cluster "sparsex=http://127.0.0.1:$ETCD_PEER" --log-level warn
    deadline=$((SECONDS + TIMEOUT))
    until http_get "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"true"'; do
      alive "$(cat "$RUN_DIR/etcd.pid")" || { tail -n 20 "$RUN_DIR/etcd.log" >&2; die "etcd exited"; }
      [ $SECONDS -lt $deadline ] || die "etcd not healthy after ${TIMEOUT}s"
      sleep 0.2
    done
    echo "ETCD=127.0.0.1:$ETCD_PORT" >>"$ENV"
    echo "ETCD_PID=$(cat "$RUN_DIR/etcd.pid")" >>"$ENV"
    log "etcd on 127.0.0.1:$ETCD_PORT"

    # cache servers
    CACHE_LIST=""
    for i in $(seq 0 $((CACHES - 1))); do
      start "cache$i" "$BIN_DIR/sparsex-cache-server" --grpc_port=0 --metrics_port=0 \
        --disk_path="$RUN_DIR/cache$i-db" --memory_capacity="$CACHE_MEMORY" --ready_file="$RUN_DIR/cache$i.ready" \
        "${CACHE_SEC[@]}"
      wait_file "cache$i" "$RUN_DIR/cache$i.ready"
      p=$(json_field "$RUN_DIR/cache$i.ready" grpc_port)
      mp=$(json_field "$RUN_DIR/cache$i.ready" metrics_port)
      CACHE_LIST="${CACHE_LIST:+$CACHE_LIST,}127.0.0.1:$p"
      { echo "CACHE${i}_GRPC=127.0.0.1:$p"; echo "CACHE${i}_METRICS=127.0.0.1:$mp";
        echo "CACHE${i}_PID=$(cat "$RUN_DIR/cache$i.pid")"; } >>"$ENV"
      log "cache server $i on 127.0.0.1:$p (metrics $mp, memory $CACHE_MEMORY)"
    done

    # workers
    for i in $(seq 0 $((WORKERS - 1))); do
      # shellcheck disable=SC2086
      start "worker$i" "$BIN_DIR/sparsex-worker" --model "$MODEL" --device "$DEVICE" \
        --port 0 --metrics_port 0 --worker_id "worker-$i" --etcd "127.0.0.1:$ETCD_PORT" \
        ${CACHE_LIST:+--cache_servers "$CACHE_LIST"} --ready_file "$RUN_DIR/worker$i.ready" \
        "${WORKER_SEC[@]}" $WORKER_ARGS
      wait_file "worker$i" "$RUN_DIR/worker$i.ready"
      p=$(json_field "$RUN_DIR/worker$i.ready" grpc_port)
      mp=$(json_field "$RUN_DIR/worker$i.ready" metrics_port)
      { echo "WORKER${i}_GRPC=127.0.0.1:$p"; echo "WORKER${i}_METRICS=127.0.0.1:$mp";
        echo "WORKER${i}_PID=$(cat "$RUN_DIR/worker$i.pid")"; } >>"$ENV"
      log "worker $i on 127.0.0.1:$p (metrics $mp, $DEVICE)"
    done

    # router
    [ "$GRPC_PORT" = 0 ] || ! port_busy "$GRPC_PORT" || { log "port $GRPC_PORT busy: using a free port"; GRPC_PORT=0; }
    [ "$HTTP_PORT" = 0 ] || ! port_busy "$HTTP_PORT" || { log "port $HTTP_PORT busy: using a free port"; HTTP_PORT=0; }
    [ "$GRPC_PORT" != 0 ] || GRPC_PORT=$(free_port)
    [ "$HTTP_PORT" != 0 ] || HTTP_PORT=$(free_port)
    # shellcheck disable=SC2086
    start router "$BIN_DIR/sparsex-router" --model "$MODEL" \
      --grpc_address "127.0.0.1:$GRPC_PORT" --http_address "127.0.0.1:$HTTP_PORT" \
      --etcd "127.0.0.1:$ETCD_PORT" --membership_poll_ms 200 --ready_file "$RUN_DIR/router.ready" \
      "${ROUTER_SEC[@]}" $ROUTER_ARGS
    wait_file router "$RUN_DIR/router.ready"
    { echo "ROUTER_GRPC=127.0.0.1:$GRPC_PORT"; echo "ROUTER_HTTP=127.0.0.1:$HTTP_PORT";
      echo "ROUTER_PID=$(cat "$RUN_DIR/router.pid")"; echo "WORKERS=$WORKERS";
      echo "CACHE_SERVERS=$CACHES"; echo "RUN_DIR=$RUN_DIR"; } >>"$ENV"
    deadline=$((SECONDS + TIMEOUT))
    until http_get "http://127.0.0.1:$HTTP_PORT/healthz" 2>/dev/null |
        grep -q "\"healthy_workers\":$WORKERS"; do
      alive "$(cat "$RUN_DIR/router.pid")" || { tail -n 20 "$RUN_DIR/router.log" >&2; die "router exited"; }
      [ $SECONDS -lt $deadline ] || die "router does not see $WORKERS healthy worker(s) after ${TIMEOUT}s"
      sleep 0.2
    done
    UP_OK=1
    log "router: gRPC 127.0.0.1:$GRPC_PORT, HTTP 127.0.0.1:$HTTP_PORT ($WORKERS worker(s) healthy)"
    log "run dir $RUN_DIR (cluster.env, logs); stop with: $0 down --run-dir $RUN_DIR"
    ;;
  status)
    [ -d "$RUN_DIR" ] || { echo "no cluster in $RUN_DIR"; exit 1; }
    rc=0
    for f in "$RUN_DIR"/*.pid; do
      [ -f "$f" ] || continue
      pid=$(cat "$f"); name=$(basename "$f" .pid)
      if alive "$pid"; then echo "$name: running (pid $pid)"; else echo "$name: DEAD (pid $pid)"; rc=1; fi
    done
    if [ -f "$RUN_DIR/cluster.env" ]; then
      # shellcheck disable=SC1091
      . "$RUN_DIR/cluster.env"
      if [ -n "${ROUTER_HTTP:-}" ]; then
        echo "router health: $(http_get "http://$ROUTER_HTTP/healthz" 2>&1 || true)"
      fi
    fi
    exit $rc
    ;;
  down)
    stop_all
    log "stopped (run dir $RUN_DIR)"
    if [ "$CLEAN" = 1 ]; then rm -rf "$RUN_DIR"; fi
    ;;
  *)
    sed -n '2,33p' "$0"
    exit 2
    ;;
esac
