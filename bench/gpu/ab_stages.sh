#!/usr/bin/env bash
# Two builds in one device call: the staged binaries of the working tree (.stage/serve.tar.gz)
# against an earlier stage (.stage/old.tar.gz: SPX_STAGE_KEEP_OLD=1 bench/gpu/stage_serve.sh
# keeps the previous one there), so a kernel change is judged against a baseline measured on the
# same card minutes apart (separate calls differ by ~6 ms on a 32K reuse prefill).
#   1. the new build's attention GPU tests ($SPX_AB_TESTS, a gtest filter; default every
#      AttentionConsistency case) and cuda_engine_test (stories260K greedy against the CPU);
#   2. gpu_prefill_bench's single-op rows at 32K of both builds (attention kernels in TFLOP/s,
#      the statistics passes);
#   3. reuse_prefill_bench at 32K (8 x 4064 stored segments shuffled + 256 new, F = 2, r = 0.15)
#      of both builds, median of 7 (SPX_AB_REUSE_ENV: environment for both, e.g.
#      SPX_ATTN_IMPL=wgmma-ws), with the card's clocks and power sampled beside each
#      (bench/gpu/clocks_summary.py);
#   4. the transformers baseline at 32K for the ratios.
# Writes to $OUT: ab.log (the summary) and all.tgz (every log and JSON).
#
#   OUT=/tmp/out bench/gpu/ab_stages.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=ab
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX (the new build), SPARSEX_MODELS
F=$OUT/raw
mkdir -p "$F"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
[ -e "$ROOT/.stage/old.tar.gz" ] || { stamp "no .stage/old.tar.gz to compare with"; exit 1; }
OLD=/tmp/spx-old
rm -rf "$OLD" && mkdir -p "$OLD" && tar -C "$OLD" -xzf "$ROOT/.stage/old.tar.gz"
stamp "old build: $(head -n 1 "$OLD/spx/STAGED_FROM" 2>/dev/null)"
OLD_ENV="LD_LIBRARY_PATH=$OLD/spx/lib:$LD_LIBRARY_PATH"

timeout 300 "$SPX/bin/backend_consistency_test" --gtest_brief=1 \
  --gtest_filter="${SPX_AB_TESTS:-AttentionConsistency.*}" >"$F/tests.log" 2>&1
stamp "backend_consistency_test exit $?"
grep -E "FAILED|PASSED|SKIPPED|Failure|Expected|Which is" "$F/tests.log" | head -n 20 | tee -a "$LOG"
timeout 120 "$SPX/bin/cuda_engine_test" --gtest_brief=1 >"$F/engine.log" 2>&1
stamp "cuda_engine_test exit $?"
grep -E "FAILED|PASSED|SKIPPED" "$F/engine.log" | head -n 5 | tee -a "$LOG"

for v in new old; do
  bin=$SPX/bin env=()
  [ $v = old ] && bin=$OLD/spx/bin env=("$OLD_ENV")
  env "${env[@]}" timeout 150 "$bin/gpu_prefill_bench" --lengths 32768 --reps 3 --warmup 1 \
    --decode-steps 0 --out "$F/micro_$v.json" >"$F/micro_$v.log" 2>&1
  stamp "single ops, $v build: exit $?"
  grep -E "attention \(1 layer, .*wgmma|statistics" "$F/micro_$v.log" | tee -a "$LOG"
done
for v in new old; do
  bin=$SPX/bin env=()
  [ $v = old ] && bin=$OLD/spx/bin env=("$OLD_ENV")
  # shellcheck disable=SC2086  # SPX_AB_REUSE_ENV holds VAR=value words, REUSE_32K flags
  OUT=$F sample_clocks "reuse_$v" env "${env[@]}" ${SPX_AB_REUSE_ENV:-} timeout 150 \
    "$bin/reuse_prefill_bench" $REUSE_32K --reps 7 --warmup 1 --cases full,reuse_device \
    --out "$F/reuse_$v.json" >"$F/reuse_$v.log" 2>&1
  stamp "reuse prefill 32K, $v build: exit $?"
  grep -E "^full|^reuse" "$F/reuse_$v.log" | tee -a "$LOG"
done
# Both builds' clocks and power over their reuse runs: a change that only removes idle time
# gains nothing on a power-capped card.
python3 "$ROOT/bench/gpu/clocks_summary.py" "$F/clocks_reuse_new.csv" "$F/clocks_reuse_old.csv" \
  --out "$F/clocks.json" | tee -a "$LOG"
stamp "transformers baseline 32K"
timeout 150 python3 "$ROOT/bench/gpu/hf_baseline.py" --lengths 32768 --reps 3 --warmup 1 \
  --out "$F/hf.json" 2>&1 | grep -v Warning | tail -n 2 | tee -a "$LOG"
python3 - "$F" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
f = sys.argv[1]
def load(n):
    try: return json.load(open(os.path.join(f, n)))
    except Exception: return None
base = next((r["ms"] for r in (load("hf.json") or {}).get("records", []) if r.get("tokens") == 32768), None)
for v in ("new", "old"):
    for c in (load(f"reuse_{v}.json") or []):
        if c.get("case") != "reuse_device": continue
        print(f"{v}: reuse {c['ms']:.1f} ms, {c['ms'] / c['full_ms']:.3f}x our full ({c['full_ms']:.1f})"
              + (f", {c['ms'] / base:.3f}x transformers ({base:.1f})" if base else ""))
PY
stamp "done"
(cd "$OUT" && tar -czf all.tgz raw && rm -rf raw)
