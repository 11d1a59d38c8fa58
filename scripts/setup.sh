#!/usr/bin/env bash
# Installs every Debian package SparseX needs. Idempotent and non-interactive.
set -euo pipefail
PKGS=(build-essential cmake ninja-build ccache pkg-config git python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  librocksdb-dev libucx-dev ucx-utils libabsl-dev libcivetweb-dev civetweb
  nlohmann-json3-dev libxxhash-dev libpcre2-dev libicu-dev
  libgtest-dev libgmock-dev etcd-server prometheus curl iproute2 nodejs libssl-dev openssl
  python3-yaml python3-kubernetes python3-jinja2
  clang libclang-rt-dev)  # clang + its sanitizer/libFuzzer runtimes: scripts/fuzz.sh
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm (the real-client tests install the openai and @grpc/grpc-js packages with it): Debian's
# nodejs ships without it, NodeSource's nodejs includes it.
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "setup: all packages present"
