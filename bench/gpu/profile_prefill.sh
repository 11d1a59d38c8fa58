#!/usr/bin/env bash
# Where a 32K prefill's GPU time goes (issue 15: full prefill 0.88x transformers against the
# 0.83x target, reuse prefill 0.27x against 0.20x), from the staged binaries (bench/gpu/
# stage_serve.sh; the device call carries .stage). Nsight Compute times every kernel with one
# metric (gpu__time_duration.sum, clocks and caches left alone) and bench/gpu/ncu_sum.py sums
# them by kernel:
#   1. gpu_prefill_bench: one 32K full prefill (synthetic Llama-3-8B);
#   2. reuse_prefill_bench (8 x 4064 stored segments + 256 new, F = 2, r = 0.15) twice: with
#      the full case only, and with the reuse case too; their difference, halved, is one reuse
#      prefill (the benchmark runs it timed and then profiled). SPX_CUDNN_STATS passes through.
# The kernel sums count no overlap and no launch gaps: read them against the unprofiled times
# the same binaries print (docs/perf-notes.md has the last ones).
# Writes to $OUT: profile_prefill.log, ncu_*.csv.gz, prefill_kernels.json, reuse_kernels.json.
#
#   OUT=/tmp/out bench/gpu/profile_prefill.sh     # SPX_PROFILE_TOKENS (32768)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=profile_prefill
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then stamp "no ncu on this machine"; exit 0; fi
PROF="$NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw"
N=${SPX_PROFILE_TOKENS:-32768}

stamp "full prefill $N under ncu"
timeout 200 $PROF --log-file "$OUT/ncu_full.csv" "$SPX/bin/gpu_prefill_bench" --lengths "$N" \
  --reps 1 --warmup 0 --decode-steps 0 --no-micro --out "$OUT/prefill_plain.json" >>"$LOG" 2>&1
stamp "ncu exit $?"
python3 "$ROOT/bench/gpu/ncu_sum.py" "$OUT/ncu_full.csv" --json "$OUT/prefill_kernels.json" \
  2>&1 | tee -a "$LOG"

R="--model synthetic:llama3-8b --device cuda --segments 8 --segment-tokens 4064 --new-tokens 256 \
--full-layers 2 --ratio 0.15 --reps 1 --warmup 0"
for c in full full,reuse_device; do
  stamp "reuse_prefill_bench --cases $c under ncu"
  timeout 200 $PROF --log-file "$OUT/ncu_reuse_${c//,/_}.csv" "$SPX/bin/reuse_prefill_bench" $R \
    --cases "$c" --out "$OUT/reuse_${c//,/_}.json" >>"$LOG" 2>&1
  stamp "ncu exit $?"
done
python3 "$ROOT/bench/gpu/ncu_sum.py" "$OUT/ncu_reuse_full_reuse_device.csv" \
  --minus "$OUT/ncu_reuse_full.csv" --scale 2 --json "$OUT/reuse_kernels.json" 2>&1 | tee -a "$LOG"
gzip -f "$OUT"/ncu_*.csv
stamp "done"
