#!/usr/bin/env bash
# Decode matmuls and the fetch path on the GPU machine (docs/perf-notes.md),
# from the staged binaries (bench/gpu/stage_serve.sh; the device call carries .stage): the GPU
# tests (every small-n variant and the fused gate_up + SwiGLU against the CPU, graph-replayed
# decode fused vs separate), then `gpu_prefill_bench --small-n` (every variant per decode shape,
# fused vs separate, decode steps per configuration at 8K context), then sparsex-fetch-bench on
# this host (the worker's fetch path alone, bf16 wire, default UCX transports and shared memory
# only), to place the cluster fetch's 1.6 GB/s.
# Writes to $OUT: small_n.log, small_n_tests.log, small_n.json, fetch_bench_{default,shm}.json.
#
#   OUT=/tmp/out bench/gpu/small_n.sh      # SPX_SKIP_FETCH=1 skips the fetch bench
# The cross-worker run's shape (8 segments, a 32 GB arena): SPX_FETCH_SEGMENTS=8
# SPX_FETCH_BENCH_ARGS="--arena_mb 32768".
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=small_n
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader \
  >>"$LOG" 2>&1

stamp "GPU tests"
timeout 420 "$SPX/bin/backend_consistency_test" --gtest_brief=1 >>"$OUT/small_n_tests.log" 2>&1
stamp "backend_consistency_test exit $?"
timeout 240 "$SPX/bin/cuda_engine_test" --gtest_brief=1 >>"$OUT/small_n_tests.log" 2>&1
stamp "cuda_engine_test exit $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is" \
  "$OUT/small_n_tests.log" | head -40 | tee -a "$LOG"

stamp "gpu_prefill_bench --small-n"
timeout 300 "$SPX/bin/gpu_prefill_bench" --small-n --decode-steps ${SPX_DECODE_STEPS:-40} \
  --out "$OUT/small_n.json" >>"$LOG" 2>&1
stamp "gpu_prefill_bench exit $?"

if [ "${SPX_SKIP_FETCH:-0}" != 1 ]; then
  for tls in default shm; do
    arg=""; [ "$tls" = shm ] && arg="--ucx_tls sysv,posix,self"
    stamp "sparsex-fetch-bench ($tls transports)"
    timeout 150 "$SPX/bin/sparsex-fetch-bench" --segments ${SPX_FETCH_SEGMENTS:-4} --iters 2 \
      --wire_dtype bf16 $arg ${SPX_FETCH_BENCH_ARGS:-} --json "$OUT/fetch_bench_$tls.json" >>"$LOG" 2>&1
    stamp "sparsex-fetch-bench exit $?"
  done
fi
stamp "done"
