#!/usr/bin/env bash
# Where a 32K prefill's GPU time goes (targets: reuse prefill against 0.20x transformers, full
# prefill against 0.83x), from the staged binaries (bench/gpu/stage_serve.sh; the device call
# carries .stage). Nsight Compute times every kernel of one prefill with one metric
# (gpu__time_duration.sum, clocks and caches left alone) and bench/gpu/ncu_sum.py sums them by
# kernel and grid (an element-wise kernel on the full layers' and the sparse layers' rows apart;
# cuBLASLt's persistent GEMMs launch one grid for both, so an earlier phase split came from
# the CSV's launch order, docs/perf-notes.md):
#   1. one reuse prefill (8 x 4064 stored segments shuffled + 256 new, F = 2, r = 0.15):
#      reuse_prefill_bench --profile-range reuse_device runs it once more between
#      cudaProfilerStart/Stop, and ncu --profile-from-start off sees only that run;
#   2. the full prefill of the same prompt (--profile-range full);
#   3. the selection statistics by complement (the cuDNN path's second pass; gpu_prefill_bench's
#      single-op row, one launch) with Nsight Compute's throughput, occupancy, scheduler and
#      warp-state sections: why a key tile costs what it does;
#   4. (attn, not by default) the ws attention kernel on the single-op sparse rows, one launch,
#      with those sections, every warp-stall reason and each pipe's utilisation.
# The kernel sums count no overlap and no launch gaps: read them against the unprofiled times
# the same binaries print. Writes to $OUT: profile_prefill.log, ncu_*.csv.gz, *_kernels.json.
#
#   OUT=/tmp/out bench/gpu/profile_prefill.sh     # SPX_PROFILE_STEPS (default "reuse full stats")
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=profile_prefill
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then stamp "no ncu on this machine"; exit 0; fi
STEPS=" ${SPX_PROFILE_STEPS:-reuse full stats} "
PROF="$NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw"
R="$REUSE_32K --reps 1 --warmup 0"

for c in reuse_device full; do
  step=${c#reuse_}; step=${step/device/reuse}
  [[ $STEPS == *" $step "* ]] || continue
  cases=full; [ "$c" = full ] || cases=full,$c
  stamp "one $c prefill under ncu"
  timeout 240 $PROF --profile-from-start off --log-file "$OUT/ncu_$c.csv" \
    "$SPX/bin/reuse_prefill_bench" $R --cases "$cases" --profile-range "$c" \
    --out "$OUT/reuse_$c.json" >>"$LOG" 2>&1
  stamp "ncu exit $?"
  python3 "$ROOT/bench/gpu/ncu_sum.py" "$OUT/ncu_$c.csv" --by-grid --top 40 \
    --json "$OUT/${c}_kernels.json" 2>&1 | tee -a "$LOG"
done

if [[ $STEPS == *" stats "* ]]; then
  # gpu_prefill_bench's statistics rows launch FlashKernel<128, true, 8> 7 times direct, then 7
  # times by complement: the 10th launch is a complement one.
  stamp "statistics by complement, one launch, ncu sections"
  SPX_MICRO_IMPLS=mma timeout 200 "$NCU" --clock-control none --kernel-name-base mangled \
    -k regex:FlashKernelILi128ELb1ELi8E --launch-skip 9 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    "$SPX/bin/gpu_prefill_bench" --lengths 32768 --reps 1 --warmup 0 --decode-steps 0 \
    --out "$OUT/stats_micro.json" >"$OUT/ncu_stats.txt" 2>&1
  stamp "ncu exit $?"
  grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issued Warp|No Eligible|Active Warps|Eligible Warps|Warp Cycles|Stall|Compute \(SM\)|Memory Throughput|L1/TEX Hit|L2 Hit|DRAM Throughput" \
    "$OUT/ncu_stats.txt" | head -n 40 | tee -a "$LOG"
fi
if [[ $STEPS == *" attn "* ]]; then
  # The ws attention kernel (WgmmaFlashKernel<3>) on gpu_prefill_bench's 4929 sparse rows: with
  # --reps 1 --warmup 1 its launches are causal warmup, causal, sparse warmup, sparse, so the
  # third is a sparse-rows one. Sections plus every warp-stall reason and pipe utilisation:
  # what a key tile waits on (the producer's stages, the MMAs, the softmax's latency).
  stamp "ws attention on sparse rows, one launch, ncu sections"
  SPX_MICRO_IMPLS=no-pp,no-pipe timeout 200 "$NCU" --clock-control none \
    --kernel-name-base mangled -k regex:WgmmaFlashKernelILi3E --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
    "$SPX/bin/gpu_prefill_bench" --lengths 32768 --reps 1 --warmup 1 --decode-steps 0 \
    --out "$OUT/attn_micro.json" >"$OUT/ncu_attn.txt" 2>&1
  stamp "ncu exit $?"
  grep -E "Duration|Registers|Issued Warp|No Eligible|Active Warps|Eligible Warps|Warp Cycles|stalled|pipe_|Compute \(SM\)|Memory Throughput|Shared|Bank" \
    "$OUT/ncu_attn.txt" | grep -vE " 0(\.0+)?$" | head -n 80 | tee -a "$LOG"
fi
gzip -f "$OUT"/ncu_*.csv 2>/dev/null
stamp "done"
