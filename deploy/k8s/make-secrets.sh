#!/usr/bin/env bash
# Makes the credentials the kustomization turns into Secrets (secretGenerator in
# kustomization.yaml), under deploy/k8s/secrets/ (ignored by git: key material is never
# committed). Run it once before `kubectl apply -k deploy/k8s`:
#
#   deploy/k8s/make-secrets.sh [tenant ...]      (default tenant: "default")
#
# It runs deploy/local/make-credentials.sh (openssl) into deploy/k8s/secrets (the folder next to
# kustomization.yaml that its secretGenerator reads; kustomize reads nothing outside it):
#   tls/ca.pem                      cluster CA certificate -> ca.crt of every sparsex-tls-* Secret
#   tls/<role>.pem, <role>-key.pem  router, worker, cache  -> tls.crt, tls.key of sparsex-tls-<role>
#   api_keys.json, scope.key        the router's key file  -> Secret sparsex-api-keys
#   kv_mac.key                      the workers' KV MAC key -> Secret sparsex-kv-mac
#   tls/ca-key.pem                  the CA's private key: NOT in any Secret; move it offline
#   api_key.<tenant>                each tenant's API key: NOT in any Secret; hand it to the tenant
# A second run keeps what exists and adds tenants (api_keys.json is rewritten to list every
# api_key.* file); `kubectl apply -k` then updates sparsex-api-keys in place, and the routers
# re-read it (the mounted file changes within about a minute; no restart).
#
# Your own PKI instead: put the same files at the same paths (the certificates must carry the
# DNS SAN sparsex.cluster and both serverAuth and clientAuth), or replace a sparsex-tls-<role>
# Secret by one of type kubernetes.io/tls with the keys ca.crt, tls.crt, tls.key (e.g. made by
# cert-manager) and drop its secretGenerator entry.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=$HERE/secrets
case "${1:-}" in -h|--help) sed -n '2,24p' "$0"; exit 0 ;; -*) echo "make-secrets: unknown option $1" >&2; exit 2 ;; esac
"$HERE/../local/make-credentials.sh" "$DIR" "$@"
# Every file the kustomization reads must be there (a partial folder from another tool fails
# here, not halfway through `kubectl apply -k`).
for f in tls/ca.pem tls/router.pem tls/router-key.pem tls/worker.pem tls/worker-key.pem \
         tls/cache.pem tls/cache-key.pem api_keys.json scope.key kv_mac.key; do
  [ -s "$DIR/$f" ] || { echo "make-secrets: $DIR/$f is missing" >&2; exit 1; }
done
echo "make-secrets: credentials in $DIR"
echo "  Secrets (kubectl apply -k $HERE): sparsex-tls-router, sparsex-tls-worker, sparsex-tls-cache, sparsex-api-keys, sparsex-kv-mac"
echo "  keep offline, never in the cluster: $DIR/tls/ca-key.pem"
for k in "$DIR"/api_key.*; do
  echo "  API key of tenant ${k##*/api_key.}: $k"
done
