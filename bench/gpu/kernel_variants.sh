#!/usr/bin/env bash
# The CUDA kernel paths and their selectable alternatives, checked and timed in one device call
# from the staged binaries (bench/gpu/stage_serve.sh; the call carries .stage): run it on a new
# card, or after a kernel change, to re-check the defaults against the alternatives they beat.
# The switches and their measured figures are in docs/perf-notes.md ("Tried and not adopted")
# and docs/operations.md ("GPU kernel switches").
# This call:
#   0. the matmul tests (DecodeMatMulConsistency.*, the RoPE + K/V write and the Hopper gate_up
#      + SwiGLU kernel's), cuda_engine_test, then decode steps
#      at 8K, batch 1 and 32, with the defaults, twice (each line carries a hash of the greedy
#      tokens, which must be the same in both runs);
#   1. the attention GPU tests (AttentionConsistency.*: the complement case with cuDNN required,
#      a fallback fails it), the ws, ping-pong, ws pipelined, ws 128 and ws 128 with row sums on
#      MMA cases alone under a short timeout each (a hang there must not eat the call; later
#      steps skip a variant that failed);
#   2. reuse_prefill_bench at 32K (8 x 4064 stored segments shuffled + 256 new, F = 2, r = 0.15,
#      the benchmark case of docs/benchmarks.md) in the same call: the defaults (SPX_VERIFY_REUSE can add
#      SPX_ATTN_IMPL=wgmma-ws-128-lsum, the row sums on MMA: lsum; wgmma-ws, 64-key tiles:
#      stats1_ws64; wgmma-ws-pipe: stats1_pipe; wgmma-ws-128,
#      the default's kernel forced: stats1_ws128; the assembly layer by layer, --assemble-ahead 0:
#      no_ahead; SPX_STATS_RECV_SPLIT=1, on by default: stats1_ws_split;
#      SPX_CUDNN_STATS=0 with plain wgmma: stats0; the cuDNN statistics with plain wgmma:
#      stats1; ping-pong: stats1_pp);
#   3. gpu_prefill_bench's single-op rows at 32K: one causal layer and 15% sparse rows per
#      attention kernel (TFLOP/s), the statistics pass direct and by complement (received
#      attention split and unsplit, and without it);
#   4. the transformers baseline at 32K (bench/gpu/hf_baseline.py) for the ratios, time allowing;
#   5. (step 0 times the decode steps.)
# Writes to $OUT: verify.log (the summary) and all.tgz (bc.log, ws.log, reuse_<v>.json/.log,
# micro.json/.log, hf.json, early.log, engine.log, decode_<round>.json/.log: a device call
# brings back only a few files).
#
#   OUT=/tmp/out bench/gpu/kernel_variants.sh     # SPX_VERIFY_BUDGET_S (default 540),
#                                                # SPX_VERIFY_REUSE (reuse variants: stats0 stats1
#                                                # stats1_ws no_ahead stats1_pp stats1_ws_split
#                                                # stats1_pipe stats1_ws128 stats1_ws64 lsum;
#                                                # no_ahead: --assemble-ahead 0)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=verify
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS, cuDNN on the path
FINAL=$OUT
BUDGET=${SPX_VERIFY_BUDGET_S:-540}
T_START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T_START) )); }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
stamp "cuDNN from: ${CUDNN_DIR:-the loader path}"

timeout 150 "$SPX/bin/backend_consistency_test" --gtest_brief=1 \
  --gtest_filter='DecodeMatMulConsistency.*:BackendConsistency.RopeWriteKv*:BackendConsistency.Sm90GemmSwiGlu*' \
  >"$FINAL/early.log" 2>&1
stamp "decode matmul tests exit $?"
grep -E "FAILED|PASSED|Failure|Expected|Which is" "$FINAL/early.log" | head -n 12 | tee -a "$LOG"
timeout 150 "$SPX/bin/cuda_engine_test" --gtest_brief=1 >"$FINAL/engine.log" 2>&1
stamp "cuda_engine_test exit $?"
grep -E "FAILED|PASSED|Failure|tests ran" "$FINAL/engine.log" | head -n 12 | tee -a "$LOG"
for round in 1 2; do
  timeout 90 "$SPX/bin/gpu_prefill_bench" --lengths 16 --reps 1 --warmup 0 --no-micro \
    --decode-ctx 8192 --decode-steps 24 --decode-batch 32 \
    --out "$FINAL/decode_$round.json" >"$FINAL/decode_$round.log" 2>&1
  stamp "decode steps, round $round: exit $?"
  grep -E "greedy on the device" "$FINAL/decode_$round.log" | tee -a "$LOG"
done
# The greedy tokens' hashes (one per decode mode and batch) must be the same in both runs: a
# read racing a write would change them.
if [ "$(grep -o 'tokens [0-9a-f]*' "$FINAL/decode_2.log")" = "$(grep -o 'tokens [0-9a-f]*' "$FINAL/decode_1.log")" ]; then
  stamp "decode_2: greedy tokens as in decode_1"
else
  stamp "decode_2: GREEDY TOKENS DIFFER from decode_1"
fi

stamp "attention GPU tests"
# The complement test runs its cases three ways (~70 s on an H100, its CPU
# reference the slow part), the rest ~70 s.
timeout 240 "$SPX/bin/backend_consistency_test" --gtest_brief=1 \
  --gtest_filter='AttentionConsistency.*-*WarpSpecialized*:*WsPingPong*:*WsPipelined*:*Ws128*' \
  >"$FINAL/bc.log" 2>&1
stamp "backend_consistency_test exit $?"
grep -E "FAILED|PASSED|SKIPPED|Failure|Expected|Which is|seed" "$FINAL/bc.log" | head -n 40 \
  | tee -a "$LOG"
# A kernel variant's test alone under a short timeout (a hang must not eat the call): name,
# gtest filter, what; the exit status is the test's (124: timed out).
alone() {
  timeout 60 "$SPX/bin/backend_consistency_test" --gtest_brief=1 --gtest_filter="$2" \
    >"$FINAL/$1.log" 2>&1
  local rc=$?
  stamp "$3 attention test exit $rc (124: timed out, a hang)"
  grep -E "FAILED|PASSED|SKIPPED|Failure|Expected|Which is|seed" "$FINAL/$1.log" | head -n 20 \
    | tee -a "$LOG"
  return $rc
}
alone ws '*WarpSpecialized*' warp-specialised
WS_RC=$?
alone pp '*WsPingPong*' "ws ping-pong"
PP_RC=$?
alone wspipe '*WsPipelined*' "ws pipelined"
PIPE_RC=$?
alone ws128 '*Ws128Wgmma*' "ws 128-key tiles"
WS128_RC=$?
alone lsum '*Ws128RowSum*' "ws 128 with row sums on MMA"
LSUM_RC=$?

reuse() {  # name, then environment assignments (VAR=value) and benchmark flags (--flag value)
  local name=$1; shift
  local envs=() flags=()
  while [ $# -gt 0 ]; do
    case "$1" in --*) flags+=("$1" "$2"); shift 2;; *) envs+=("$1"); shift;; esac
  done
  stamp "reuse prefill 32K, ${envs[*]} ${flags[*]}"
  # shellcheck disable=SC2086  # REUSE_32K holds flags
  env "${envs[@]}" timeout 150 "$SPX/bin/reuse_prefill_bench" $REUSE_32K --reps 5 --warmup 1 \
    --cases full,reuse_device "${flags[@]}" \
    --out "$FINAL/reuse_$name.json" >"$FINAL/reuse_$name.log" 2>&1
  stamp "reuse_prefill_bench exit $?"
  # Whether cuDNN served (plan builds) or the backend fell back to its own kernel.
  grep -E "cuDNN|unavailable" "$FINAL/reuse_$name.log" | head -n 4 | tee -a "$LOG"
  grep -vE "^\s*$" "$FINAL/reuse_$name.log" | tail -n 6 | tee -a "$LOG"
}
# SPX_VERIFY_REUSE picks the variants (default: the defaults alone; the others, the row sums on
# MMA included, have their H100 figures in docs/perf-notes.md).
VARIANTS=" ${SPX_VERIFY_REUSE:-stats1_ws} "
[[ $VARIANTS == *" stats0 "* ]] && reuse stats0 SPX_CUDNN_STATS=0 SPX_ATTN_IMPL=wgmma
[[ $VARIANTS == *" stats1 "* ]] && reuse stats1 SPX_CUDNN_STATS=1 SPX_ATTN_IMPL=wgmma
[ "$WS_RC" = 0 ] && [[ $VARIANTS == *" stats1_ws "* ]] && reuse stats1_ws
[[ $VARIANTS == *" no_ahead "* ]] && reuse no_ahead --assemble-ahead 0
[ "$PP_RC" = 0 ] && [[ $VARIANTS == *" stats1_pp "* ]] && reuse stats1_pp SPX_ATTN_IMPL=wgmma-ws-pp
[[ $VARIANTS == *" stats1_ws_split "* ]] && reuse stats1_ws_split SPX_STATS_RECV_SPLIT=1
[ "$PIPE_RC" = 0 ] && [[ $VARIANTS == *" stats1_pipe "* ]] && reuse stats1_pipe SPX_ATTN_IMPL=wgmma-ws-pipe
[ "$WS128_RC" = 0 ] && [[ $VARIANTS == *" stats1_ws128 "* ]] &&
  reuse stats1_ws128 SPX_ATTN_IMPL=wgmma-ws-128
[ "$WS_RC" = 0 ] && [[ $VARIANTS == *" stats1_ws64 "* ]] && reuse stats1_ws64 SPX_ATTN_IMPL=wgmma-ws
[ "$LSUM_RC" = 0 ] && [[ $VARIANTS == *" lsum "* ]] && reuse lsum SPX_ATTN_IMPL=wgmma-ws-128-lsum

stamp "single ops at 32K (attention kernels, statistics passes)"
MICRO_ENV=""
[ "$PP_RC" = 0 ] || MICRO_ENV="SPX_MICRO_IMPLS=no-pp"
[ "$PIPE_RC" = 0 ] || MICRO_ENV="${MICRO_ENV:-SPX_MICRO_IMPLS=},no-pipe"
[ "$WS128_RC" = 0 ] || MICRO_ENV="${MICRO_ENV:-SPX_MICRO_IMPLS=},no-ws128"
[ "$LSUM_RC" = 0 ] || MICRO_ENV="${MICRO_ENV:-SPX_MICRO_IMPLS=},no-lsum"
[ "$WS_RC" = 0 ] || MICRO_ENV="SPX_MICRO_IMPLS=mma"  # the wgmma rows include the ws variant
env $MICRO_ENV timeout 200 "$SPX/bin/gpu_prefill_bench" --lengths 32768 --reps 1 --warmup 1 \
  --decode-steps 0 --out "$FINAL/micro.json" >"$FINAL/micro.log" 2>&1
stamp "gpu_prefill_bench exit $?"
grep -E "device:|attention \(1 layer|statistics" "$FINAL/micro.log" | tee -a "$LOG"

if [ "$(left)" -gt 200 ]; then
  stamp "transformers baseline 32K"
  timeout $(( $(left) - 120 )) python3 "$ROOT/bench/gpu/hf_baseline.py" --lengths 32768 \
    --reps 3 --warmup 1 --out "$FINAL/hf.json" 2>&1 | grep -v Warning | tail -4 | tee -a "$LOG"
else
  stamp "transformers baseline skipped ($(left) s left)"
fi

python3 - "$FINAL" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
out = sys.argv[1]
def load(name):
    try: return json.load(open(os.path.join(out, name)))
    except Exception as e: return None
hf = load("hf.json")
base = None
for r in (hf or {}).get("records", []):
    if r.get("tokens") == 32768: base = r.get("ms")
for v in ("stats0", "stats1", "stats1_ws", "no_ahead", "stats1_pp", "stats1_ws_split", "stats1_pipe",
          "stats1_ws128", "stats1_ws64", "lsum"):
    r = load(f"reuse_{v}.json")
    if not r: print(f"{v}: no record"); continue
    for c in (r if isinstance(r, list) else r.get("records", [])):
        if c.get("case") != "reuse_device": continue
        ms = c["ms"]
        print(f"{v}: reuse {ms} ms, our full {c.get('full_ms')} ms "
              f"({ms / c['full_ms']:.3f}x)" + (f", transformers {base} ms ({ms / base:.3f}x)" if base else "")
              + f", profile {c.get('profile_ms')}")
PY
stamp "done"
# Everything but the summary in one archive.
(cd "$FINAL" && tar -czf /tmp/verify_all.tgz --exclude verify.log . && find . -type f \
  ! -name verify.log -delete && mv /tmp/verify_all.tgz all.tgz)
