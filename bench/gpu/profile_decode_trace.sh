#!/usr/bin/env bash
# Where a decode step's time goes in the real run, from the staged binaries (bench/gpu/
# stage_serve.sh; the device call carries .stage): the staged CUPTI tracer
# (bench/gpu_trace/cupti_trace.cc) records gpu_prefill_bench's --profile-decode range, 11
# graph-replayed decode steps at 8K context with greedy drawn on the device (the serving path),
# kernels overlapping under programmatic dependent launch as they do in serving, unlike
# profile_decode.sh's Nsight Compute (kernels serialised one at a time). bench/gpu/nsys_gaps.py
# sums the kernel time by name and the idle time between kernels; divided by 11 that is per step.
# Writes to $OUT: profile_decode_trace.log, decode_trace_<B>.json (the bench's own step times),
# trace_<B>.csv.gz and gaps_<B>.json.
#
#   OUT=/tmp/out bench/gpu/profile_decode_trace.sh   # SPX_TRACE_BATCHES (default "1 32"),
#                                                    # SPX_TRACE_CTX (8192)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=profile_decode_trace
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
TRACER=$SPX/lib/libspx_cupti_trace.so
[ -e "$TRACER" ] || { stamp "no staged CUPTI tracer"; exit 1; }
for B in ${SPX_TRACE_BATCHES:-1 32}; do
  stamp "decode steps, batch $B, under the CUPTI tracer"
  CUDA_INJECTION64_PATH=$TRACER SPX_CUPTI_OUT=$OUT/trace_$B.csv timeout 240 \
    "$SPX/bin/gpu_prefill_bench" --lengths 16 --reps 1 --warmup 0 --no-micro \
    --decode-ctx "${SPX_TRACE_CTX:-8192}" --decode-steps 14 --decode-batch "$B" \
    --profile-decode "$B" --out "$OUT/decode_trace_$B.json" >>"$LOG" 2>&1
  stamp "gpu_prefill_bench exit $?"
  grep -E "decode batch $B at" "$LOG" | tail -n 4
  if [ -s "$OUT/trace_$B.csv" ]; then
    python3 "$ROOT/bench/gpu/nsys_gaps.py" "$OUT/trace_$B.csv" --out "$OUT/gaps_$B.json" --top 5 \
      | tee -a "$LOG"
    gzip -f "$OUT/trace_$B.csv" "$OUT/trace_$B.csv.api.csv" 2>/dev/null
  fi
done
stamp done
