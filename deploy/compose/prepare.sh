#!/usr/bin/env bash
# Makes the credentials compose.yaml mounts, under deploy/compose/secrets/ (ignored by git: key
# material is never committed). Run it once before `docker compose up` / `podman-compose up`:
#
#   deploy/compose/prepare.sh [tenant ...]      (default tenant: "default")
#
# It runs deploy/local/make-credentials.sh (openssl) into secrets/ and lays out each role's files
# under the names the images read (deploy/docker/Dockerfile), as deploy/k8s mounts its Secrets:
#   secrets/router/tls/{ca.crt,tls.crt,tls.key}   router.pem, router-key.pem, ca.pem
#   secrets/router/auth/{api_keys.json,scope.key}  the router's key file and scope key
#   secrets/worker/tls/{ca.crt,tls.crt,tls.key}   worker.pem, worker-key.pem, ca.pem
#   secrets/worker/kv-mac/kv_mac.key               the workers' MAC key for cluster KV blocks
#   secrets/cache/tls/{ca.crt,tls.crt,tls.key}    cache.pem, cache-key.pem, ca.pem
#   secrets/tls/ca-key.pem                        the CA's private key: mounted nowhere
#   secrets/api_key.<tenant>                      each tenant's API key: hand it to the tenant
# The containers run as uid 10001 (not the host user), so the mounted files are world-readable
# (0444) inside a secrets/ directory only its owner can enter (0700): other host users cannot
# reach them, and each container sees only its own role's files. A second run keeps every key and
# adds tenants; the router re-reads api_keys.json without a restart (the file is replaced in its
# mounted directory).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=$HERE/secrets
case "${1:-}" in -h|--help) sed -n '2,22p' "$0"; exit 0 ;; -*) echo "prepare: unknown option $1" >&2; exit 2 ;; esac
"$HERE/../local/make-credentials.sh" "$DIR" "$@"
chmod 700 "$DIR"
T=$DIR/tls
for f in ca.pem router.pem router-key.pem worker.pem worker-key.pem cache.pem cache-key.pem; do
  [ -s "$T/$f" ] || { echo "prepare: $T/$f is missing" >&2; exit 1; }
done
# Copies replaced atomically (a rename in the same directory), so a running process never reads a
# half-written file.
put() {  # put SRC DEST
  install -m 0444 "$1" "$2.tmp" && mv -f "$2.tmp" "$2"
}
role_tls() {  # role_tls ROLE DESTDIR
  mkdir -p "$2" && chmod 755 "$2"
  put "$T/ca.pem" "$2/ca.crt"
  put "$T/$1.pem" "$2/tls.crt"
  put "$T/$1-key.pem" "$2/tls.key"
}
role_tls router "$DIR/router/tls"
role_tls worker "$DIR/worker/tls"
role_tls cache "$DIR/cache/tls"
chmod 755 "$DIR/worker" "$DIR/cache"
# Workers only: a cache server that never holds it cannot forge a block a worker accepts.
[ -s "$DIR/kv_mac.key" ] || { echo "prepare: $DIR/kv_mac.key is missing" >&2; exit 1; }
mkdir -p "$DIR/worker/kv-mac" && chmod 755 "$DIR/worker/kv-mac"
put "$DIR/kv_mac.key" "$DIR/worker/kv-mac/kv_mac.key"
mkdir -p "$DIR/router/auth" && chmod 755 "$DIR/router" "$DIR/router/auth"
put "$DIR/api_keys.json" "$DIR/router/auth/api_keys.json"
put "$DIR/scope.key" "$DIR/router/auth/scope.key"
echo "prepare: credentials in $DIR"
echo "  keep offline: $T/ca-key.pem"
for k in "$DIR"/api_key.*; do
  echo "  API key of tenant ${k##*/api_key.}: $k"
done
