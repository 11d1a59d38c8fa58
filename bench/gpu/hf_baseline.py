#!/usr/bin/env python3
"""Hugging Face transformers baseline for bench/gpu/run.sh: LlamaForCausalLM with SDPA attention,
Llama-3-8B shapes, random bf16 weights on the GPU, batch 1, logits of the last token only.
Full prefill time per length: median of --reps runs after --warmup, CUDA events.

    python3 bench/gpu/hf_baseline.py --lengths 2048,8192 --out hf_baseline.json
"""
import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,8192,16384,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="hf_baseline.json")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.eval()
    torch.cuda.synchronize()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: "
          f"model built in {time.time() - t0:.1f} s")

    def forward(ids):
        try:
            return model(input_ids=ids, logits_to_keep=1).logits
        except TypeError:
            return model(input_ids=ids, num_logits_to_keep=1).logits

    records = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda", generator=g)
        times = []
        torch.cuda.reset_peak_memory_stats()
        try:
            with torch.inference_mode():
                for r in range(a.warmup + a.reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    logits = forward(ids)
                    e.record()
                    e.synchronize()
                    assert torch.isfinite(logits).all()
                    if r >= a.warmup:
                        times.append(s.elapsed_time(e))
                    del logits
        except torch.cuda.OutOfMemoryError:  # a length that does not fit: recorded, not fatal
            records.append({"case": "full_prefill", "tokens": n, "oom": True})
            print(f"transformers full prefill {n:6d} tokens: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        ms = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30  # weights + activations, GiB
        records.append({"case": "full_prefill", "tokens": n, "ms": round(ms, 3),
                        "min_ms": round(min(times), 3), "reps": a.reps,
                        "mem_peak_gib": round(peak, 2)})
        print(f"transformers full prefill {n:6d} tokens: {ms:9.2f} ms (min {min(times):.2f}), "
              f"memory peak {peak:.1f} GiB", flush=True)
        torch.cuda.empty_cache()
    json.dump({"baseline": "transformers LlamaForCausalLM sdpa bf16",
               "transformers": transformers.__version__, "torch": torch.__version__,
               "records": records}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
