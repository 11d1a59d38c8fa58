# Sourced by the GPU machine's scripts (serve.sh, checks.sh, fetch.sh): unpacks the staged
# binaries (bench/gpu/stage_serve.sh -> .stage/serve.tar.gz, carried by the device call) into
# $SPX once per call and points the loader, UCX and PATH at them. Needs ROOT and stamp().
SPX=/tmp/spx
# A warm machine keeps /tmp between calls: unpack again whenever the tarball changed.
STAGE_SUM=$(md5sum "$ROOT/.stage/serve.tar.gz" 2>/dev/null | cut -d' ' -f1)
if [ -z "$STAGE_SUM" ] || [ "$(cat "$SPX/.stage_sum" 2>/dev/null)" != "$STAGE_SUM" ]; then
  rm -rf "$SPX" && tar -C /tmp -xzf "$ROOT/.stage/serve.tar.gz" || { stamp "no staged binaries"; exit 1; }
  echo "$STAGE_SUM" >"$SPX/.stage_sum"
fi
export LD_LIBRARY_PATH=$SPX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$SPX/lib/ucx PATH=$SPX/bin:$PATH
# cuDNN comes with the machine's PyTorch wheels, not with the CUDA toolkit.
CUDNN_DIR=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$CUDNN_DIR" ] && export LD_LIBRARY_PATH=$CUDNN_DIR:$LD_LIBRARY_PATH
for b in sparsex-worker sparsex-router sparsex-cache-server sparsex-loadgen; do
  if ldd "$SPX/bin/$b" | grep "not found"; then stamp "$b: missing libraries"; exit 1; fi
done
