#!/usr/bin/env bash
# The timeline of one 32K reuse prefill under Nsight Systems: where the wall time
# that no kernel accounts for goes. Nsight Compute (profile_prefill.sh) times each kernel alone,
# serialised; this traces the real run (kernels overlapping under programmatic dependent launch,
# launch gaps, host stalls) between reuse_prefill_bench --profile-range's cudaProfilerStart/Stop,
# then bench/gpu/nsys_gaps.py sums kernel time, idle gaps and the largest gaps with the kernels
# around them. From the staged binaries (bench/gpu/stage_serve.sh; the device call carries
# .stage). Writes to $OUT: nsys_prefill.log, nsys_trace.csv.gz, nsys_gaps.json. Without nsys
# (the H100 machines) the staged CUPTI tracer (bench/gpu_trace/cupti_trace.cc) records the range
# instead: cupti_trace.csv.gz with launch times, the gaps split into host-bound and the rest, and
# cupti_trace.csv.api.csv.gz, the host's CUDA calls (what it did during the largest gaps).
#
#   OUT=/tmp/out bench/gpu/nsys_prefill.sh     # SPX_NSYS_ARGS: extra reuse_prefill_bench flags
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=nsys_prefill
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys \
  2>/dev/null | head -1)
# The traced run: one reuse prefill between cudaProfilerStart/Stop, under either tracer.
# shellcheck disable=SC2206  # REUSE_32K and SPX_NSYS_ARGS hold flags
TRACED_RUN=("$SPX/bin/reuse_prefill_bench" $REUSE_32K --reps 1 --warmup 1
  --cases full,reuse_device --profile-range reuse_device ${SPX_NSYS_ARGS:-}
  --out "$OUT/nsys_reuse.json")
TRACER=$SPX/lib/libspx_cupti_trace.so
if [ -z "$NSYS" ] && [ -e "$TRACER" ]; then
  # No Nsight Systems (the H100 machines): the CUPTI tracer records the same range, with each
  # operation's launch time, so the gaps split into host-bound and queued-in-time.
  stamp "no nsys on this machine: the CUPTI tracer"
  CUDA_INJECTION64_PATH=$TRACER SPX_CUPTI_OUT=$OUT/cupti_trace.csv timeout 240 \
    "${TRACED_RUN[@]}" >>"$LOG" 2>&1
  stamp "traced run exit $?"
  grep -E "cupti_trace|reuse_device" "$LOG" | tail -n 3
  if [ -s "$OUT/cupti_trace.csv" ]; then
    python3 "$ROOT/bench/gpu/nsys_gaps.py" "$OUT/cupti_trace.csv" --out "$OUT/nsys_gaps.json" \
      --api "$OUT/cupti_trace.csv.api.csv" | tee -a "$LOG"
    # The sparse rows' attention rate counting only unmasked work (the figure its target is set in): the
    # run's attended keys (reuse_prefill_bench's record) x 4 x head_dim x heads of the
    # synthetic Llama-3-8B over the wgmma attention kernels' time (the full layers' attention
    # runs on cuDNN, their statistics on the mma.sync kernel).
    python3 - "$OUT/nsys_reuse.json" "$OUT/nsys_gaps.json" <<'PY' | tee -a "$LOG"
import json, sys
rec = [r for r in json.load(open(sys.argv[1])) if r.get("case") == "reuse_device"]
ms = sum(t["ms"] for t in json.load(open(sys.argv[2])).get("by_name", [])
         if "WgmmaFlashKernel" in t["name"])
if rec and ms > 0 and rec[0].get("sparse_attended_keys"):
    keys = rec[0]["sparse_attended_keys"]
    print(f"sparse rows' attention: {keys} attended keys, {ms:.2f} ms of wgmma attention: "
          f"{keys * 4 * 128 * 32 / ms * 1e-9:.1f} TFLOP/s (unmasked work)")
PY
    gzip -f "$OUT/cupti_trace.csv" "$OUT/cupti_trace.csv.api.csv"
  fi
  exit 0
fi
if [ -z "$NSYS" ]; then stamp "no nsys on this machine and no staged CUPTI tracer"; exit 0; fi
stamp "nsys: $NSYS"
TMPD=$(mktemp -d)
timeout 240 "$NSYS" profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda \
  --sample=none --cpuctxsw=none -o "$TMPD/reuse" -f true "${TRACED_RUN[@]}" >>"$LOG" 2>&1
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
