#!/usr/bin/env bash
# Makes a SparseX cluster's credentials with openssl (docs/security.md):
#   DIR/tls/ca.pem, ca-key.pem        the cluster CA (keep ca-key.pem offline in production)
#   DIR/tls/<role>.pem, <role>-key.pem  one certificate per role (router, worker, cache), each
#                                     naming the cluster (DNS:sparsex.cluster), for mutual TLS
#   DIR/scope.key                     32 random bytes (hex) keying the tenants' KV scope salts
#   DIR/kv_mac.key                    32 random bytes (hex): the workers' MAC key for cluster KV
#                                     blocks (workers only; the cache servers never get it)
#   DIR/api_keys.json                 the router's key file: SHA-256 of each key, never the key
#   DIR/api_key.<tenant>              one API key per tenant (give it to that tenant only)
#
#   deploy/local/make-credentials.sh DIR [tenant ...]      (default tenant: "default")
# Existing files are kept, so a second run adds nothing and breaks nothing.
set -euo pipefail
DIR=${1:?usage: make-credentials.sh DIR [tenant ...]}
shift
TENANTS=("$@")
[ ${#TENANTS[@]} -gt 0 ] || TENANTS=(default)
command -v openssl >/dev/null || { echo "make-credentials: openssl not found" >&2; exit 1; }
umask 077
mkdir -p "$DIR/tls"
T="$DIR/tls"
if [ ! -s "$T/ca.pem" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 365 \
    -keyout "$T/ca-key.pem" -out "$T/ca.pem" -subj "/CN=sparsex cluster CA" 2>/dev/null
fi
for role in router worker cache; do
  [ -s "$T/$role.pem" ] && continue
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$T/$role-key.pem" -out "$T/$role.csr" -subj "/CN=sparsex-$role" 2>/dev/null
  printf 'subjectAltName=DNS:sparsex.cluster\nextendedKeyUsage=serverAuth,clientAuth\n' >"$T/$role.ext"
  openssl x509 -req -in "$T/$role.csr" -CA "$T/ca.pem" -CAkey "$T/ca-key.pem" -CAcreateserial \
    -days 365 -out "$T/$role.pem" -extfile "$T/$role.ext" 2>/dev/null
  rm -f "$T/$role.csr" "$T/$role.ext"
done
[ -s "$DIR/scope.key" ] || openssl rand -hex 32 >"$DIR/scope.key"
[ -s "$DIR/kv_mac.key" ] || openssl rand -hex 32 >"$DIR/kv_mac.key"
for t in "${TENANTS[@]}"; do
  [ -s "$DIR/api_key.$t" ] || echo "sk-spx-$(openssl rand -hex 24)" >"$DIR/api_key.$t"
done
# The key file lists every tenant key present in DIR.
python3 - "$DIR" <<'PY'
import glob, hashlib, json, os, sys
d = sys.argv[1]
keys = []
for p in sorted(glob.glob(os.path.join(d, "api_key.*"))):
    tenant = p.rsplit("api_key.", 1)[1]
    key = open(p).read().strip()
    keys.append({"sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": tenant,
                 "name": tenant + "-1"})
tmp = os.path.join(d, "api_keys.json.tmp")
with open(tmp, "w") as f:
    json.dump({"keys": keys}, f, indent=2)
os.replace(tmp, os.path.join(d, "api_keys.json"))
PY
for f in "$T"/*.pem; do
  case "$f" in *-key.pem) chmod 600 "$f" ;; *) chmod 644 "$f" ;; esac
done
