#!/usr/bin/env bash
# Installs every Debian package SparseX needs. Idempotent and non-interactive.
set -euo pipefail
PKGS=(build-essential cmake ninja-build ccache pkg-config git python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  librocksdb-dev libucx-dev ucx-utils libabsl-dev libcivetweb-dev civetweb
  nlohmann-json3-dev libxxhash-dev libpcre2-dev
  libgtest-dev libgmock-dev etcd-server prometheus curl iproute2)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "setup: all packages present"
