#!/usr/bin/env python3
"""`sparsex tokenize` against llama.cpp's tokenizer test vectors.

For each vocabulary-only GGUF in $SPARSEX_MODELS/tokenizer-vectors (llama-spm, gpt-2, phi-3),
every test string of its .inp file (separated by "\n__ggml_vocab_test__\n") is piped into
`sparsex tokenize --model FILE`; the printed line must equal the string's line of the .out file
byte for byte. Exit 77 (skipped) when the vectors or the binary are missing.

  tokenize_cli_test.py --bin build/bin/sparsex [--models DIR]
"""
import argparse
import os
import subprocess
import sys

MARKER = b"\n__ggml_vocab_test__\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", default=os.environ.get("SPARSEX_MODELS") or
                    os.path.join(os.path.dirname(__file__), "../../../shared/models"))
    a = ap.parse_args()
    vectors = os.path.join(a.models, "tokenizer-vectors")
    if not os.path.isfile(a.bin) or not os.path.isdir(vectors):
        print(f"skipped: need {a.bin} and {vectors}")
        return 77
    failures = total = 0
    for name in ("llama-spm", "gpt-2", "phi-3"):
        base = os.path.join(vectors, f"ggml-vocab-{name}.gguf")
        with open(base + ".inp", "rb") as f:
            cases = f.read().split(MARKER)[:-1]  # the text after the last marker is no case
        with open(base + ".out", "rb") as f:
            want = f.read().split(b"\n")[: len(cases)]
        if len(cases) != len(want):
            print(f"{name}: {len(cases)} strings but {len(want)} expected lines")
            return 1
        for i, (text, line) in enumerate(zip(cases, want)):
            total += 1
            r = subprocess.run([a.bin, "tokenize", "--model", base], input=text,
                               capture_output=True, timeout=60)
            expected = line + b"\n"
            if r.returncode != 0 or r.stdout != expected:
                failures += 1
                err = r.stderr.decode(errors="replace")
                print(f"{name} case {i} {text!r}: rc {r.returncode}\n  got  {r.stdout!r}\n"
                      f"  want {expected!r}\n  {err}")
    print(f"{total - failures}/{total} strings tokenized as llama.cpp expects")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
