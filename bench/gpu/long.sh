#!/usr/bin/env bash
# Long contexts and the cost curve over r on the GPU machine, from the staged
# binaries (bench/gpu/stage_serve.sh; the device call carries .stage), in one call:
#   1. the GPU tests (backend_consistency_test, cuda_engine_test);
#   2. full prefill at 32K, 64K and 128K tokens (gpu_prefill_bench: our forward pass, device
#      memory peak per length);
#   3. reuse prefill (segments in the GPU tier, F=2) at 32K with r = 0.05, 0.15, 0.30, at 64K
#      (16 segments of 4064 tokens + 256 new) and at 128K (32 segments), each with the same
#      prompt's full prefill through the engine (reuse_prefill_bench, memory peak per case);
#   4. the transformers baseline at the same lengths (bench/gpu/hf_baseline.py, peak memory),
#      where it fits.
# Writes to $OUT: long.log, gpu_tests.log, prefill_long.json, reuse_<case>.json,
# hf_long.json, long.json (merged records: case, tokens, ms, baseline_ms, ratio, memory).
#
#   OUT=/tmp/out bench/gpu/long.sh     # SPX_LONG_LENGTHS (32768 65536 131072), SPX_SKIP_TESTS=1
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=long
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
LENGTHS=${SPX_LONG_LENGTHS:-32768 65536 131072}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
# Host memory guard: a benchmark that would push the machine into swap or the OOM killer (the
# reuse benchmark keeps its segments in an fp32 host store: 32 GiB at 128K) is killed instead,
# with a log line, so that the call still returns what it measured.
( while sleep 1; do
    avail=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
    if [ "$avail" -lt "${SPX_LONG_MIN_FREE_GIB:-12}" ]; then
      echo "[long.sh] host memory guard: ${avail} GiB available, killing the benchmarks" >>"$LOG"
      pkill -9 -f "reuse_prefill_bench|gpu_prefill_bench|hf_baseline.py"
    fi
  done ) &
GUARD=$!
trap 'kill $GUARD 2>/dev/null' EXIT

if [ -z "${SPX_SKIP_TESTS:-}" ]; then
  stamp "GPU tests"
  for t in backend_consistency_test cuda_engine_test; do
    timeout 150 "$SPX/bin/$t" --gtest_brief=1 >>"$OUT/gpu_tests.log" 2>&1
    stamp "$t exit $?"
  done
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure" "$OUT/gpu_tests.log" | tee -a "$LOG"
fi

stamp "full prefill at $LENGTHS"
timeout 180 "$SPX/bin/gpu_prefill_bench" --lengths "$(echo $LENGTHS | tr ' ' ,)" --reps 1 \
  --warmup 1 --decode-steps 0 --no-micro --out "$OUT/prefill_long.json" 2>&1 \
  | grep -E "device|attention|full prefill" | tee -a "$LOG"

reuse() {  # name, then reuse_prefill_bench flags
  local name=$1; shift
  stamp "reuse prefill $name (host memory available: $(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo) GiB)"
  timeout 150 "$SPX/bin/reuse_prefill_bench" --model synthetic:llama3-8b --device cuda \
    --segment-tokens 4064 --new-tokens 256 --full-layers 2 --cases reuse_device "$@" \
    --out "$OUT/reuse_$name.json" 2>&1 | grep -vE "^\s*$" | tee -a "$LOG"
}
for r in 0.05 0.15 0.30; do reuse "32k_r$r" --segments 8 --ratio "$r" --reps 3 --warmup 1; done
case " $LENGTHS " in *" 65536 "*) reuse 64k_r0.15 --segments 16 --ratio 0.15 --reps 2 --warmup 1 ;; esac

stamp "transformers baseline"
timeout 240 python3 "$ROOT/bench/gpu/hf_baseline.py" --lengths "$(echo $LENGTHS | tr ' ' ,)" \
  --reps 1 --warmup 1 --out "$OUT/hf_long.json" 2>&1 | grep -v Warning | tail -8 | tee -a "$LOG"
case " $LENGTHS " in *" 131072 "*) reuse 128k_r0.15 --segments 32 --ratio 0.15 --reps 1 --warmup 1 ;; esac

python3 - "$OUT" <<'PY' | tee -a "$LOG"
import glob, json, os, sys
out = sys.argv[1]
def load(p):
    try: return json.load(open(p))
    except Exception: return None
base = {}
hf = load(os.path.join(out, "hf_long.json"))
for r in (hf or {}).get("records", []):
    base[r["tokens"]] = r
recs = []
ours = load(os.path.join(out, "prefill_long.json"))
full_ms = {}
for r in (ours or {}).get("records", []):
    if r["case"] != "full_prefill": continue
    full_ms[r["tokens"]] = r["ms"]
    recs.append(dict(r, case="full_prefill"))
for p in sorted(glob.glob(os.path.join(out, "reuse_*.json"))):
    for r in load(p) or []:
        recs.append(dict(r, case=("prefill_" if r["case"] != "full" else "engine_") + r["case"]
                         + f"_r{r['ratio']:.2f}"))
for r in recs:
    b = base.get(r["tokens"])
    if b is not None and "ms" not in b: b = None  # out of memory there
    if b is None:  # the reuse prompts are 1 + n x 4064 + 256 tokens: nearest baseline length
        near = [t for t in base if abs(t - r["tokens"]) <= 512 and "ms" in base[t]]
        b = base[near[0]] if near else None
    if b:
        r["baseline_ms"], r["ratio_vs_transformers"] = b["ms"], round(r["ms"] / b["ms"], 3)
        if "mem_peak_gib" in b: r["baseline_mem_peak_gib"] = b["mem_peak_gib"]
json.dump({"records": recs, "baseline": (hf or {}).get("baseline")}, open(os.path.join(out, "long.json"), "w"), indent=1)
for r in recs:
    print(f"{r['case']:32s} {r['tokens']:7d} {r['ms']:10.1f} ms  base {r.get('baseline_ms', '-')}"
          f"  ratio {r.get('ratio_vs_transformers', '-')}  mem {r.get('mem_peak_gib', '-')} GiB"
          f"  share {r.get('compute_share', '-')}")
PY
stamp "done"
