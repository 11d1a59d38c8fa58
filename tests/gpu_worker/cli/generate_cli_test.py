#!/usr/bin/env python3
"""`sparsex generate` end to end (the CLI runs the worker's scheduler in process).

1. stories260K from BOS alone, greedy: the printed ids equal the model's greedy oracle
   (stories260K/expected_greedy_t0.ids, 345 tokens, ending at the generated BOS: finish=stop).
2. Segment reuse: three TinyStories paragraphs as segments plus a question, two runs (the
   second in reversed order): the first reuses nothing, the second reuses every segment.
Exit 77 (skipped) when the binary or the models are missing.

  generate_cli_test.py --bin build/bin/sparsex [--models DIR]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", default=os.environ.get("SPARSEX_MODELS") or
                    os.path.join(os.path.dirname(__file__), "../../../../shared/models"))
    a = ap.parse_args()
    model = os.path.join(a.models, "stories260K", "stories260K.gguf")
    oracle = os.path.join(a.models, "stories260K", "expected_greedy_t0.ids")
    docs = os.path.join(a.models, "tinystories-text", "tinystories_sample.txt")
    if not all(os.path.isfile(p) for p in (a.bin, model, oracle, docs)):
        print(f"skipped: need {a.bin}, {model}, {oracle} and {docs}")
        return 77
    failed = 0

    r = subprocess.run([a.bin, "generate", "--model", model, "--prompt", "", "--max-tokens",
                        "1000", "--temperature", "0", "--ids"], capture_output=True, text=True,
                       timeout=120)
    got = r.stdout.split()
    want = open(oracle).read().split()
    if r.returncode != 0 or got != want or "finish=stop" not in r.stderr:
        print(f"FAIL greedy oracle: exit {r.returncode}, {len(got)} ids (want {len(want)}), "
              f"first difference at {next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))}; stderr: {r.stderr[-300:]}")
        failed += 1
    else:
        print(f"ok greedy oracle: {len(got)} ids, finish=stop")

    # Three paragraphs of the sample (blank-line separated stories), each a segment.
    stories = [p.strip() for p in open(docs).read().split("\n\n") if len(p.strip()) > 200][:3]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n\n".join(s.replace("\n", " ") for s in stories) + "\n")
        seg_file = f.name
    try:
        r = subprocess.run([a.bin, "generate", "--model", model, "--segments", seg_file,
                            "--prompt", "Question: who is in the stories?", "--max-tokens", "8",
                            "--temperature", "0", "--runs", "2"], capture_output=True,
                           text=True, timeout=120)
    finally:
        os.unlink(seg_file)
    runs = re.findall(r"\[run (\d+): (\d+) prompt tokens: (\d+) prefix, (\d+) reused "
                      r"\((\d+) segments\)", r.stderr)
    if r.returncode != 0 or len(runs) != 2:
        print(f"FAIL segment runs: exit {r.returncode}, stderr: {r.stderr[-400:]}")
        failed += 1
    else:
        first, second = runs
        if int(first[3]) != 0 or int(second[4]) != 3 or int(second[3]) == 0:
            print(f"FAIL segment reuse: run 1 reused {first[3]}, run 2 reused {second[3]} "
                  f"({second[4]} segments; want 0, then all 3)")
            failed += 1
        else:
            print(f"ok segment reuse: run 2 reused {second[3]} of {second[1]} prompt tokens "
                  f"({second[4]} segments)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
