#!/usr/bin/env bash
# Stages the service binaries for the GPU machine (Ubuntu 24.04 without gRPC, RocksDB, UCX or
# civetweb): the Debian-built binaries (CUDA on, sm_90a) with every shared library ldd resolves
# outside glibc, libstdc++/libgcc and CUDA, UCX's transport modules and etcd (static), as one
# gzip tarball under .stage/ (git-ignored), which a device call carries (`carry: [".stage"]`).
#
#   scripts/build.sh && bench/gpu/stage_serve.sh     # then bench/gpu/serve.sh runs there
#   SPX_STAGE_LEAN=1 bench/gpu/stage_serve.sh       # kernel tests and benchmarks only
#   SPX_STAGE_KEEP_OLD=1 ...                         # the previous stage kept as .stage/old.tar.gz
#                                                    # (bench/gpu/ab_stages.sh compares the two)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${SPARSEX_BIN_DIR:-$ROOT/build/bin}
STAGE=$ROOT/.stage
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/spx/bin" "$TMP/spx/lib" "$STAGE"
# The GPU tests, benchmarks and CLI travel too (bench/gpu/checks.sh runs them there), with the
# small test models (stories260K, TinyStories text) from $SPARSEX_MODELS.
BINS="sparsex-worker sparsex-router sparsex-cache-server sparsex-loadgen sparsex-rag sparsex \
  backend_consistency_test cuda_engine_test reuse_prefill_bench gpu_prefill_bench sparsex-fetch-bench \
  sampling_bench"
# SPX_STAGE_LEAN=1: the kernel tests and benchmarks only (~19 MB instead of ~52: the carry limit
# is 64 MiB with the working tree, so a call that also carries other files needs this).
if [ "${SPX_STAGE_LEAN:-0}" = 1 ]; then
  BINS="backend_consistency_test cuda_engine_test reuse_prefill_bench gpu_prefill_bench"
fi
for b in $BINS; do
  [ -x "$BIN/$b" ] || { echo "stage_serve: $BIN/$b missing (build first)" >&2; exit 1; }
  cp "$BIN/$b" "$TMP/spx/bin/"
  strip --strip-unneeded "$TMP/spx/bin/$b"
  ldd "$BIN/$b" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*) ;;
      libcuda.so*|libcudart*|libcublas*|libcudnn*|libnccl*|libnvrtc*) ;;  # the machine's CUDA
      *) [ -e "$TMP/spx/lib/$(basename "$lib")" ] || cp -L "$lib" "$TMP/spx/lib/" ;;
    esac
  done
done
# The CUPTI timeline tracer (bench/gpu/nsys_prefill.sh on machines without nsys) with the
# toolkit's libcupti it was built against.
TRACER=${BIN%/bin}/lib/libspx_cupti_trace.so
if [ -e "$TRACER" ]; then
  cp "$TRACER" "$TMP/spx/lib/"
  ldd "$TRACER" | awk '/libcupti/ {print $3}' | xargs -r -I{} cp -L {} "$TMP/spx/lib/"
fi
if [ "${SPX_STAGE_LEAN:-0}" != 1 ]; then
  cp -r /usr/lib/x86_64-linux-gnu/ucx "$TMP/spx/lib/ucx"
  cp /usr/bin/etcd "$TMP/spx/bin/"
fi
cp "$ROOT/deploy/local/cluster.sh" "$ROOT/deploy/local/make-credentials.sh" "$TMP/spx/"
MODELS=${SPARSEX_MODELS:-$(cd "$ROOT/.." && pwd)/shared/models}
mkdir -p "$TMP/spx/models"
cp -r "$MODELS/stories260K" "$MODELS/tinystories-text" "$TMP/spx/models/"
strip --strip-unneeded "$TMP/spx/lib/"*.so* 2>/dev/null || true
# Which tree the binaries were built from (read before trusting a stage).
{ git -C "$ROOT" rev-parse HEAD; git -C "$ROOT" status --short --untracked-files=no; } \
  >"$TMP/spx/STAGED_FROM" 2>/dev/null
if [ "${SPX_STAGE_KEEP_OLD:-0}" = 1 ] && [ -e "$STAGE/serve.tar.gz" ]; then
  mv "$STAGE/serve.tar.gz" "$STAGE/old.tar.gz"
fi
cp "$TMP/spx/STAGED_FROM" "$STAGE/STAGED_FROM"
tar -C "$TMP" -czf "$STAGE/serve.tar.gz" spx
ls -la "$STAGE/serve.tar.gz"
