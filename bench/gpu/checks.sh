#!/usr/bin/env bash
# Correctness on the GPU machine, from the staged binaries (bench/gpu/
# stage_serve.sh; the device call carries .stage): the GPU tests (backend_consistency_test,
# cuda_engine_test), then stories260K through the whole cluster twice on this machine, once with
# a CUDA worker and once with a CPU worker, each with one cache server: sparsex-rag sends the
# same seeded RAG requests with reuse and, for every one, again with reuse off (full prefill).
# Compared: the full-prefill greedy outputs of the GPU cluster with the CPU cluster's, and each
# cluster's reuse fidelity (first-token and greedy agreement with its own full prefill). Both
# workers run with the same flags (--approximate_prefix 1, the GPU default).
# Writes to $OUT: checks.log, gpu_tests.log, rag_{cuda,cpu}.json, ids_{cuda,cpu}.txt,
# correctness.json.
#
#   OUT=/tmp/out bench/gpu/checks.sh          # SPX_CHECK_REQUESTS (default 48)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SPX_SCRIPT=checks
. "$ROOT/bench/gpu/staged_env.sh"  # OUT, LOG, stamp, SPX, SPARSEX_MODELS
N=${SPX_CHECK_REQUESTS:-48}

stamp "GPU tests"
for t in backend_consistency_test cuda_engine_test; do
  timeout 300 "$SPX/bin/$t" --gtest_brief=1 >>"$OUT/gpu_tests.log" 2>&1
  stamp "$t exit $?"
done

RUN=/tmp/spx-check-run
for dev in cuda cpu; do
  rm -rf "$RUN"
  stamp "stories260K cluster on $dev"
  if ! timeout 120 "$SPX/cluster.sh" up --insecure --run-dir "$RUN" --bin-dir "$SPX/bin" --device "$dev" \
      --model "$SPX/models/stories260K/stories260K.gguf" --cache-servers 1 --cache-memory 256M \
      --grpc-port 0 --http-port 0 --timeout 90 --worker-args "--approximate_prefix 1" >>"$LOG" 2>&1; then
    stamp "cluster up failed ($dev)"; tail -n 20 "$RUN"/*.log >>"$LOG" 2>&1
    "$SPX/cluster.sh" down --run-dir "$RUN" >>"$LOG" 2>&1; continue
  fi
  . "$RUN/cluster.env"
  timeout 240 "$SPX/bin/sparsex-rag" --target "$ROUTER_GRPC" --requests "$N" --fidelity_every 1 \
    --docs "$SPX/models/tinystories-text/tinystories_sample.txt" --seed 11 --max_tokens 24 \
    --progress=false --json "$OUT/rag_$dev.json" --ids_out "$OUT/ids_$dev.txt" >>"$LOG" 2>&1
  stamp "sparsex-rag ($dev) exit $?"
  "$SPX/cluster.sh" down --run-dir "$RUN" >>"$LOG" 2>&1
done

# Full-prefill outputs: GPU vs CPU, request by request (bf16 vs fp32: a near-tie can flip).
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys, os
out = sys.argv[1]
def load(dev):
    r = {}
    p = os.path.join(out, f"ids_{dev}.txt")
    if not os.path.exists(p): return r
    for line in open(p):
        f = line.split()
        if len(f) >= 2: r[(int(f[0]), f[1])] = f[2:]
    return r
g, c = load("cuda"), load("cpu")
keys = sorted(k for k in g if k[1] == "base" and k in c)
same = sum(g[k] == c[k] for k in keys)
first = sum(bool(g[k]) and bool(c[k]) and g[k][0] == c[k][0] for k in keys)
res = {"compared": len(keys), "full_prefill_identical": same, "full_prefill_first_token_same": first}
for dev in ("cuda", "cpu"):
    p = os.path.join(out, f"rag_{dev}.json")
    if os.path.exists(p): res[f"rag_{dev}"] = json.load(open(p))
json.dump(res, open(os.path.join(out, "correctness.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if not k.startswith("rag_")}))
for dev in ("cuda", "cpu"):
    r = res.get(f"rag_{dev}")
    if r: print(dev, "fidelity samples", r["fidelity_samples"], "first token agree", r["first_token_agree"],
                "identical", r["exact"], "positionwise", round(r["positionwise_agreement"], 4),
                "reused", r["reused_tokens"], "prompt", r["prompt_tokens"], "failed", r["failed"])
PY
stamp "done"
