#!/usr/bin/env python3
"""Dense causal attention of one Llama-3-8B layer (32 query heads, 8 KV heads, head dim 128, bf16)
through each of PyTorch's SDPA backends (cuDNN, FlashAttention, memory-efficient), for the
cuDNN-vs-own-kernel decision of docs/perf-notes.md. Median of --reps after --warmup, CUDA
events; TFLOP/s counts the causal half (4 * n^2 / 2 * 128 * 32).

    python3 bench/gpu/sdpa_backends.py --lengths 8192,32768 --out sdpa_backends.json
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="sdpa_backends.json")
    a = ap.parse_args()
    recs = []
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    for n in [int(x) for x in a.lengths.split(",")]:
        q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
        # GQA: each KV head serves 4 query heads (expanded, as transformers' SDPA path does).
        k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        k = k.repeat_interleave(4, dim=1)
        v = v.repeat_interleave(4, dim=1)
        flops = 4.0 * n * n / 2 * 128 * 32
        for name, be in backends:
            try:
                with sdpa_kernel(be):
                    times = []
                    for i in range(a.warmup + a.reps):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        e.record()
                        torch.cuda.synchronize()
                        if i >= a.warmup:
                            times.append(s.elapsed_time(e))
                ms = statistics.median(times)
                recs.append({"case": "sdpa_" + name, "tokens": n, "ms": round(ms, 3),
                             "tflops": round(flops / ms * 1e-9, 1)})
                print(f"sdpa {name:9s} {n:6d}: {ms:8.3f} ms  {flops / ms * 1e-9:6.1f} TFLOP/s")
            except Exception as ex:  # a backend not available for these shapes
                print(f"sdpa {name:9s} {n:6d}: unavailable ({type(ex).__name__}: {ex})"[:200])
        del q, k, v
        torch.cuda.empty_cache()
    json.dump({"records": recs}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
