#!/usr/bin/env bash
# Installs the SparseX binaries of each runtime image into a staging folder (one root file
# system per image, copied into the image with `COPY --from=build /staging/<image>/ /`) and
# checks with ldd that the image provides every shared library they need.
#
#   deploy/docker/stage.sh --build-dir DIR --dest DIR [--strip] [--skip-missing] IMAGE...
#
# IMAGE (or `all`):
#   cache-server  sparsex-cache-server, sparsex-cache-cli  -> <dest>/cache-server/usr/local/bin
#   router        sparsex-router, sparsex-rag              -> <dest>/router/usr/local/bin
#   worker-cpu    sparsex-worker                           -> <dest>/worker-cpu/usr/local/bin
#   worker-cuda   sparsex-worker (bundled)                 -> <dest>/worker-cuda/opt/sparsex
#
# The Debian images (debian:12-slim) install the packages of deploy/docker/packages/<image>.txt;
# every library ldd resolves for the binaries, and for the UCX transport modules they load at
# runtime, must belong to one of those packages or to their Depends (libcheck.py packages).
# The CUDA worker runs on nvidia/cuda's runtime image (Ubuntu 24.04), whose packages differ
# from the Debian build stage's: every library it needs beyond packages/worker-cuda.base (glibc,
# libstdc++, CUDA) is copied into /opt/sparsex/lib and found through the wrapper
# /opt/sparsex/bin/sparsex-worker, which sets LD_LIBRARY_PATH and execs the binary
# (libcheck.py bundle).
#
# --strip        strip debug symbols from the staged copies (images; not the build tree)
# --skip-missing exit 77 (ctest: skipped) when a binary is not built, instead of failing
# Exit: 0 ok, 1 a library check failed, 2 usage or a missing binary, 77 skipped.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
BUILD_DIR="" DEST="" STRIP=0 SKIP_MISSING=0 IMAGES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    --strip) STRIP=1; shift ;;
    --skip-missing) SKIP_MISSING=1; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    all) IMAGES+=(cache-server router worker-cpu worker-cuda); shift ;;
    cache-server|router|worker-cpu|worker-cuda) IMAGES+=("$1"); shift ;;
    *) echo "stage.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$BUILD_DIR" ] && [ -n "$DEST" ] && [ ${#IMAGES[@]} -gt 0 ] ||
  { echo "usage: stage.sh --build-dir DIR --dest DIR [--strip] [--skip-missing] IMAGE..." >&2; exit 2; }
BIN="$BUILD_DIR/bin"
[ -d "$BIN" ] || BIN="$BUILD_DIR"
PYTHON=${SPARSEX_PYTHON:-$(command -v python3)}

binaries() {
  case "$1" in
    cache-server) echo sparsex-cache-server sparsex-cache-cli ;;
    router) echo sparsex-router sparsex-rag ;;
    worker-cpu|worker-cuda) echo sparsex-worker ;;
  esac
}

for image in "${IMAGES[@]}"; do
  for b in $(binaries "$image"); do
    if [ ! -x "$BIN/$b" ]; then
      if [ "$SKIP_MISSING" = 1 ]; then
        echo "stage.sh: SKIP: $BIN/$b is not built"
        exit 77
      fi
      echo "stage.sh: $BIN/$b not found (build it first)" >&2
      exit 2
    fi
  done
done

rc=0
for image in "${IMAGES[@]}"; do
  root="$DEST/$image"
  rm -rf "$root"
  if [ "$image" = worker-cuda ]; then
    mkdir -p "$root/opt/sparsex/bin" "$root/opt/sparsex/libexec" "$root/opt/sparsex/lib"
    install -m 0755 "$BIN/sparsex-worker" "$root/opt/sparsex/libexec/sparsex-worker"
    [ "$STRIP" = 0 ] || strip --strip-debug "$root/opt/sparsex/libexec/sparsex-worker"
    cat >"$root/opt/sparsex/bin/sparsex-worker" <<'EOF'
#!/bin/sh
# Runs the worker with the libraries bundled from its Debian 12 build (deploy/docker/stage.sh).
root=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH=$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
exec "$root/libexec/sparsex-worker" "$@"
EOF
    chmod 0755 "$root/opt/sparsex/bin/sparsex-worker"
    "$PYTHON" "$HERE/libcheck.py" bundle --lib-dir "$root/opt/sparsex/lib" \
      --base "$HERE/packages/worker-cuda.base" "$root/opt/sparsex/libexec/sparsex-worker" || rc=1
    # The wrapper must start the bundled binary (here: with this machine's glibc).
    if ! "$root/opt/sparsex/bin/sparsex-worker" --help >/dev/null 2>&1; then
      echo "stage.sh: $root/opt/sparsex/bin/sparsex-worker --help failed" >&2
      rc=1
    fi
  elif cuda_bins=$(for b in $(binaries "$image"); do
                     ldd "$BIN/$b" | grep 'libcudart\.so' >/dev/null && echo "$b"; done; true) &&
       [ -n "$cuda_bins" ]; then
    # (grep reads all of ldd's output: with pipefail, grep -q's early exit would fail ldd with
    # SIGPIPE at random.) A CUDA build tree: the Debian images (cache-server, router, worker-cpu) are built with
    # -DSPARSEX_WITH_CUDA=OFF, so their package lists cannot be checked against binaries that
    # link CUDA here (worker-cuda covers the CUDA libraries).
    echo "stage.sh: $image: $(echo $cuda_bins) link CUDA in this build tree; skipped (the image builds without CUDA)"
    continue
  else
    mkdir -p "$root/usr/local/bin"
    files=()
    for b in $(binaries "$image"); do
      install -m 0755 "$BIN/$b" "$root/usr/local/bin/$b"
      [ "$STRIP" = 0 ] || strip --strip-debug "$root/usr/local/bin/$b"
      files+=("$root/usr/local/bin/$b")
    done
    "$PYTHON" "$HERE/libcheck.py" packages --list "$HERE/packages/$image.txt" --base libc6 \
      "${files[@]}" || rc=1
  fi
  echo "stage.sh: $image -> $root ($(du -sh "$root" | cut -f1))"
done
exit $rc
