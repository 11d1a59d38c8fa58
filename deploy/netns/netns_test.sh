#!/usr/bin/env bash
# Multi-host test of a SparseX cluster on one machine: seven "hosts" (Linux network namespaces)
# on one bridge, each component bound to its own host's address, the KV data plane on UCX over
# TCP between hosts. Root only; opt-in (SPARSEX_NETNS_TEST=1), because it takes minutes.
#
#   SPARSEX_NETNS_TEST=1 deploy/netns/netns_test.sh [--bin-dir DIR] [--model PATH] [--docs PATH]
#                                                   [--json FILE] [--keep DIR] [--requests N]
#
# Network (namespaces named sx<pid>-<host>; addresses exist only inside them):
#   bridge br0 in sx<pid>-br;  10.231.0.0/24:
#   etcd .10   cache0 .20   cache1 .21   worker0 .30   worker1 .31   router .40   client .50
#
# Credentials as in production: deploy/local/make-credentials.sh makes a CA, the router, worker
# and cache certificates (mutual TLS on every gRPC channel between the hosts) and an API key,
# which the RAG client sends (SPARSEX_API_KEY); a request without it must be refused.
#
# Scenario (each step's figures go to the JSON file and the summary; docs/operations.md):
#   reuse    worker0 alone computes a RAG document pool (sparsex-rag from the client host) and
#            writes the segments to the two cache servers; worker1 joins, worker0 drains; the
#            same documents in new combinations run on worker1, which fetches them across hosts
#            (counters: worker1 fetched segments and reused tokens, cache hits and bytes out,
#            no inline gRPC reads, UCX TCP connections between the hosts, each opened by the
#            worker: deploy/k8s/networkpolicy.yaml admits nothing from cache servers to workers)
#   link     a fresh worker serves alone; cache1's link goes down mid-load: every request still
#            completes (fetches of cache1's segments fail and are recomputed), greedy outputs are
#            compared with full prefill as in the other phases
#   kill     both workers serve; kill -9 of the busier one mid-load: new requests go to the
#            other; the router marks it unhealthy at once and drops it when its etcd lease expires
#   restart  cache0 restarts on its RocksDB directory: the same blocks are on disk after the
#            restart, and a fresh worker's requests hit them
#   etcd     etcd stops for longer than the lease TTL while requests run: serving continues on
#            the router's last known membership; after etcd returns, the registrations are there
#
# Every namespace, link and process it creates is removed on exit, also on failure or signal.
# Exit: 0 pass, 1 a check failed, 77 skipped (not root, not enabled, missing tools/binaries).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BIN_DIR=${SPARSEX_BIN_DIR:-$REPO/build/bin}
MODELS=${SPARSEX_MODELS:-$(cd "$REPO/.." && pwd)/shared/models}
MODEL=$MODELS/stories260K/stories260K.gguf
DOCS=$MODELS/tinystories-text/tinystories_sample.txt
JSON_OUT="" KEEP="" REQUESTS=24
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) BIN_DIR=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --docs) DOCS=$2; shift 2 ;;
    --json) JSON_OUT=$2; shift 2 ;;
    --keep) KEEP=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "netns_test: unknown argument $1" >&2; exit 2 ;;
  esac
done

skip() { echo "SKIP: netns_test: $*"; exit 77; }
[ "${SPARSEX_NETNS_TEST:-0}" = 1 ] ||
  skip "opt-in: set SPARSEX_NETNS_TEST=1 (root; takes a few minutes; ctest -L netns)"
[ "$(id -u)" = 0 ] || skip "needs root (ip netns, veth, bridge)"
for t in ip etcd curl python3 ss awk base64 setsid openssl; do command -v "$t" >/dev/null || skip "$t not found"; done
for b in sparsex-cache-server sparsex-worker sparsex-router sparsex-rag; do
  [ -x "$BIN_DIR/$b" ] || skip "$BIN_DIR/$b not built"
done
[ -e "$MODEL" ] || skip "model $MODEL not found (SPARSEX_MODELS)"
[ -e "$DOCS" ] || skip "documents $DOCS not found"
P="sx$$"
ip netns add "$P-probe" 2>/dev/null || skip "cannot create network namespaces here"
ip netns del "$P-probe"

RUN=$(mktemp -d /tmp/sparsex-netns.XXXXXX)
SUBNET=10.231.0
declare -A IP=([etcd]=$SUBNET.10 [cache0]=$SUBNET.20 [cache1]=$SUBNET.21 [worker0]=$SUBNET.30
               [worker1]=$SUBNET.31 [router]=$SUBNET.40 [client]=$SUBNET.50)
HOSTS=(etcd cache0 cache1 worker0 worker1 router client)
CACHES="${IP[cache0]}:50070,${IP[cache1]}:50070"
ETCD="${IP[etcd]}:2379"
ROUTER_GRPC="${IP[router]}:50051"
ROUTER_HTTP="${IP[router]}:8000"
T0=$(date +%s.%N)
# Credentials: one CA, a certificate per role (DNS SAN sparsex.cluster: valid whatever address
# is dialled), the scope key, the workers' KV MAC key and one tenant's API key.
CRED="$RUN/credentials"
"$REPO/deploy/local/make-credentials.sh" "$CRED" netns >/dev/null
tls() { echo "--tls_ca=$CRED/tls/ca.pem --tls_cert=$CRED/tls/$1.pem --tls_key=$CRED/tls/$1-key.pem"; }
API_KEY=$(cat "$CRED/api_key.netns")
FAILS=()
FIG="$RUN/figures.jsonl"   # one {"key": value} per line, merged at the end
: >"$FIG"

# Log lines go to the stderr the script started with (fd 3), also from a trap that runs while
# a redirected command is active.
exec 3>&2
log() { printf '[netns %6.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN {print a - b}')" "$*" >&3; }
fail() { log "CHECK FAILED: $*"; FAILS+=("$*"); }
check() {  # check "description" <condition command...>
  local what=$1; shift
  if "$@"; then log "ok: $what"; else fail "$what"; fi
}
fig() { python3 -c 'import json,sys; print(json.dumps({sys.argv[1]: json.loads(sys.argv[2])}))' "$1" "$2" >>"$FIG"; }
now() { date +%s.%N; }
nap() { sleep "$1" & wait $!; }  # a sleep a signal interrupts
since() { awk -v a="$(now)" -v b="$1" 'BEGIN {printf "%.2f\n", a - b}'; }
gt() { awk -v a="$1" -v b="$2" 'BEGIN {exit !(a > b)}'; }  # gt A B: A > B (decimals)
ns() { echo "$P-$1"; }
in_ns() { local h=$1; shift; ip netns exec "$(ns "$h")" "$@"; }

# ---------------------------------------------------------------------------- teardown
cleanup() {
  local rc=$?
  trap - EXIT
  trap '' INT TERM  # nothing interrupts the teardown
  set +e
  report || rc=1
  log "teardown"
  local f pid
  for f in "$RUN"/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null
  done
  for f in "$RUN"/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
  done
  # Anything else still running inside our namespaces was started by this script.
  for h in "${HOSTS[@]}" br; do
    for pid in $(ip netns pids "$(ns "$h")" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  done
  for h in "${HOSTS[@]}" br; do ip netns del "$(ns "$h")" 2>/dev/null; done
  local left
  left=$(ip netns list | grep -c "^$P-" || true)
  [ "$left" = 0 ] || { log "$left namespaces could not be removed"; rc=1; }
  if [ -n "$KEEP" ]; then
    mkdir -p "$KEEP" && cp -r "$RUN"/*.log "$RUN"/*.json "$RUN"/*.events "$KEEP"/ 2>/dev/null
    log "logs kept in $KEEP"
  fi
  rm -rf "$RUN"
  exit $rc
}
# report: the figures as one JSON object (--json), the workload summaries, the failed checks.
report() {
  python3 - "$FIG" "${JSON_OUT:-$RUN/netns.json}" <<'EOF'
import json, sys
out = {}
for line in open(sys.argv[1]):
    out.update(json.loads(line))
json.dump(out, open(sys.argv[2], "w"), indent=1, sort_keys=True)
EOF
  [ -z "$JSON_OUT" ] || log "figures written to $JSON_OUT"
  local n
  for n in A B C D E F; do
    [ -f "$RUN/rag-$n.json" ] && log "rag $n: $(cat "$RUN/rag-$n.json")"
  done
  if [ ${#FAILS[@]} -gt 0 ]; then
    log "FAILED checks: ${#FAILS[@]}"
    printf '  - %s\n' "${FAILS[@]}" >&3
    return 1
  fi
  return 0
}
trap cleanup EXIT
on_signal() { log "interrupted"; exit 1; }
trap on_signal INT TERM

# ----------------------------------------------------------------------------- network
log "network: 7 hosts on a bridge, $SUBNET.0/24, namespaces $P-*"
ip netns add "$(ns br)"
ip -n "$(ns br)" link set lo up
ip -n "$(ns br)" link add br0 type bridge
ip -n "$(ns br)" link set br0 up
for h in "${HOSTS[@]}"; do
  ip netns add "$(ns "$h")"
  ip -n "$(ns "$h")" link set lo up
  ip link add eth0 netns "$(ns "$h")" type veth peer name "v-$h" netns "$(ns br)"
  ip -n "$(ns br)" link set "v-$h" master br0 up
  ip -n "$(ns "$h")" addr add "${IP[$h]}/24" dev eth0
  ip -n "$(ns "$h")" link set eth0 up
done

# ---------------------------------------------------------------------------- processes
# spawn NAME HOST CMD...: runs CMD in HOST's namespace, in its own session; pid in NAME.pid.
spawn() {
  local name=$1 host=$2; shift 2
  setsid ip netns exec "$(ns "$host")" "$@" >>"$RUN/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
}
pid_of() { cat "$RUN/$1.pid"; }
alive() { [ -f "$RUN/$1.pid" ] && kill -0 "$(pid_of "$1")" 2>/dev/null; }
# stop NAME [SIGNAL]: signals the process and waits for it to exit (15 s, then SIGKILL).
stop() {
  local name=$1 sig=${2:-TERM} pid
  pid=$(pid_of "$name")
  kill "-$sig" "$pid" 2>/dev/null || true
  for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  { wait "$pid"; } 2>/dev/null || true
  rm -f "$RUN/$name.pid"
}
# wait_until SECONDS DESCRIPTION CMD...: polls CMD every 0.2 s.
wait_until() {
  local limit=$1 what=$2 start; shift 2
  start=$(now)
  while ! "$@" 2>/dev/null; do
    if gt "$(since "$start")" "$limit"; then
      fail "$what (not within ${limit}s)"
      return 1
    fi
    sleep 0.2
  done
}
http() { in_ns client curl -fsS --max-time 3 "http://$1"; }
ready() { [ -s "$RUN/$1.ready" ]; }

# metric ADDR NAME [LABEL_SUBSTRING]: sum of the series of NAME scraped from ADDR.
metric() {
  local addr=$1 name=$2 filter=${3:-}
  http "$addr/metrics" 2>/dev/null | awk -v n="$name" -v f="$filter" '
    $1 == n || index($1, n "{") == 1 { if (f == "" || index($1, f) > 0) s += $2 }
    END { printf "%.0f\n", s }'
}
# The watcher (client host) polls the router's /healthz and etcd's worker keys every 100 ms and
# appends "<unix time> <healthy workers> <known workers> <worker keys in etcd>" on each change
# (-1: no answer), so that transitions are timed precisely even on a loaded machine.
cat >"$RUN/watch.py" <<'EOF'
import base64, json, sys, time, urllib.request
router, etcd, out = sys.argv[1:4]
rng = json.dumps({"key": base64.b64encode(b"/sparsex/workers/").decode(),
                  "range_end": base64.b64encode(b"/sparsex/workers0").decode(),
                  "count_only": True}).encode()
last = None
while True:
    try:
        h = json.load(urllib.request.urlopen(f"http://{router}/healthz", timeout=1))
        state = [h.get("healthy_workers", 0), h.get("workers", 0)]
    except urllib.error.HTTPError as e:  # 503: no healthy worker, same body
        try:
            h = json.load(e)
            state = [h.get("healthy_workers", 0), h.get("workers", 0)]
        except Exception:
            state = [-1, -1]
    except Exception:
        state = [-1, -1]
    try:
        r = urllib.request.urlopen(urllib.request.Request(f"http://{etcd}/v3/kv/range", data=rng),
                                   timeout=1)
        state.append(int(json.load(r).get("count", "0")))
    except Exception:
        state.append(-1)
    if state != last:
        with open(out, "a") as f:
            f.write(f"{time.time():.3f} {state[0]} {state[1]} {state[2]}\n")
        last = state
    time.sleep(0.1)
EOF
WATCH="$RUN/watch.events"
: >"$WATCH"
# state FIELD: the watcher's latest value (1 healthy, 2 known, 3 etcd keys).
state() { tail -n 1 "$WATCH" | awk -v f="$(( $1 + 1 ))" '{print $f}'; }
workers_are() { [ "$(state 1)" = "$1" ] && [ "$(state 2)" = "$1" ]; }
healthy_is() { [ "$(state 1)" = "$1" ]; }
etcd_workers_is() { [ "$(state 3)" = "$1" ]; }
known_workers() { state 2; }
# first_after T FIELD VALUE: seconds from T to the first change at or after T where FIELD == VALUE.
first_after() {
  awk -v t="$1" -v f="$(( $2 + 1 ))" -v v="$3" '$1 >= t && $f == v {printf "%.2f\n", $1 - t; found=1; exit}
    END {if (!found) print "-1"}' "$WATCH"
}
# min_between T1 T2 FIELD: the smallest value FIELD took between T1 and T2 (the value at T1 too).
min_between() {
  awk -v a="$1" -v b="$2" -v f="$(( $3 + 1 ))" '$1 < a {cur=$f} $1 >= a && $1 <= b {if (min=="" || $f < min) min=$f}
    END {if (cur != "" && (min == "" || cur < min)) min=cur; print min}' "$WATCH"
}
start_etcd() {
  spawn etcd etcd etcd --name sx --data-dir "$RUN/etcd-data" \
    --listen-client-urls "http://$ETCD" --advertise-client-urls "http://$ETCD" \
    --listen-peer-urls "http://${IP[etcd]}:2380" --initial-advertise-peer-urls "http://${IP[etcd]}:2380" \
    --initial-cluster "sx=http://${IP[etcd]}:2380" --log-level warn
  wait_until 30 "etcd healthy" etcd_healthy
}
start_cache() {  # start_cache i
  local i=$1
  rm -f "$RUN/cache$i.ready"
  spawn "cache$i" "cache$i" env UCX_NET_DEVICES=eth0 "$BIN_DIR/sparsex-cache-server" \
    --address="${IP[cache$i]}" --grpc_port=50070 --metrics_port=9470 --server_id="cache$i" \
    --disk_path="$RUN/cache$i-db" --memory_capacity=256M --ucx_tls=tcp \
    --ready_file="$RUN/cache$i.ready" $(tls cache)
  wait_until 60 "cache$i ready" ready "cache$i"
}
start_worker() {  # start_worker i
  local i=$1
  rm -f "$RUN/worker$i.ready"
  spawn "worker$i" "worker$i" env UCX_NET_DEVICES=eth0 "$BIN_DIR/sparsex-worker" \
    --model "$MODEL" --device cpu --address "${IP[worker$i]}" --port 50060 --metrics_port 9460 \
    --worker_id "worker$i" --etcd "$ETCD" --cache_servers "$CACHES" --ucx_tls tcp \
    --drain_timeout_ms 10000 --ready_file "$RUN/worker$i.ready" $(tls worker) \
    --kv_mac_key_file "$CRED/kv_mac.key"
  wait_until 60 "worker$i ready" ready "worker$i"
}
start_router() {
  spawn router router "$BIN_DIR/sparsex-router" --model "$MODEL" \
    --grpc_address "$ROUTER_GRPC" --http_address "$ROUTER_HTTP" --etcd "$ETCD" \
    --membership_poll_ms 200 --ready_file "$RUN/router.ready" $(tls router) \
    --api_keys_file "$CRED/api_keys.json" --scope_key_file "$CRED/scope.key"
  wait_until 60 "router ready" ready router
  spawn watch client python3 "$RUN/watch.py" "$ROUTER_HTTP" "$ETCD" "$WATCH"
}
router_requests() { metric "$ROUTER_HTTP" sparsex_router_requests_total; }
requests_beyond() { [ "$(router_requests)" -ge $(($1 + $2)) ]; }  # requests_beyond BASE N
etcd_healthy() { in_ns client curl -fsS --max-time 2 "http://$ETCD/health" | grep -q true; }
healthz_ok() { http "$1/healthz" >/dev/null; }

# rag_bg NAME SEED [extra sparsex-rag flags]: runs the RAG workload from the client host, in
# the background (pid in rag-NAME.pid); rag NAME SEED ...: the same, waiting for it (a signal
# interrupts the wait at once).
rag_bg() {
  local name=$1 seed=$2; shift 2
  in_ns client env SPARSEX_API_KEY="$API_KEY" "$BIN_DIR/sparsex-rag" --target "$ROUTER_GRPC" --docs "$DOCS" \
    --requests "$REQUESTS" --pool 16 --docs_per_request 3 --max_tokens 16 --fidelity_every 4 \
    --seed "$seed" --timeout_ms 120000 --progress=false --json "$RUN/rag-$name.json" "$@" \
    >"$RUN/rag-$name.log" 2>&1 &
  echo $! >"$RUN/rag-$name.pid"
}
rag() { rag_bg "$@"; rag_wait "$1"; }
rag_wait() {  # rag_wait NAME: waits for a background run; its exit status
  local pid rc=0
  pid=$(cat "$RUN/rag-$1.pid")
  wait "$pid" || rc=$?
  rm -f "$RUN/rag-$1.pid"
  return $rc
}
rag_field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$RUN/rag-$1.json" "$2"; }
rag_fig() { fig "$1" "$(cat "$RUN/rag-$2.json")"; }
# Waits until the worker's write-back queue is flushed (its counter stops moving).
settle_writeback() {
  local addr=$1 last=-1 cur
  for _ in $(seq 50); do
    cur=$(metric "$addr" sparsex_worker_writeback_total)
    [ "$cur" = "$last" ] && return 0
    last=$cur
    sleep 0.5
  done
}
# UCX TCP connections from a cache host to worker hosts (not the gRPC/metrics ports).
ucx_conns() {
  in_ns "$1" ss -tnH state established 2>/dev/null |
    awk -v a="${IP[$1]}" '$3 ~ "^"a":" && $3 !~ ":(50070|9470)$" && $4 ~ /10\.231\.0\.3[01]:/' | wc -l
}
# UCX TCP connections between cache and worker hosts that the cache host opened (its end is not
# one of its listening ports): none expected, the worker creates every endpoint.
ucx_conns_from_cache() {
  local listening
  listening=$(in_ns "$1" ss -tlnH 2>/dev/null | awk '{n = split($4, a, ":"); print a[n]}' | sort -u | tr '\n' ' ')
  in_ns "$1" ss -tnH state established 2>/dev/null |
    awk -v a="${IP[$1]}" -v l=" $listening" '$3 ~ "^"a":" && $4 ~ /10\.231\.0\.3[01]:/ {
      n = split($3, p, ":"); if (index(l, " " p[n] " ") == 0) c++ } END {print c + 0}'
}
W0="${IP[worker0]}:9460" W1="${IP[worker1]}:9460" C0="${IP[cache0]}:9470" C1="${IP[cache1]}:9470"
waddr() { [ "$1" = worker0 ] && echo "$W0" || echo "$W1"; }

# ------------------------------------------------------------------------ 1: cross-host reuse
log "starting etcd, cache0, cache1, worker0, router"
start_etcd
start_cache 0
start_cache 1
start_worker 0
start_router
wait_until 30 "router sees worker0" workers_are 1

log "credentials: a client without the API key is refused"
rc=0
in_ns client env -u SPARSEX_API_KEY "$BIN_DIR/sparsex-rag" --target "$ROUTER_GRPC" --docs "$DOCS" \
  --requests 1 --wait_ready_s 5 --progress=false >"$RUN/rag-nokey.log" 2>&1 || rc=$?
check "a request without an API key is refused (rc $rc: $(tail -n 1 "$RUN/rag-nokey.log"))" \
  grep -q "refused the credentials" "$RUN/rag-nokey.log"

log "phase reuse: worker0 computes the document pool (seed 1, $REQUESTS requests)"
rag A 1 || fail "rag A: requests failed ($(tail -n 2 "$RUN/rag-A.log" | tr '\n' ' '))"
settle_writeback "$W0"
wb0=$(metric "$W0" sparsex_worker_writeback_total 'result="ok"')
commits=$(( $(metric "$C0" sparsex_cache_commits_total 'result="ok"') + $(metric "$C1" sparsex_cache_commits_total 'result="ok"') ))
blocks0=$(metric "$C0" sparsex_cache_blocks 'tier="disk"'); blocks1=$(metric "$C1" sparsex_cache_blocks 'tier="disk"')
log "worker0 wrote back $wb0 segments; cache commits $commits; disk blocks cache0 $blocks0, cache1 $blocks1"
check "worker0 wrote segments back to the cache servers" [ "$wb0" -gt 0 ]
check "both cache servers hold blocks" [ "$blocks0" -gt 0 -a "$blocks1" -gt 0 ]
rag_fig reuse_A A
fig reuse_writeback "{\"worker0_segments_written\": $wb0, \"cache_commits\": $commits, \"cache0_disk_blocks\": $blocks0, \"cache1_disk_blocks\": $blocks1}"

log "worker1 joins, worker0 drains (SIGTERM)"
start_worker 1
wait_until 30 "router sees both workers" workers_are 2
t=$(now)
stop worker0 TERM
wait_until 30 "router drops drained worker0" workers_are 1
drain_drop_s=$(since "$t")
log "router dropped the drained worker0 after ${drain_drop_s}s (deregistration, no lease wait)"

log "phase reuse: worker1 serves the same documents in new combinations (seed 2)"
reads_before=$(( $(metric "$C0" sparsex_cache_requests_total 'method="read"') + $(metric "$C1" sparsex_cache_requests_total 'method="read"') ))
rag B 2 || fail "rag B: requests failed ($(tail -n 2 "$RUN/rag-B.log" | tr '\n' ' '))"
f1=$(metric "$W1" sparsex_worker_fetched_segments_total)
r1=$(metric "$W1" sparsex_worker_reused_tokens_total)
n1=$(metric "$W1" sparsex_worker_new_tokens_total)
p1=$(metric "$W1" sparsex_worker_prompt_tokens_total)
ff1=$(metric "$W1" sparsex_worker_fetch_failures_total)
hits=$(( $(metric "$C0" sparsex_cache_hits_total) + $(metric "$C1" sparsex_cache_hits_total) ))
hits0=$(metric "$C0" sparsex_cache_hits_total); hits1=$(metric "$C1" sparsex_cache_hits_total)
bout=$(( $(metric "$C0" sparsex_cache_bytes_out_total) + $(metric "$C1" sparsex_cache_bytes_out_total) ))
leases=$(( $(metric "$C0" sparsex_cache_requests_total 'method="lease"') + $(metric "$C1" sparsex_cache_requests_total 'method="lease"') ))
reads=$(( $(metric "$C0" sparsex_cache_requests_total 'method="read"') + $(metric "$C1" sparsex_cache_requests_total 'method="read"') - reads_before ))
conns=$(( $(ucx_conns cache0) + $(ucx_conns cache1) ))
conns_from_cache=$(( $(ucx_conns_from_cache cache0) + $(ucx_conns_from_cache cache1) ))
log "worker1: fetched $f1 segments across hosts, reused $r1 of $p1 prompt tokens (new $n1), fetch failures $ff1"
log "cache servers: hits $hits (cache0 $hits0, cache1 $hits1), bytes out $bout, leases $leases, inline reads $reads, UCX TCP connections to workers $conns"
check "worker1 fetched segments worker0 computed" [ "$f1" -gt 0 ]
check "worker1 reused tokens" [ "$r1" -gt 0 ]
check "both cache servers served hits" [ "$hits0" -gt 0 -a "$hits1" -gt 0 ]
check "no fetch failures" [ "$ff1" = 0 ]
check "bytes moved over UCX (no inline gRPC reads)" [ "$bout" -gt 0 -a "$reads" = 0 ]
check "UCX TCP connections between cache and worker hosts" [ "$conns" -gt 0 ]
check "every UCX connection opened by the worker ($conns_from_cache of $conns by a cache host)" [ "$conns_from_cache" = 0 ]
rag_fig reuse_B B
fig reuse_counters "{\"worker1_fetched_segments\": $f1, \"worker1_reused_tokens\": $r1, \"worker1_prompt_tokens\": $p1, \"worker1_new_tokens\": $n1, \"worker1_fetch_failures\": $ff1, \"cache_hits\": $hits, \"cache0_hits\": $hits0, \"cache1_hits\": $hits1, \"cache_bytes_out\": $bout, \"cache_leases\": $leases, \"inline_reads\": $reads, \"ucx_tcp_connections\": $conns, \"ucx_tcp_connections_opened_by_cache\": $conns_from_cache, \"drained_worker_dropped_s\": $drain_drop_s}"

# ---------------------------------------------------------------------- 2: cache link down
log "phase link: fresh worker0 serves alone; cache1's link goes down mid-load"
start_worker 0
wait_until 30 "router sees both workers" workers_are 2
stop worker1 TERM
wait_until 30 "router drops drained worker1" workers_are 1
ttft_count() { metric "$ROUTER_HTTP" sparsex_router_ttft_seconds_count; }
ttft_le() { metric "$ROUTER_HTTP" sparsex_router_ttft_seconds_bucket "le=\"$1\""; }
ta=$(ttft_count); ta1=$(ttft_le 1.024); ta2=$(ttft_le 2.048)
ffa=$(metric "$W0" sparsex_worker_fetch_failures_total)
wea=$(metric "$W0" sparsex_worker_writeback_total 'result="error"')
newa=$(metric "$W0" sparsex_worker_new_tokens_total)
base=$(router_requests)
rag_bg C 3
# Take the link down once the first requests went through, while most segments still have to
# come from the cache servers.
wait_until 60 "load running" requests_beyond "$base" 1
ip -n "$(ns cache1)" link set eth0 down
t=$(now); req_down=$(router_requests)
log "cache1 link DOWN"
down_s=20
nap $down_s
req_up=$(router_requests)
ip -n "$(ns cache1)" link set eth0 up
log "cache1 link UP after ${down_s}s"
rc=0; rag_wait C || rc=$?
ffb=$(metric "$W0" sparsex_worker_fetch_failures_total)
web=$(metric "$W0" sparsex_worker_writeback_total 'result="error"')
newb=$(metric "$W0" sparsex_worker_new_tokens_total)
fetched_c=$(metric "$W0" sparsex_worker_fetched_segments_total)
failed_c=$(rag_field C failed)
tb=$(ttft_count); over1=$(( (tb - ta) - ($(ttft_le 1.024) - ta1) )); over2=$(( (tb - ta) - ($(ttft_le 2.048) - ta2) ))
log "router TTFT in the phase: $over1 of $((tb - ta)) requests over 1 s, $over2 over 2 s"
log "worker0 during the phase: fetched $fetched_c segments, fetch failures $((ffb - ffa)), write-backs to the unreachable cache1 failed $((web - wea)), new tokens $((newb - newa)); $((req_up - req_down)) requests finished while the link was down"
check "every request completed (failed: $failed_c)" [ "$rc" = 0 -a "$failed_c" = 0 ]
check "requests were served while cache1 was unreachable" [ $((req_up - req_down)) -gt 0 ]
# An unreachable member's segments count as absent (the cluster client moves on): the worker
# recomputes them and then fails to write them back to cache1; a fetch cut mid-transfer counts
# as a fetch failure. Either shows requests that needed cache1 and completed without it.
check "segments owned by cache1 were recomputed during the outage" [ $((web - wea + ffb - ffa)) -gt 0 ]
rag_fig link_C C
fig link_counters "{\"link_down_s\": $down_s, \"requests_during_outage\": $((req_up - req_down)), \"fetch_failures\": $((ffb - ffa)), \"writeback_errors\": $((web - wea)), \"fetched_segments\": $fetched_c, \"new_tokens\": $((newb - newa)), \"ttft_requests\": $((tb - ta)), \"ttft_over_1s\": $over1, \"ttft_over_2s\": $over2}"
wait_until 30 "cache1 reachable again" healthz_ok "$C1"

# ---------------------------------------------------------------------------- 3: kill a worker
log "phase kill: both workers serve; kill -9 of the busier one mid-load"
start_worker 1
wait_until 30 "router sees both workers" workers_are 2
a0=$(metric "$ROUTER_HTTP" sparsex_router_routing_decisions_total 'worker="worker0"')
a1=$(metric "$ROUTER_HTTP" sparsex_router_routing_decisions_total 'worker="worker1"')
base=$(router_requests)
rag_bg D 4
wait_until 60 "load running" requests_beyond "$base" 6
d0=$(( $(metric "$ROUTER_HTTP" sparsex_router_routing_decisions_total 'worker="worker0"') - a0 ))
d1=$(( $(metric "$ROUTER_HTTP" sparsex_router_routing_decisions_total 'worker="worker1"') - a1 ))
if [ "$d0" -ge "$d1" ]; then victim=worker0 other=worker1; else victim=worker1 other=worker0; fi
t=$(now)
stop "$victim" KILL
log "killed $victim (routing decisions in this phase so far: worker0 $d0, worker1 $d1)"
wait_until 20 "router marks $victim unhealthy" healthy_is 1
dv_unhealthy=$(metric "$ROUTER_HTTP" sparsex_router_routing_decisions_total "worker=\"$victim\"")
wait_until 40 "etcd lease of $victim expires" etcd_workers_is 1
wait_until 20 "router drops $victim" workers_are 1
unhealthy_s=$(first_after "$t" 1 1)
lease_s=$(first_after "$t" 3 1)
dropped_s=$(first_after "$t" 2 1)
rc=0; rag_wait D || rc=$?
dv_after=$(metric "$ROUTER_HTTP" sparsex_router_routing_decisions_total "worker=\"$victim\"")
retries=$(metric "$ROUTER_HTTP" sparsex_router_retries_total)
failed_d=$(rag_field D failed)
log "$victim: unhealthy in the router after ${unhealthy_s}s, etcd key gone after ${lease_s}s, dropped after ${dropped_s}s; requests failed $failed_d, router retries $retries"
check "no request routed to $victim once the router saw it unhealthy" [ "$dv_after" = "$dv_unhealthy" ]
check "requests after the kill completed on $other (failed: $failed_d, at most the one in flight)" [ "$failed_d" -le 1 ]
check "router dropped $victim after its lease expired (TTL 10 s)" gt "$lease_s" 5
rag_fig kill_D D
fig kill_counters "{\"victim\": \"$victim\", \"router_unhealthy_s\": $unhealthy_s, \"etcd_key_expired_s\": $lease_s, \"router_dropped_s\": $dropped_s, \"decisions_victim_at_unhealthy\": $dv_unhealthy, \"decisions_victim_after\": $dv_after, \"router_retries\": $retries, \"failed\": $failed_d}"

# ------------------------------------------------------------------------ 4: restart a cache
log "phase restart: cache0 restarts on its RocksDB directory"
disk_before=$(metric "$C0" sparsex_cache_blocks 'tier="disk"')
t=$(now)
stop cache0 TERM
start_cache 0
restart_s=$(since "$t")
disk_after=$(metric "$C0" sparsex_cache_blocks 'tier="disk"')
log "cache0: $disk_before disk blocks before, $disk_after after the restart (back in ${restart_s}s)"
check "cache0 kept its blocks across the restart" [ "$disk_after" = "$disk_before" -a "$disk_after" -gt 0 ]
# A fresh worker alone, so that its requests must come from the cache servers.
start_worker "${victim#worker}"
wait_until 30 "router sees both workers" workers_are 2
stop "$other" TERM
wait_until 30 "router drops drained $other" workers_are 1
rag E 1 || fail "rag E: requests failed"
hits_after=$(metric "$C0" sparsex_cache_hits_total)
ffe=$(metric "$(waddr "$victim")" sparsex_worker_fetch_failures_total)
fe=$(metric "$(waddr "$victim")" sparsex_worker_fetched_segments_total)
log "after the restart cache0 served $hits_after block hits; fresh $victim fetched $fe segments, failures $ffe"
check "cache0 serves its RocksDB segments again" [ "$hits_after" -gt 0 ]
rag_fig restart_E E
fig restart_counters "{\"disk_blocks_before\": $disk_before, \"disk_blocks_after\": $disk_after, \"restart_s\": $restart_s, \"cache0_hits_after_restart\": $hits_after, \"worker_fetched\": $fe, \"worker_fetch_failures\": $ffe}"

# --------------------------------------------------------------------------- 5: etcd outage
log "phase etcd: etcd stops for 25 s (worker lease TTL 10 s) while requests run"
start_worker "${other#worker}"
wait_until 30 "router sees both workers" workers_are 2
t=$(now)
stop etcd TERM
log "etcd DOWN"
req_down=$(router_requests)
rag_bg F 5
outage=25
nap $outage
req_up=$(router_requests)
t_restart=$(now)
start_etcd
t_up=$(now)
etcd_down_s=$(since "$t")
log "etcd UP after ${etcd_down_s}s"
wait_until 30 "both registrations in etcd again" etcd_workers_is 2
reg_s=$(first_after "$t_restart" 3 2)
# The first count etcd answered after the restart: 2 means the registrations survived the
# outage (etcd restores leases with a fresh TTL), less means the workers registered again.
first_count=$(awk -v t="$t_restart" '$1 >= t && $4 != -1 {print $4; exit}' "$WATCH")
min_workers=$(min_between "$t" "$t_up" 2)
min_healthy=$(min_between "$t" "$t_up" 1)
rc=0; rag_wait F || rc=$?
sleep 2
final_workers=$(known_workers)
check "every request completed (none failed)" [ "$rc" = 0 ]
check "requests were served while etcd was down ($((req_up - req_down)))" [ $((req_up - req_down)) -gt 0 ]
check "router kept both workers through the outage" [ "$min_workers" = 2 -a "$min_healthy" = 2 ]
check "router still has both workers after etcd returned" [ "$final_workers" = 2 ]
log "router's fewest known/healthy workers during the outage: $min_workers/$min_healthy; both registrations in etcd ${reg_s}s after its restart began (first answer: $first_count keys)"
rag_fig etcd_F F
fig etcd_counters "{\"etcd_down_s\": $etcd_down_s, \"requests_during_outage\": $((req_up - req_down)), \"min_router_workers_during_outage\": $min_workers, \"min_router_healthy_during_outage\": $min_healthy, \"registrations_back_s\": $reg_s, \"first_etcd_answer_keys\": ${first_count:-0}, \"router_workers_after\": $final_workers}"

# ------------------------------------------------------------------------------------ done
log "PASS: cross-host reuse, cache link down, worker killed, cache restarted, etcd outage"
