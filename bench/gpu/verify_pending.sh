#!/usr/bin/env bash
# The GPU paths built while no device machine could be started (sessions 15-17), checked and
# measured in one device call from the staged binaries (bench/gpu/stage_serve.sh; the call
# carries .stage). Session 18 ran it on an H100 in ~3 minutes (docs/benchmarks.md, the fetch
# table; docs/perf-notes.md "Session 18"); kept to re-check these paths after a change:
#   1. their GPU tests: BackendConsistency.DrawRowsOnTheDevice (greedy and Gumbel-max rows; its
#      pass turned SPX_DEVICE_SAMPLING on by default), AsyncBf16UploadsFromPinnedMemory and the
#      other async-upload cases;
#   2. gpu_prefill_bench's decode steps (batch 1 and 32 at 8K context): logits downloaded
#      against tokens drawn on the device, greedy and at temperature 1, in one run;
#   3. bench/gpu/fetch.sh with the default worker flags (pinned, in-place streamed fetch) and,
#      time allowing, with --cache_fetch_pinned_mb 0 (session 14's path) for the comparison.
# Writes to $OUT: verify.log (the summary), bc.log, decode.log, decode.json, fetch_<v>/.
#
#   OUT=/tmp/out bench/gpu/verify_pending.sh     # SPX_VERIFY_BUDGET_S (default 540)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=verify
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
FINAL=$OUT
BUDGET=${SPX_VERIFY_BUDGET_S:-540}
T_START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T_START) )); }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$LOG"

stamp "GPU tests of the pending paths"
timeout 120 "$SPX/bin/backend_consistency_test" --gtest_brief=1 \
  --gtest_filter='*DrawRows*:*AsyncBf16*:*LargeTransfers*' >"$FINAL/bc.log" 2>&1
stamp "backend_consistency_test exit $?"
grep -E "FAILED|PASSED|Failure|Expected|Which is|row [0-9]+" "$FINAL/bc.log" | head -n 30 | tee -a "$LOG"

stamp "decode: logits downloaded vs drawn on the device"
timeout 150 "$SPX/bin/gpu_prefill_bench" --lengths 2048 --reps 1 --warmup 0 --no-micro \
  --decode-ctx 8192 --decode-steps 20 --decode-batch 32 --out "$FINAL/decode.json" \
  >"$FINAL/decode.log" 2>&1
stamp "gpu_prefill_bench exit $?"
grep -E "device:|decode batch" "$FINAL/decode.log" | tee -a "$LOG"

W="--kv_blocks 4096 --prefill_chunk 4096 --device_tier_mb 12000 --host_store_mb 20000 \
--fetch_wait_ms -1 --store_after_misses 1"
for v in default pageable; do
  if [ "$(left)" -lt 150 ]; then stamp "fetch $v skipped ($(left) s left)"; continue; fi
  extra=""
  [ "$v" = pageable ] && extra="--cache_fetch_pinned_mb 0"
  stamp "fetch $v"
  OUT=$FINAL/fetch_$v SPX_FETCH_WORKER_ARGS="$W $extra" timeout $(( $(left) - 10 )) \
    bash "$ROOT/bench/gpu/fetch.sh" >"$FINAL/fetch_$v.out" 2>&1
  stamp "fetch $v exit $?"
  python3 - "$FINAL/fetch_$v/fetch.json" "$v" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("fetch_over_tier", "tier_ttft_median_ms", "fetch_gb_per_s", "in_place_bytes",
        "stream_wait_ms", "stream_upload_ms")
print(sys.argv[2], {k: r.get(k) for k in keys}, "steps:", r.get("steps"))
PY
done
stamp "done"
