#!/usr/bin/env bash
# Where a decode step's time goes, from the staged binaries (bench/gpu/
# stage_serve.sh; the device call carries .stage): Nsight Compute times every kernel of
# `gpu_prefill_bench`'s decode steps at 8K context (batch 1 and batch 32, plain launches and
# CUDA graphs) with one metric (gpu__time_duration.sum, clocks left alone), written as CSV;
# bench/gpu/ncu_steps.py splits it into steps and sums the kernels by kind. The same binary's
# own step times (without the profiler) come first, as the baseline the kernel sums are read
# against: their difference is the launch gaps.
# Writes to $OUT: profile_decode.log, decode_plain_<n>.json, ncu_decode.csv.gz, ncu_steps.json.
#
#   OUT=/tmp/out bench/gpu/profile_decode.sh     # SPX_PROFILE_BATCH (32), SPX_PROFILE_CTX (8192),
#                                                # SPX_PROFILE_REPEATS (2 unprofiled runs)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=profile_decode
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
ARGS="--lengths 16 --reps 1 --warmup 0 --no-micro --decode-ctx ${SPX_PROFILE_CTX:-8192} --decode-batch ${SPX_PROFILE_BATCH:-32}"
for rep in $(seq 1 "${SPX_PROFILE_REPEATS:-2}"); do  # batch 32's step varies run to run
  stamp "decode steps without the profiler ($rep)"
  timeout 200 "$SPX/bin/gpu_prefill_bench" $ARGS --decode-steps 24 --out "$OUT/decode_plain_$rep.json" >>"$LOG" 2>&1
  stamp "gpu_prefill_bench exit $?"
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then stamp "no ncu on this machine"; exit 0; fi
stamp "ncu ($NCU)"
timeout 400 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
  --log-file "$OUT/ncu_decode.csv" "$SPX/bin/gpu_prefill_bench" $ARGS --decode-steps 5 >>"$LOG" 2>&1
stamp "ncu exit $?"
python3 "$ROOT/bench/gpu/ncu_steps.py" "$OUT/ncu_decode.csv" --batch "${SPX_PROFILE_BATCH:-32}" \
  --json "$OUT/ncu_steps.json" 2>&1 | tee -a "$LOG"
gzip -f "$OUT/ncu_decode.csv"
stamp "done"
