#!/usr/bin/env bash
# Builds SparseX on the H200 machine (Ubuntu 24.04, gcc 13, CMake 4, nvcc 13; no abseil, xxhash,
# nlohmann-json or pcre2 headers there), runs the GPU tests, the GPU benchmark and the
# Hugging Face transformers baseline, and writes everything to $OUT:
#   build.log, tests.log, bench.log (machine, benchmarks, baseline output), gpu_prefill_raw.json
#   (ours), own_attention_raw.json (32K with cuDNN off), reuse_prefill_raw.json, hf_baseline.json,
#   gpu_prefill.json (records: case, tokens, ms, baseline_ms, ratio); at most 8 files come back
#   from the device machine.
# The missing libraries travel as Debian 12 packages in .deps/debs (fetched on a Debian machine
# with `apt-get download libabsl-dev libabsl20220623 libxxhash-dev nlohmann-json3-dev
# libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 pkgconf pkgconf-bin
# libpkgconf3`) and are unpacked here with dpkg -x. The stories260K test model travels in
# .deps/models.
#
#   OUT=/tmp/out bench/gpu/run.sh            # everything
#   SPX_SKIP_HF=1 SPX_BENCH_ARGS="--lengths 2048 --reps 1" bench/gpu/run.sh
#   SPX_SKIP_BENCH=1 bench/gpu/run.sh        # build and GPU tests only
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/build-gpu-out}
BUILD=${SPX_BUILD_DIR:-/tmp/spx-build}
DEPS=${SPX_DEPS_DIR:-/tmp/spx-deps}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT" "$BUILD" "$DEPS"
T0=$(date +%s)
stamp() { echo "[run.sh +$(( $(date +%s) - T0 ))s] $*"; }

stamp "machine"
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv;
  nvcc --version | tail -2; gcc --version | head -1; cmake --version | head -1; } 2>&1 | tee "$OUT/bench.log"

# ---- dependencies ----
for f in "$ROOT"/.deps/debs/*.deb; do dpkg -x "$f" "$DEPS"; done
LIBDIR=$DEPS/usr/lib/x86_64-linux-gnu
sed -i "s|^prefix=.*|prefix=$DEPS/usr|" "$LIBDIR"/pkgconfig/*.pc
export PKG_CONFIG_PATH=$LIBDIR/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ! command -v pkg-config >/dev/null; then export PATH=$PATH:$DEPS/usr/bin; fi
export SPARSEX_MODELS=${SPARSEX_MODELS:-$ROOT/.deps/models}
# cuDNN (dense prefill attention, loaded with dlopen): the one PyTorch's wheels bring
# (nvidia-cudnn-cu13, the version PyTorch's SDPA measurements used) when present, else the
# system's. SPX_CUDNN_LIB names the library the backend opens first.
CUDNN_DIR=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
if [ -z "${SPX_CUDNN_LIB:-}" ] && [ -n "$CUDNN_DIR" ] && [ -f "$CUDNN_DIR/libcudnn.so.9" ]; then
  export LD_LIBRARY_PATH=$CUDNN_DIR:$LD_LIBRARY_PATH SPX_CUDNN_LIB=$CUDNN_DIR/libcudnn.so.9
fi
echo "cuDNN: ${SPX_CUDNN_LIB:-system $(ldconfig -p 2>/dev/null | grep -m1 libcudnn.so.9 | awk '{print $NF}')}" | tee -a "$OUT/bench.log"

# ---- build ----
stamp "configure + build (jobs $JOBS)"
# NCCL (tensor parallelism) where its header is installed: nccl_test then runs a one-GPU group
# (and TP=2 when the machine has two GPUs).
NCCL=OFF
NCCL_TARGET=""
for h in /usr/include/nccl.h /usr/local/cuda/include/nccl.h; do
  if [ -f "$h" ]; then NCCL=ON; NCCL_TARGET=nccl_test; fi
done
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSEX_WITH_NCCL=$NCCL \
  -DSPARSEX_WITH_SERVICES=OFF -DSPARSEX_WITH_ROCKSDB=OFF -DSPARSEX_WITH_UCX=OFF \
  -DSPARSEX_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc) \
  -DCMAKE_CUDA_ARCHITECTURES=${SPX_CUDA_ARCH:-90a} \
  -DCMAKE_PREFIX_PATH="$DEPS/usr" -DCMAKE_INCLUDE_PATH="$DEPS/usr/include" \
  -DCMAKE_CXX_FLAGS="-include cstdint" >"$OUT/build.log" 2>&1
cmake_rc=$?
ninja -C "$BUILD" -j"$JOBS" backend_consistency_test cuda_engine_test gpu_prefill_bench \
  reuse_prefill_bench $NCCL_TARGET \
  >>"$OUT/build.log" 2>&1
build_rc=$?
stamp "build rc: cmake $cmake_rc ninja $build_rc"
if [ $cmake_rc -ne 0 ] || [ $build_rc -ne 0 ]; then
  grep -E "error|Error|CMake Error" -A3 "$OUT/build.log" | head -60
  exit 1
fi

# ---- cuDNN check only (SPX_CUDNN_CHECK=1): the cuDNN attention tests with cuDNN's own error
# and warning log, once per library candidate, then exit ----
if [ -n "${SPX_CUDNN_CHECK:-}" ]; then
  for lib in "${SPX_CUDNN_LIB:-}" "$(ldconfig -p 2>/dev/null | grep -m1 libcudnn.so.9 | awk '{print $NF}')"; do
    [ -n "$lib" ] || continue
    stamp "cuDNN check with $lib"
    SPX_CUDNN_LIB=$lib CUDNN_LOGERR_DBG=1 CUDNN_LOGWARN_DBG=1 CUDNN_LOGDEST_DBG=stderr \
      "$BUILD/bin/backend_consistency_test" --gtest_brief=1 \
      --gtest_filter='AttentionConsistency.CudnnDense*' 2>&1 | grep -v "^$" | head -${SPX_CUDNN_LOG_LINES:-60}
    "$BUILD/bin/backend_consistency_test" --gtest_brief=1 --gtest_filter='AttentionConsistency.*' \
      2>&1 | grep -E "PASSED|FAILED|Failure|UNIMPL|cuDNN" | head -20
  done
  "$BUILD/bin/gpu_prefill_bench" --lengths ${SPX_CHECK_LENGTHS:-32768} --reps 1 --decode-steps 0 \
    --no-micro --out "$OUT/check.json" 2>&1 | grep -E "attention|full prefill"
  exit 0
fi

# ---- tests ----
stamp "GPU tests"
tests_rc=0
for t in backend_consistency_test cuda_engine_test $NCCL_TARGET; do
  "$BUILD/bin/$t" --gtest_brief=1 >>"$OUT/tests.log" 2>&1 || tests_rc=1
done
# Every attention kernel through the same checks: mma.sync with 4 warps, and on sm_90a each
# wgmma variant (cuDNN off, so the long dense cases run on our kernels too). The benchmarks use
# the default (auto: plain wgmma) unless it fails here, in which case they fall back to one
# that passed. Then every dense case cuDNN can take through cuDNN, failures not masked.
echo "== SPX_CUDNN_ATTENTION=require SPX_CUDNN_MIN_TOKENS=64" >>"$OUT/tests.log"
SPX_CUDNN_ATTENTION=require SPX_CUDNN_MIN_TOKENS=64 "$BUILD/bin/backend_consistency_test" \
  --gtest_brief=1 --gtest_filter='AttentionConsistency.*' >>"$OUT/tests.log" 2>&1 || tests_rc=1
export SPX_CUDNN_ATTENTION=0
SPX_ATTN_WARPS=4 SPX_ATTN_IMPL=mma "$BUILD/bin/backend_consistency_test" --gtest_brief=1 \
  --gtest_filter='AttentionConsistency.*' >>"$OUT/tests.log" 2>&1 || tests_rc=1
impl_ok=""
for im in wgmma wgmma-pipe; do
  echo "== SPX_ATTN_IMPL=$im" >>"$OUT/tests.log"
  if SPX_ATTN_IMPL=$im timeout 300 "$BUILD/bin/backend_consistency_test" --gtest_brief=1 \
      --gtest_filter='AttentionConsistency.*' >>"$OUT/tests.log" 2>&1; then
    impl_ok="$impl_ok $im"
  else
    tests_rc=1
  fi
done
unset SPX_CUDNN_ATTENTION
stamp "attention kernels passing: mma${impl_ok}"
case " $impl_ok " in
  *" wgmma "*) ;;  # the default
  *" wgmma-pipe "*) export SPX_ATTN_IMPL=wgmma-pipe ;;
  *) export SPX_ATTN_IMPL=mma SPX_MICRO_IMPLS=mma ;;
esac
grep -E "^==|^\[  (PASSED|FAILED|SKIPPED) |Failure|error|Expected|Which is|actual|rel" "$OUT/tests.log" | head -80
stamp "tests rc $tests_rc"

if [ -n "${SPX_SKIP_BENCH:-}" ]; then stamp "benchmarks skipped (SPX_SKIP_BENCH)"; exit $tests_rc; fi

# ---- benchmark ----
stamp "benchmark"
# shellcheck disable=SC2086
"$BUILD/bin/gpu_prefill_bench" ${SPX_BENCH_ARGS:-} --out "$OUT/gpu_prefill_raw.json" \
  2>&1 | tee -a "$OUT/bench.log"
stamp "bench done"
# The same-run full prefill with our own attention kernel for every layer (cuDNN off).
if [ -z "${SPX_SKIP_OWN:-}" ]; then
  SPX_CUDNN_ATTENTION=0 "$BUILD/bin/gpu_prefill_bench" --lengths ${SPX_OWN_LENGTHS:-32768} \
    --reps 2 --decode-steps 0 --no-micro --out "$OUT/own_attention_raw.json" 2>&1 \
    | grep -E "attention|full prefill" | tee -a "$OUT/bench.log"
fi

# ---- reuse prefill: 8 stored segments (shuffled) + 256 new tokens, F=2, r=0.15 ----
# The issue's reuse case; extra arguments (e.g. --tp 2) and $SPX_REUSE_ARGS come last.
reuse_bench() {
  # shellcheck disable=SC2086
  NCCL_NVLS_ENABLE=0 "$BUILD/bin/reuse_prefill_bench" --model synthetic:llama3-8b --device cuda \
    --segments 8 --segment-tokens 4064 --new-tokens 256 --full-layers 2 --ratio 0.15 "$@" \
    ${SPX_REUSE_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
}
stamp "reuse prefill benchmark"
reuse_bench --out "$OUT/reuse_prefill_raw.json"
stamp "reuse done"

# ---- tensor parallelism: the same reuse benchmark on 2 GPUs over NCCL ----
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$NCCL" = ON ] && [ "$NGPU" -ge 2 ]; then
  stamp "reuse prefill benchmark, tp 2 ($NGPU GPUs)"
  reuse_bench --tp 2 --out "$OUT/reuse_prefill_tp2.json"
  stamp "tp 2 done"
fi

# ---- transformers baseline ----
if [ -z "${SPX_SKIP_HF:-}" ]; then
  stamp "transformers baseline"
  timeout ${SPX_HF_TIMEOUT:-240} python3 "$ROOT/bench/gpu/hf_baseline.py" \
    --lengths ${SPX_HF_LENGTHS:-2048,8192,16384,32768} --out "$OUT/hf_baseline.json" \
    2>&1 | grep -v Warning | tail -20 | tee -a "$OUT/bench.log"
fi

# ---- memory checker over the GPU tests (optional) ----
if [ -n "${SPX_SANITIZE:-}" ]; then
  stamp "compute-sanitizer memcheck"
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  timeout ${SPX_SANITIZE_TIMEOUT:-120} "$CS" --tool memcheck --error-exitcode 9 \
    "$BUILD/bin/backend_consistency_test" --gtest_brief=1 \
    --gtest_filter="${SPX_SANITIZE_FILTER:-*}" >"$OUT/../sanitizer.log" 2>&1
  stamp "memcheck rc $?"
  grep -E "ERROR SUMMARY|Invalid|out of bounds|PASSED|FAILED" "$OUT/../sanitizer.log" | head -20 \
    | tee -a "$OUT/tests.log"
fi

# ---- merged records ----
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
ours = json.load(open(os.path.join(out, "gpu_prefill_raw.json")))
p = os.path.join(out, "own_attention_raw.json")
if os.path.exists(p):
    for r in json.load(open(p))["records"]:
        if r["case"] == "full_prefill":
            ours["records"].append(dict(r, case="full_prefill_own_attention"))
base = {}
p = os.path.join(out, "hf_baseline.json")
if os.path.exists(p):
    for r in json.load(open(p))["records"]:
        base[(r["case"], r["tokens"])] = r["ms"]
recs = []
for name, prefix, tp in (("reuse_prefill_raw.json", "prefill_", 1),
                         ("reuse_prefill_tp2.json", "tp2_prefill_", 2)):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        continue
    for r in json.load(open(p)):
        # 1 + 8 x 4064 + 256 = 32769 tokens: compared with the 32K (32768) baseline.
        rec = {"case": prefix + r["case"], "tokens": r["tokens"], "ms": r["ms"],
               "speedup_vs_our_full": r["speedup_vs_full"],
               "selected_tokens": r["selected_tokens"], "compute_share": r["compute_share"]}
        if tp > 1:
            rec["tp"] = tp
        ours["records"].append(rec)
        base[(prefix + r["case"], r["tokens"])] = base.get(("full_prefill", 32768))
base_full = {t: ms for (c, t), ms in base.items() if c == "full_prefill"}
for r in ours["records"]:
    b = base.get((r["case"], r["tokens"]))
    if b is None and r["case"] == "full_prefill_own_attention":
        b = base_full.get(r["tokens"])
    r = dict(r, baseline_ms=b, ratio=(round(r["ms"] / b, 3) if b else None))
    recs.append(r)
json.dump({"device": ours.get("device"), "model": ours.get("model"),
           "dense_attention": ours.get("dense_attention"), "records": recs},
          open(os.path.join(out, "gpu_prefill.json"), "w"), indent=1)
print("%-28s %7s %10s %10s %7s" % ("case", "tokens", "ms", "base_ms", "ratio"))
for r in recs:
    print("%-28s %7d %10.2f %10s %7s" % (r["case"], r["tokens"], r["ms"],
          "%.1f" % r["baseline_ms"] if r["baseline_ms"] else "-", r["ratio"] or "-"))
EOF
stamp "done (tests rc $tests_rc)"
exit $tests_rc
