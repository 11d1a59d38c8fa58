#!/usr/bin/env python3
"""Greedy reproducibility with reuse on, through a local router and CPU workers
(docs/reliability.md). 20 prompts over six shared documents are sent once (the first
run), then (a) once more each, one at a time, and (b) `--copies` times each, all at once. Every
repeat is compared with its prompt's first run and classified by the reuse state its usage
reports (prefix_tokens, reused_tokens, segments_hit, recomputed_tokens, worker): a difference
with another state is inherent (the caches changed between the runs), one with the same state
is a defect. Exit status 1 when any request with a state seen before for its prompt produced
other tokens.

  scripts/reuse_reproducibility.py --bin build/bin --workers 2 --threads 16 [--reuse off]
      [--worker-args '--tp 4']
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

DOCS = [
    "Lily went to the park with her mom. They saw a big red ball and played with it all day "
    "long until the sun went down.",
    "Tom had a little dog named Max. Max liked to run and jump in the garden, and he barked at "
    "the birds in the tall tree.",
    "Sara found a shiny stone by the river. She put it in her pocket and ran home to show her "
    "brother, who was very happy.",
    "The old cat slept on the warm mat by the door. When the rain came, she went inside and "
    "curled up next to the fire.",
    "Ben wanted to build a tall tower with his blocks. It fell down twice, but he tried again "
    "and made it very big and strong.",
    "A little bird lived in a nest high in the tree. Every morning it sang a happy song for all "
    "the animals in the forest.",
]
QUESTIONS = [" What did they do next? They", " Then one day,", " Once upon a time", " Lily said"]
FIELDS = ("prefix_tokens", "reused_tokens", "segments_hit", "recomputed_tokens", "worker")


def wait_ready(path, proc, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return json.load(open(path))
        if proc.poll() is not None:
            sys.exit(f"{path}: process exited with {proc.returncode}")
        time.sleep(0.1)
    sys.exit(f"{path}: not ready in {timeout} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--model", default=os.path.join(
        os.environ.get("SPARSEX_MODELS", "../shared/models"), "stories260K/stories260K.gguf"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=16, help="SPARSEX_THREADS of each worker")
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reuse", choices=("on", "off"), default="on")
    ap.add_argument("--worker-args", default="", help="extra worker flags, e.g. '--tp 4'")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="sparsex-repro-")
    procs = []
    try:
        members = []
        env = dict(os.environ, SPARSEX_THREADS=str(a.threads))
        for i in range(a.workers):
            ready = f"{tmp}/w{i}.ready"
            p = subprocess.Popen(
                [f"{a.bin}/sparsex-worker", "--model", a.model, "--device", "cpu", "--port", "0",
                 "--metrics_port", "0", "--worker_id", f"worker-{i}", "--kv_blocks", "2048",
                 "--insecure_loopback", "--ready_file", ready] + a.worker_args.split(), env=env, stdout=open(f"{tmp}/w{i}.log", "w"),
                stderr=subprocess.STDOUT)
            procs.append(p)
            members.append(f"127.0.0.1:{wait_ready(ready, p)['grpc_port']}")
        p = subprocess.Popen(
            [f"{a.bin}/sparsex-router", "--model", a.model, "--workers", ",".join(members),
             "--grpc_address", "127.0.0.1:0", "--http_address", "127.0.0.1:0",
             "--insecure_loopback", "--http_max_streams_per_client", "-1",
             "--ready_file",
             f"{tmp}/r.ready"], stdout=open(f"{tmp}/r.log", "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        port = wait_ready(f"{tmp}/r.ready", p)["http_port"]
        for _ in range(100):  # every worker healthy
            try:
                h = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read())
                if h.get("healthy_workers") == a.workers:
                    break
            except Exception:
                pass
            time.sleep(0.1)

        prompts = []
        for i in range(20):
            k = 2 + i % 2
            docs = [DOCS[(i * 5 + j * (1 + i % 5)) % 6] for j in range(k)]
            prompts.append(" ".join(docs) + QUESTIONS[i % 4])

        def call(prompt):
            body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0,
                    "reuse": {"enable": a.reuse == "on"}}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            j = json.loads(urllib.request.urlopen(req, timeout=600).read())
            u = j["usage"].get("sparsex", {})
            return j["choices"][0]["text"], tuple(u.get(f, 0) for f in FIELDS)

        first = [call(p) for p in prompts]
        seen = {(i, st): t for i, (t, st) in enumerate(first)}
        counts = collections.Counter()

        def classify(phase, i, text, state):
            t0, s0 = first[i]
            prev = seen.setdefault((i, state), text)
            if prev != text:
                counts[f"{phase}: same state as an earlier run, other tokens (DEFECT)"] += 1
            if text != t0:
                counts[f"{phase}: differ from the first run"] += 1
                what = ",".join(f for f, x, y in zip(FIELDS, state, s0) if x != y) or "nothing"
                counts[f"{phase}:   reuse state differs in: {what}"] += 1

        for i, p in enumerate(prompts):
            classify("sequential", i, *call(p))
        out = [None] * (20 * a.copies)

        def run(n):
            out[n] = call(prompts[n % 20])

        threads = [threading.Thread(target=run, args=(n,)) for n in range(len(out))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for n, r in enumerate(out):
            classify("concurrent", n % 20, *r)
        print(f"reuse {a.reuse}, {a.workers} worker(s), {a.threads} threads each: "
              f"20 sequential repeats, {len(out)} concurrent streams")
        for k in sorted(counts):
            print(f"  {k}: {counts[k]}")
        return 1 if any("DEFECT" in k for k in counts) else 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
