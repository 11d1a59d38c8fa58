#!/usr/bin/env python3
"""--tokenizer on the `sparsex` CLI and on `sparsex-worker`, end to end.

- `sparsex tokenize --model synthetic:llama3-8b --tokenizer ggml-vocab-gpt-2.gguf` gives GPT-2's
  ids for real text;
- `sparsex info` prints another fingerprint with the override than without, the same one twice;
- `sparsex generate` runs stories260K with a small byte-level tokenizer.json in place of its own;
- a tokenizer larger than the model's vocabulary is refused by `sparsex info` and by
  `sparsex-worker` at startup, naming the file and both sizes.

Exit 77 (skipped) when the binaries or $SPARSEX_MODELS' files are missing.

  tokenizer_flag_test.py --bin-dir build/bin [--models DIR]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def byte_char(b):
    ok = lambda x: 33 <= x <= 126 or 161 <= x <= 172 or 174 <= x <= 255
    return chr(b) if ok(b) else chr(256 + sum(1 for x in range(b) if not ok(x)))


def small_tokenizer_json(path):
    """A byte-level BPE of 262 tokens: fits stories260K's 512-row embedding table."""
    vocab = {byte_char(b): b for b in range(256)}
    merges = []
    for l, r in [(" ", "t"), ("h", "e"), (" t", "he"), ("o", "n"), ("c", "e")]:
        bl = lambda s: "".join(byte_char(c) for c in s.encode())
        vocab[bl(l) + bl(r)] = len(vocab)
        merges.append(bl(l) + " " + bl(r))
    j = {"model": {"type": "BPE", "vocab": vocab, "merges": merges},
         "normalizer": {"type": "NFC"},
         "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
         "decoder": {"type": "ByteLevel"},
         "added_tokens": [{"id": len(vocab), "content": "<|endoftext|>", "special": True}]}
    with open(path, "w") as f:
        json.dump(j, f)


def run(args, stdin=None, timeout=120):
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--models", default=os.environ.get("SPARSEX_MODELS") or
                    os.path.join(os.path.dirname(__file__), "../../../shared/models"))
    a = ap.parse_args()
    sparsex = os.path.join(a.bin_dir, "sparsex")
    worker = os.path.join(a.bin_dir, "sparsex-worker")
    gpt2 = os.path.join(a.models, "tokenizer-vectors", "ggml-vocab-gpt-2.gguf")
    stories = os.path.join(a.models, "stories260K", "stories260K.gguf")
    for p in (sparsex, gpt2, stories):
        if not os.path.isfile(p):
            print(f"skipped: no {p}")
            return 77
    errors = []

    r = run([sparsex, "tokenize", "--model", "synthetic:llama3-8b", "--tokenizer", gpt2],
            stdin="Hello world")
    if r.returncode != 0 or r.stdout != " 15496 995\n":
        errors.append(f"tokenize with --tokenizer: rc {r.returncode} {r.stdout!r} {r.stderr}")

    def fingerprint(*extra):
        r = run([sparsex, "info", "--model", "synthetic:llama3-8b", *extra])
        m = re.search(r"^fingerprint ([0-9a-f]{32})$", r.stdout, re.M)
        return m.group(1) if r.returncode == 0 and m else f"error: {r.stdout} {r.stderr}"

    plain, over, again = fingerprint(), fingerprint("--tokenizer", gpt2), fingerprint(
        "--tokenizer", gpt2)
    if plain.startswith("error") or over.startswith("error") or plain == over or over != again:
        errors.append(f"info fingerprints: plain {plain}, override {over}, again {again}")

    with tempfile.TemporaryDirectory() as d:
        small = os.path.join(d, "tokenizer.json")
        small_tokenizer_json(small)
        r = run([sparsex, "generate", "--model", stories, "--tokenizer", small, "--prompt",
                 "Once upon a time, the", "--max-tokens", "8", "--temperature", "0", "--ids"])
        # Pieces "Once" " upon" " a" " time" "," " the" -> O n ce | " " u p on | " " a |
        # " t" i m e | , | " the": 15 ids.
        if r.returncode != 0 or "[15 prompt tokens, 8 generated" not in r.stderr:
            errors.append(f"generate with a tokenizer.json: rc {r.returncode} {r.stderr}")

    r = run([sparsex, "info", "--model", "synthetic:tiny", "--tokenizer", gpt2])
    if r.returncode == 0 or "50257 tokens" not in r.stderr or "only 1000" not in r.stderr:
        errors.append(f"info with a larger tokenizer: rc {r.returncode} {r.stderr}")
    if os.path.isfile(worker):
        r = run([worker, "--model", "synthetic:tiny", "--tokenizer", gpt2, "--insecure_loopback",
                 "--port", "0", "--metrics_port", "-1"], timeout=60)
        if r.returncode == 0 or gpt2 not in r.stderr or "50257 tokens" not in r.stderr:
            errors.append(f"sparsex-worker with a larger tokenizer: rc {r.returncode} "
                          f"{r.stderr[-500:]}")
    for e in errors:
        print(e)
    print(f"{len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
