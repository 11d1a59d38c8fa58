# Sourced by the GPU machine's scripts (serve.sh, checks.sh, fetch.sh, ...) with ROOT and
# SPX_SCRIPT (the script's name) set: OUT (default /tmp/spx-<name>-out), LOG ($OUT/<name>.log)
# and stamp() (a timestamped line into LOG and stdout) unless the caller defined stamp()
# already (a device command sourcing this file by hand); then unpacks the staged binaries
# (bench/gpu/stage_serve.sh -> .stage/serve.tar.gz, carried by the device call) into $SPX once
# per call, points the loader, UCX and PATH at them, and SPARSEX_MODELS at the staged test
# models (stories260K, TinyStories text) unless set; REUSE_32K holds reuse_prefill_bench's flags
# for the benchmark's reuse case (32K: 8 x 4064 stored segments shuffled + 256 new, F = 2, r = 0.15);
# sample_clocks NAME CMD... runs CMD with nvidia-smi sampling the clocks and power every 50 ms
# into $OUT/clocks_NAME.csv (bench/gpu/clocks_summary.py reads them).
SPX_SCRIPT=${SPX_SCRIPT:-gpu}
OUT=${OUT:-/tmp/spx-$SPX_SCRIPT-out}
mkdir -p "$OUT"
if ! declare -F stamp >/dev/null; then
  LOG=$OUT/$SPX_SCRIPT.log
  T0=$(date +%s)
  stamp() { echo "[$SPX_SCRIPT.sh +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
fi
LOG=${LOG:-$OUT/$SPX_SCRIPT.log}
SPX=/tmp/spx
# A warm machine keeps /tmp between calls: unpack again whenever the tarball changed.
STAGE_SUM=$(md5sum "$ROOT/.stage/serve.tar.gz" 2>/dev/null | cut -d' ' -f1)
if [ -z "$STAGE_SUM" ] || [ "$(cat "$SPX/.stage_sum" 2>/dev/null)" != "$STAGE_SUM" ]; then
  rm -rf "$SPX" && tar -C /tmp -xzf "$ROOT/.stage/serve.tar.gz" || { stamp "no staged binaries"; exit 1; }
  echo "$STAGE_SUM" >"$SPX/.stage_sum"
fi
[ -e "$SPX/STAGED_FROM" ] && stamp "staged from $(head -n 1 "$SPX/STAGED_FROM")$( [ "$(wc -l <"$SPX/STAGED_FROM")" -gt 1 ] && echo ' (with uncommitted changes)')"
export LD_LIBRARY_PATH=$SPX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$SPX/lib/ucx PATH=$SPX/bin:$PATH
# cuda_engine_test and the checks read stories260K from here (a device command that forgot
# this failed the five stories260K tests on a missing model, not on the GPU).
export SPARSEX_MODELS=${SPARSEX_MODELS:-$SPX/models}
# cuDNN comes with the machine's PyTorch wheels, not with the CUDA toolkit.
CUDNN_DIR=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$CUDNN_DIR" ] && export LD_LIBRARY_PATH=$CUDNN_DIR:$LD_LIBRARY_PATH
for b in sparsex-worker sparsex-router sparsex-cache-server sparsex-loadgen; do
  [ -e "$SPX/bin/$b" ] || continue  # a lean stage (SPX_STAGE_LEAN=1) has no services
  if ldd "$SPX/bin/$b" | grep "not found"; then stamp "$b: missing libraries"; exit 1; fi
done
REUSE_32K="--model synthetic:llama3-8b --device cuda --segments 8 --segment-tokens 4064 \
--new-tokens 256 --full-layers 2 --ratio 0.15"
# The card's SM clock, power and clock event reasons beside a command (a power-capped card runs
# at the clock its limit allows: docs/perf-notes.md). The command's exit status is
# returned; nvidia-smi is stopped by PID.
sample_clocks() {
  local name=$1 reasons=clocks_event_reasons.active
  shift
  nvidia-smi --help-query-gpu 2>/dev/null | grep -q "$reasons" ||
    reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu="timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
utilization.gpu,$reasons" --format=csv,noheader,nounits -lms 50 >"$OUT/clocks_$name.csv" \
    2>/dev/null &
  local smi=$!
  "$@"
  local rc=$?
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  return $rc
}
