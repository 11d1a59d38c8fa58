#!/usr/bin/env bash
# The timeline of one 32K reuse prefill under Nsight Systems (issue 15): where the wall time
# that no kernel accounts for goes. Nsight Compute (profile_prefill.sh) times each kernel alone,
# serialised; this traces the real run (kernels overlapping under programmatic dependent launch,
# launch gaps, host stalls) between reuse_prefill_bench --profile-range's cudaProfilerStart/Stop,
# then bench/gpu/nsys_gaps.py sums kernel time, idle gaps and the largest gaps with the kernels
# around them. From the staged binaries (bench/gpu/stage_serve.sh; the device call carries
# .stage). Writes to $OUT: nsys_prefill.log, nsys_trace.csv.gz, nsys_gaps.json.
#
#   OUT=/tmp/out bench/gpu/nsys_prefill.sh     # SPX_NSYS_ARGS: extra reuse_prefill_bench flags
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=nsys_prefill
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys \
  2>/dev/null | head -1)
if [ -z "$NSYS" ]; then stamp "no nsys on this machine"; exit 0; fi
stamp "nsys: $NSYS"
TMPD=$(mktemp -d)
timeout 240 "$NSYS" profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda \
  --sample=none --cpuctxsw=none -o "$TMPD/reuse" -f true \
  "$SPX/bin/reuse_prefill_bench" $REUSE_32K --reps 1 --warmup 1 \
  --cases full,reuse_device --profile-range reuse_device ${SPX_NSYS_ARGS:-} \
  --out "$OUT/nsys_reuse.json" >>"$LOG" 2>&1
stamp "nsys profile exit $?"
timeout 120 "$NSYS" stats -q -r cuda_gpu_trace -f csv -o "$TMPD/trace" "$TMPD/reuse.nsys-rep" \
  >>"$LOG" 2>&1
stamp "nsys stats exit $?"
CSV=$(ls "$TMPD"/trace*.csv 2>/dev/null | head -1)
if [ -n "$CSV" ]; then
  python3 "$ROOT/bench/gpu/nsys_gaps.py" "$CSV" --out "$OUT/nsys_gaps.json" | tee -a "$LOG"
  gzip -c "$CSV" >"$OUT/nsys_trace.csv.gz"
fi
rm -rf "$TMPD"
