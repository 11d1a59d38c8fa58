#!/usr/bin/env bash
# SparseX in containers without a registry: a Debian 12 base made with debootstrap, the images
# of deploy/docker/Dockerfile assembled with buildah, the Kubernetes manifests of deploy/k8s
# played with `podman kube play`, and the demo's RAG workload served from the containers
# (etcd, cache server, CPU worker with stories260K, router). Root only.
#
# Credentials as on Kubernetes: deploy/local/make-credentials.sh makes <work>/credentials (CA,
# router/worker/cache certificates, scope key, API keys file, the key of tenant "podman"; kept
# across runs), and the render mounts them where the manifests mount their Secrets. Every gRPC
# channel between the pods is mutual TLS; the RAG client and the OpenAI request send the API key,
# and a request without it must be refused (401).
#
#   deploy/podman/up.sh [all]    images, up, rag, down: the whole thing, end to end
#   deploy/podman/up.sh test     the same, for ctest: skipped (77) unless SPARSEX_PODMAN_TEST=1,
#                                root, and podman, buildah, debootstrap and a CPU build present
#   deploy/podman/up.sh images   base image (debootstrap, cached) + the four images + inspection
#   deploy/podman/up.sh up       play the rendered manifests, wait until every component is healthy
#   deploy/podman/up.sh rag      the RAG workload (sparsex-rag in a container) + one OpenAI request
#   deploy/podman/up.sh down     remove the pods, their volumes and the network (images stay)
#   deploy/podman/up.sh clean    down, then remove every image and the whole work folder
#
# Options (environment variable in brackets, default after the colon):
#   --build-dir DIR   [SPARSEX_BUILD_DIR]   : <repo>/build  a CPU build tree (-DSPARSEX_WITH_CUDA=OFF,
#                                             as the Dockerfile's build stage) with sparsex-router,
#                                             sparsex-rag, sparsex-worker, sparsex-cache-server and
#                                             sparsex-cache-cli built
#   --work DIR        [SPARSEX_PODMAN_WORK] : /var/tmp/sparsex-podman  debootstrap cache, podman
#                                             storage (its own graph root), build context, logs
#   --models DIR      [SPARSEX_MODELS]      : <repo>/../shared/models  mounted read-only at /models
#   --tag TAG                               : podman
#   --requests N                            : 24  RAG requests
#   --json FILE                             : also write the RAG summary + checks here
#   --keep                                  : all/test: leave the cluster running at the end
#
# podman here (Debian 12: podman 4.3, buildah 1.28, crun 1.8, runc 1.1) needs three settings,
# which this script writes to <work>/containers.conf (CONTAINERS_CONF) and uses for every
# podman/buildah call (docs/operations.md "Containers with podman" has the errors):
#   runtime = runc       crun 1.8 refuses this VM's hybrid cgroup layout ("cgroups in hybrid
#                        mode not supported, drop all controllers from cgroupv2")
#   default_ulimits      nofile <= 20000 and nproc <= 32768: podman's defaults (1048576 /
#                        4194304) exceed the hard limits and raising them needs CAP_SYS_RESOURCE,
#                        which this VM's root lacks ("setrlimit RLIMIT_NOFILE: Operation not
#                        permitted")
#   cgroup_manager = cgroupfs, events_logger = file   no systemd (PID 1 is not systemd)
# Exit: 0 ok, 1 a step or check failed, 2 usage, 77 skipped (test only).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$REPO/deploy/podman"
CMD=all
case "${1:-}" in
  all|test|images|up|rag|down|clean) CMD=$1; shift ;;
esac
BUILD_DIR=${SPARSEX_BUILD_DIR:-$REPO/build}
WORK=${SPARSEX_PODMAN_WORK:-/var/tmp/sparsex-podman}
MODELS=${SPARSEX_MODELS:-$(cd "$REPO/.." && pwd)/shared/models}
TAG=podman REQUESTS=24 JSON_OUT="" KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --json) JSON_OUT=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
    *) echo "up.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
NET=sparsex-podman
BASE=localhost/sparsex/debian:12-slim
KUBE=$WORK/sparsex-kube.yaml
CRED=$WORK/credentials
TENANT=podman
PODS=(sparsex-etcd-0 sparsex-cache-0 sparsex-worker-0 sparsex-router-0)
PYTHON=${SPARSEX_PYTHON:-$(command -v python3)}
[ -x /usr/bin/python3 ] && PYTHON=${SPARSEX_PYTHON:-/usr/bin/python3}

log() { echo "podman-up: $*" >&2; }
die() { echo "podman-up: error: $*" >&2; exit 1; }
skip() { echo "podman-up: SKIP: $*"; exit 77; }
step() { echo "== $*"; }

# ------------------------------------------------------------------------------ preflight
preflight() {  # preflight [test]: missing prerequisites skip (test) or fail
  local miss=() t
  [ "$(id -u)" = 0 ] || miss+=("root")
  for t in podman buildah debootstrap runc curl openssl; do command -v $t >/dev/null || miss+=("$t"); done
  "$PYTHON" -c 'import yaml' 2>/dev/null || miss+=("python3-yaml")
  if [ ${#miss[@]} -gt 0 ]; then
    [ "${1:-}" = test ] && skip "needs ${miss[*]} (apt-get install podman buildah debootstrap runc catatonit golang-github-containernetworking-plugin-dnsname)"
    die "needs ${miss[*]} (apt-get install podman buildah debootstrap runc catatonit golang-github-containernetworking-plugin-dnsname)"
  fi
}
check_build_dir() {
  local bin=$BUILD_DIR/bin b
  [ -d "$bin" ] || bin=$BUILD_DIR
  for b in sparsex-router sparsex-rag sparsex-worker sparsex-cache-server sparsex-cache-cli; do
    if [ ! -x "$bin/$b" ]; then
      [ "${1:-}" = test ] && skip "$bin/$b is not built"
      die "$bin/$b is not built (ninja -C $BUILD_DIR $b)"
    fi
  done
  if ldd "$bin/sparsex-worker" | grep 'libcudart' >/dev/null; then
    [ "${1:-}" = test ] && skip "$BUILD_DIR is a CUDA build (the images take a CPU build)"
    die "$BUILD_DIR is a CUDA build; the Debian images take a CPU build (-DSPARSEX_WITH_CUDA=OFF)"
  fi
}

setup_env() {
  mkdir -p "$WORK"
  cat >"$WORK/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$WORK/storage"
runroot = "$WORK/run"
EOF
  cat >"$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
  export CONTAINERS_CONF=$WORK/containers.conf CONTAINERS_STORAGE_CONF=$WORK/storage.conf
}

# ------------------------------------------------------------------------------- images
build_base() {
  if podman image exists "$BASE"; then
    log "base image $BASE exists (up.sh clean rebuilds it)"
    return
  fi
  step "base image: debootstrap --variant=minbase bookworm (Debian archive) -> $BASE"
  local root=$WORK/rootfs
  rm -rf "$root"
  mkdir -p "$WORK/debs"
  debootstrap --variant=minbase --cache-dir="$WORK/debs" bookworm "$root" \
    http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 ||
    { tail -n 20 "$WORK/debootstrap.log" >&2; die "debootstrap failed ($WORK/debootstrap.log)"; }
  # What debian:12-slim has: the three suites, no documentation, no apt lists or caches.
  cat >"$root/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
  rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log
  local c mnt
  c=$(buildah from scratch)
  mnt=$(buildah mount "$c")
  cp -a "$root/." "$mnt/"
  buildah umount "$c" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash --os linux --arch amd64 \
    --label org.opencontainers.image.description="Debian 12 minbase (debootstrap)" "$c"
  buildah commit -q --rm "$c" "$BASE" >/dev/null
  rm -rf "$root"
  log "base: $(podman image inspect "$BASE" --format '{{.Size}}') bytes"
}

build_images() {
  build_base
  step "staging the binaries of $BUILD_DIR (deploy/docker/stage.sh: ldd vs the package lists)"
  local ctx=$WORK/context
  rm -rf "$ctx"
  mkdir -p "$ctx/deploy/docker"
  cp -r "$REPO/deploy/docker/packages" "$ctx/deploy/docker/"
  SPARSEX_PYTHON=$PYTHON "$REPO/deploy/docker/stage.sh" --build-dir "$BUILD_DIR" \
    --dest "$ctx/staging" --strip cache-server router worker-cpu
  "$PYTHON" "$HERE/podman.py" containerfile --dockerfile "$REPO/deploy/docker/Dockerfile" \
    --out "$ctx/Containerfile"
  local t
  for t in cache-server router worker-cpu; do
    step "buildah bud --target $t (deploy/docker/Dockerfile's runtime stages)"
    buildah bud --isolation chroot --pull-never --build-arg DEBIAN_SLIM_IMAGE=$BASE \
      --target "$t" -t "localhost/sparsex/$t:$TAG" -f "$ctx/Containerfile" "$ctx" \
      >"$WORK/build-$t.log" 2>&1 ||
      { tail -n 30 "$WORK/build-$t.log" >&2; die "buildah bud $t failed ($WORK/build-$t.log)"; }
  done
  step "buildah bud etcd (deploy/podman/etcd.Containerfile: Debian's etcd-server)"
  buildah bud --isolation chroot --pull-never --build-arg DEBIAN_SLIM_IMAGE=$BASE \
    -t "localhost/sparsex/etcd:$TAG" -f "$HERE/etcd.Containerfile" "$ctx" \
    >"$WORK/build-etcd.log" 2>&1 ||
    { tail -n 30 "$WORK/build-etcd.log" >&2; die "buildah bud etcd failed ($WORK/build-etcd.log)"; }
  # The images these replaced (same tags) and intermediate stages: keeps <work> bounded.
  podman image prune -f >/dev/null
  inspect_images
}

# Inspection: configuration, files, and inside each image: every library of every binary (and
# of the UCX transport modules) resolves, and each binary starts (--help / --version).
inspect_images() {
  step "image inspection (buildah inspect; ldd and --help inside each image)"
  local report=$WORK/images.txt t img rc=0
  : >"$report"
  for t in cache-server router worker-cpu etcd; do
    img=localhost/sparsex/$t:$TAG
    {
      echo "### $img"
      buildah inspect --type image --format \
        'user {{.OCIv1.Config.User}}
entrypoint {{.OCIv1.Config.Entrypoint}}
cmd {{.OCIv1.Config.Cmd}}
exposed {{range $p, $v := .OCIv1.Config.ExposedPorts}}{{$p}} {{end}}
volumes {{range $p, $v := .OCIv1.Config.Volumes}}{{$p}} {{end}}
layers {{len .OCIv1.RootFS.DiffIDs}}
' "$img"
      podman image inspect "$img" --format 'id {{.Id}}
size {{.Size}} bytes'
    } >>"$report"
    # One script inside the image: list the binaries, ldd each (and UCX's modules), run --help.
    if ! podman run --rm --network none --user 0 --entrypoint /bin/sh "$img" -c '
        set -u; rc=0
        . /etc/os-release; echo "os $PRETTY_NAME"
        bins=$(ls /usr/local/bin/sparsex-* /usr/bin/etcd 2>/dev/null)
        for b in $bins; do echo "file $b $(stat -c %s "$b") bytes"; done
        for f in $bins /usr/lib/x86_64-linux-gnu/ucx/*.so.0; do
          [ -e "$f" ] || continue
          n=$(ldd "$f" | wc -l)
          if ldd "$f" | grep "not found"; then echo "LDD FAIL $f"; rc=1; else echo "ldd ok $f ($n libraries)"; fi
        done
        for b in $bins; do
          case $b in */etcd) "$b" --version | head -1 ;;
            *) out=$("$b" --help 2>&1); brc=$?
               # The binary ran (usage or a missing-flag message): the loader found everything.
               if [ $brc -ge 126 ] || echo "$out" | grep -q "error while loading shared libraries"; then
                 echo "START FAIL $b (rc $brc): $out" | head -3; rc=1
               else echo "starts $b (--help: rc $brc, $(echo "$out" | head -1))"; fi ;;
          esac
        done
        exit $rc' >>"$report" 2>&1; then
      rc=1
    fi
  done
  cat "$report"
  [ $rc = 0 ] || die "image inspection failed ($report)"
}

# ----------------------------------------------------------------------------------- up
pod_ip() {
  local infra
  infra=$(podman pod inspect "$1" --format '{{.InfraContainerID}}')
  podman inspect "$infra" --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}'
}
dump_logs() {
  local p c
  for p in "${PODS[@]}"; do
    for c in $(podman ps -a --filter "pod=$p" --format '{{.Names}}' 2>/dev/null); do
      case $c in *-infra) continue ;; esac
      podman logs "$c" >"$WORK/logs/$c.log" 2>&1 || true
      echo "--- $c (last lines; $WORK/logs/$c.log)" >&2
      tail -n 15 "$WORK/logs/$c.log" >&2 || true
    done
  done
}
cluster_up() {
  for t in cache-server router worker-cpu etcd; do
    podman image exists "localhost/sparsex/$t:$TAG" || die "image localhost/sparsex/$t:$TAG missing (up.sh images)"
  done
  [ -f "$MODELS/stories260K/stories260K.gguf" ] || die "no stories260K in $MODELS"
  step "podman kube play (deploy/k8s rendered by deploy/podman/podman.py)"
  mkdir -p "$WORK/logs"
  cluster_down quiet
  podman network create "$NET" >/dev/null
  "$REPO/deploy/local/make-credentials.sh" "$CRED" "$TENANT"
  rm -rf "$WORK/secret-volumes"
  "$PYTHON" "$HERE/podman.py" kube --k8s "$REPO/deploy/k8s" --out "$KUBE" --tag "$TAG" \
    --models-dir "$MODELS" --credentials "$CRED" --secret-volumes "$WORK/secret-volumes" >/dev/null
  grep '^#   ' "$KUBE" | sed 's/^#   /  changed: /'
  podman kube play --network "$NET" "$KUBE" >"$WORK/logs/play.log" 2>&1 ||
    { cat "$WORK/logs/play.log" >&2; dump_logs; die "podman kube play failed"; }
  podman pod ps --filter "network=$NET"
  local deadline=$((SECONDS + 120)) p
  declare -gA IP=()
  for p in "${PODS[@]}"; do IP[$p]=$(pod_ip "$p"); done
  log "pod addresses: etcd ${IP[sparsex-etcd-0]} cache ${IP[sparsex-cache-0]} worker ${IP[sparsex-worker-0]} router ${IP[sparsex-router-0]} (network $NET)"
  local checks=("http://${IP[sparsex-etcd-0]}:2379/health" "http://${IP[sparsex-cache-0]}:9470/healthz"
                "http://${IP[sparsex-worker-0]}:9460/healthz")
  local url
  for url in "${checks[@]}"; do
    until curl -fsS --max-time 2 "$url" >/dev/null 2>&1; do
      [ $SECONDS -lt $deadline ] || { dump_logs; die "$url not healthy after 120 s"; }
      sleep 0.5
    done
    log "healthy: $url -> $(curl -fsS --max-time 2 "$url")"
  done
  url="http://${IP[sparsex-router-0]}:8000/healthz"
  until curl -fsS --max-time 2 "$url" 2>/dev/null | grep -q '"healthy_workers":1'; do
    [ $SECONDS -lt $deadline ] || { dump_logs; die "router: no healthy worker after 120 s"; }
    sleep 0.5
  done
  log "healthy: $url -> $(curl -fsS --max-time 2 "$url")"
  echo "ROUTER_HTTP=${IP[sparsex-router-0]}:8000" >"$WORK/cluster.env"
  echo "ROUTER_GRPC=${IP[sparsex-router-0]}:50051" >>"$WORK/cluster.env"
  echo "WORKER_METRICS=${IP[sparsex-worker-0]}:9460" >>"$WORK/cluster.env"
  echo "CACHE_METRICS=${IP[sparsex-cache-0]}:9470" >>"$WORK/cluster.env"
  echo "API_KEY_FILE=$CRED/api_key.$TENANT" >>"$WORK/cluster.env"
}

metric() {  # metric HOST:PORT NAME [LABELS]: the sum of a metric's series (those with LABELS)
  curl -fsS --max-time 5 "http://$1/metrics" |
    awk -v m="$2" -v l="${3:-}" '($1 == m || index($1, m "{") == 1) && index($1, l) { s += $2 }
      END { printf "%d\n", s }'
}

# rag NAME SEED: the RAG workload from a container on the pods' network (the router image has
# sparsex-rag), against the router pod by name; summary in <work>/out/rag-NAME.json.
rag() {
  SPARSEX_API_KEY=$(cat "$API_KEY_FILE") podman run --rm --network "$NET" -e SPARSEX_API_KEY \
    -v "$MODELS:/models:ro" -v "$WORK/out:/out" \
    --entrypoint /usr/local/bin/sparsex-rag "localhost/sparsex/router:$TAG" \
    --target sparsex-router-0:50051 --docs /models/tinystories-text/tinystories_sample.txt \
    --requests "$REQUESTS" --pool 16 --docs_per_request 3 --max_tokens 16 --fidelity_every 4 \
    --seed "$2" --timeout_ms 120000 --progress=false --json "/out/rag-$1.json" ||
    { dump_logs; die "sparsex-rag ($1) failed"; }
}

# ---------------------------------------------------------------------------------- rag
run_rag() {
  # shellcheck disable=SC1091
  . "$WORK/cluster.env"
  mkdir -p "$WORK/out"
  chmod 0777 "$WORK/out"
  rm -f "$WORK"/out/*.json
  step "RAG workload (seed 1): sparsex-rag in a container (router image) -> sparsex-router-0:50051"
  rag compute 1
  step "one OpenAI-compatible request from the host (http://$ROUTER_HTTP/v1/completions)"
  local body='{"model":"stories260K","prompt":"Once upon a time","max_tokens":24,"temperature":0}'
  # The key goes to curl on stdin (a header file), not on its command line.
  printf 'Authorization: Bearer %s\n' "$(cat "$API_KEY_FILE")" |
    curl -fsS --max-time 60 "http://$ROUTER_HTTP/v1/completions" -H @- \
      -H 'Content-Type: application/json' -d "$body" | tee "$WORK/out/completion.json"
  echo
  local nokey
  nokey=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 \
    "http://$ROUTER_HTTP/v1/completions" -H 'Content-Type: application/json' -d "$body")
  log "the same request without the API key: HTTP $nokey"
  # The worker's write-backs to the cache server are asynchronous: wait until they stop.
  local wb last=-1
  for _ in $(seq 60); do
    wb=$(metric "$WORKER_METRICS" sparsex_worker_writeback_total 'result="ok"')
    [ "$wb" = "$last" ] && break
    last=$wb
    sleep 0.5
  done
  step "metrics after seed 1"
  curl -fsS "http://$ROUTER_HTTP/metrics" |
    grep -E '^sparsex_router_(requests_total|reused_tokens_total|new_tokens_total|recomputed_tokens_total)' |
    grep -v ' 0$' || true
  curl -fsS "http://$WORKER_METRICS/metrics" | grep -E '^sparsex_worker_writeback_total' || true
  curl -fsS "http://$CACHE_METRICS/metrics" |
    grep -E '^sparsex_cache_(commits|bytes_in|blocks)' | grep -v ' 0$' || true
  local reused commits
  reused=$(metric "$ROUTER_HTTP" sparsex_router_reused_tokens_total)
  commits=$(metric "$CACHE_METRICS" sparsex_cache_commits_total 'result="ok"')

  # A fresh worker process (empty memory and host tiers) must get the segments from the cache
  # server pod: over UCX (TCP) between the containers.
  step "restarting the worker container (SIGTERM: drain; a fresh process with empty tiers)"
  podman restart -t 60 sparsex-worker-0-worker >/dev/null ||
    { podman ps -a --filter pod=sparsex-worker-0 >&2; dump_logs; die "podman restart of the worker failed"; }
  local deadline=$((SECONDS + 120))
  until curl -fsS --max-time 2 "http://$ROUTER_HTTP/healthz" 2>/dev/null | grep -q '"healthy_workers":1' &&
        curl -fsS --max-time 2 "http://$WORKER_METRICS/healthz" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { dump_logs; die "worker not back after 120 s"; }
    sleep 0.5
  done
  log "worker back: $(curl -fsS --max-time 2 "http://$ROUTER_HTTP/healthz")"
  step "RAG workload (seed 2: the same documents in new combinations) on the fresh worker"
  rag fetch 2
  step "metrics after seed 2"
  curl -fsS "http://$CACHE_METRICS/metrics" |
    grep -E '^sparsex_cache_(hits|bytes_out|lookups)' | grep -v ' 0$' || true
  local hits out reads
  hits=$(metric "$CACHE_METRICS" sparsex_cache_hits_total)
  out=$(metric "$CACHE_METRICS" sparsex_cache_bytes_out_total)
  reads=$(metric "$CACHE_METRICS" sparsex_cache_requests_total 'method="read"')
  "$PYTHON" - "$WORK/out" "$REQUESTS" "$reused" "$wb" "$commits" "$hits" "$out" "$reads" \
      "${JSON_OUT:-$WORK/out/podman.json}" "$nokey" <<'EOF'
import json, sys
d = sys.argv[1]
compute = json.load(open(f"{d}/rag-compute.json"))
fetch = json.load(open(f"{d}/rag-fetch.json"))
comp = json.load(open(f"{d}/completion.json"))
requests, reused, wb, commits, hits, out, reads = (int(a) for a in sys.argv[2:9])
nokey = int(sys.argv[10])
checks = {
    "an OpenAI request without the API key is refused (401)": nokey == 401,
    "seed 1: every RAG request ok": compute["ok"] == requests and compute["failed"] == 0,
    "seed 1: segments reused": compute["reused_tokens"] > 0 and reused > 0,
    "seed 1: worker wrote segments back, cache server committed them": wb > 0 and commits > 0,
    "OpenAI completion from the host has text": bool(comp["choices"][0]["text"]),
    "seed 2 (fresh worker): every RAG request ok": fetch["ok"] == requests and fetch["failed"] == 0,
    "seed 2: segments fetched from the cache server pod, none failed":
        fetch["segments_fetched"] > 0 and fetch["fetch_failures"] == 0 and hits > 0 and out > 0,
    "seed 2: the KV bytes went over UCX between the pods (no inline gRPC reads)": reads == 0,
    "seed 2: segments reused": fetch["reused_tokens"] > 0,
}
summary = {"rag_seed1": compute, "rag_seed2_fresh_worker": fetch,
           "completion": comp["choices"][0]["text"], "router_reused_tokens_seed1": reused,
           "worker_writebacks_ok": wb, "cache_commits_ok": commits, "cache_hits": hits,
           "cache_bytes_out": out, "cache_inline_reads": reads,
           "openai_without_key_http_status": nokey, "checks": checks}
json.dump(summary, open(sys.argv[9], "w"), indent=1)
for k in ("reused_tokens", "recomputed_tokens", "new_tokens", "segments_fetched",
          "fetch_failures", "ttft_reuse_mean_ms", "ttft_baseline_mean_ms", "exact",
          "fidelity_samples"):
    print(f"{k:24s} seed 1: {compute[k]:>10}   seed 2 (fresh worker): {fetch[k]:>10}")
for k, v in checks.items():
    print(f"check: {'ok  ' if v else 'FAIL'} {k}")
sys.exit(0 if all(checks.values()) else 1)
EOF
}

# --------------------------------------------------------------------------------- down
cluster_down() {
  local quiet=${1:-}
  if [ -f "$KUBE" ]; then podman kube down "$KUBE" >/dev/null 2>&1 || true; fi
  local p v
  for p in "${PODS[@]}"; do podman pod rm -f -t 10 "$p" >/dev/null 2>&1 || true; done
  for v in data-sparsex-etcd-0 data-sparsex-cache-0; do
    podman volume rm -f "$v" >/dev/null 2>&1 || true
  done
  podman network rm -f "$NET" >/dev/null 2>&1 || true
  [ -n "$quiet" ] || log "pods, volumes and network removed (images kept; up.sh clean removes them)"
}

# --------------------------------------------------------------------------------- main
case "$CMD" in
  test)
    [ "${SPARSEX_PODMAN_TEST:-}" = 1 ] ||
      skip "set SPARSEX_PODMAN_TEST=1 to run (builds images, minutes; root, podman, buildah, debootstrap)"
    preflight test; check_build_dir test ;;
  all|images) preflight; check_build_dir ;;
  *) preflight ;;
esac
setup_env
case "$CMD" in
  images) build_images ;;
  up) cluster_up ;;
  rag) run_rag ;;
  down) cluster_down ;;
  clean)
    cluster_down quiet
    buildah rm --all >/dev/null 2>&1 || true
    podman rmi -a -f >/dev/null 2>&1 || true
    rm -rf "$WORK"
    log "removed $WORK" ;;
  all|test)
    start=$SECONDS
    [ "$KEEP" = 1 ] || trap 'cluster_down' EXIT
    build_images
    cluster_up
    run_rag
    log "done in $((SECONDS - start)) s"
    ;;
esac
