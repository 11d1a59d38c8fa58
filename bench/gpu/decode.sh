#!/usr/bin/env bash
# Batched decode on the GPU machine, from the staged binaries (bench/gpu/
# stage_serve.sh; the device call carries .stage): the attention tests (every batched-decode
# kernel against the CPU), then gpu_prefill_bench's decode section once per decode attention
# kernel (SPX_DECODE_ATTN=tile | auto | packed32): the one-layer kernel micro-benchmark (all
# three kernels, GB/s of K/V read) and the whole decode step at batch 1 and batch
# $SPX_DECODE_BATCH (default 32) over 8K contexts, synthetic Llama-3-8B.
# Writes to $OUT: decode.log, decode_tests.log, decode_<kernel>.json.
#
#   OUT=/tmp/out bench/gpu/decode.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=decode
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader \
  >>"$LOG" 2>&1

stamp "GPU tests"
timeout 420 "$SPX/bin/backend_consistency_test" --gtest_brief=1 >>"$OUT/decode_tests.log" 2>&1
stamp "backend_consistency_test exit $?"
timeout 300 "$SPX/bin/cuda_engine_test" --gtest_brief=1 >>"$OUT/decode_tests.log" 2>&1
stamp "cuda_engine_test exit $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|decode kernel" \
  "$OUT/decode_tests.log" | head -40 | tee -a "$LOG"

for k in ${SPX_DECODE_KERNELS:-tile auto packed32}; do
  stamp "decode, SPX_DECODE_ATTN=$k"
  SPX_DECODE_ATTN=$k timeout 240 "$SPX/bin/gpu_prefill_bench" --lengths 2048 --reps 1 \
    --warmup 0 --no-micro --decode-ctx 8192 --decode-steps ${SPX_DECODE_STEPS:-40} \
    --decode-batch ${SPX_DECODE_BATCH:-32} --out "$OUT/decode_$k.json" 2>&1 \
    | grep -E "device:|decode" | tee -a "$LOG"
done
stamp "done"
