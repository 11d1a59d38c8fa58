#!/usr/bin/env python3
"""The demo's client: RAG requests over the router's OpenAI-compatible HTTP API, each measured
with segment reuse and again without it on the same prompt.

Every request is --per-request documents drawn with Zipf popularity from a pool, in random
order (each document a segment), then a fresh question (a segment that is not stored). Before
the measured requests every pool document is sent once (stored at its first miss). For each
measured request the baseline goes first: reuse off ("reuse": {"enable": false}, a full prefill
with the exact prefix cache only, as a prefix-caching server does) and leaving no prefix blocks
behind, then the same prompt with reuse on. Time to first token is the client's wall time of a
one-token request (the --max-tokens continuation is asked for separately when outputs are
compared). Prints a progress line, then a table; --json writes the figures.

  demo_client.py --http 127.0.0.1:8000 --docs FILE [--compare-outputs 24]
  demo_client.py --http 127.0.0.1:8000 --synthetic-docs 6 --doc-tokens 700
"""
import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.error
import urllib.request


def post(url, body, api_key, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.load(r)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"demo_client: HTTP {e.code} from {url}: {e.read().decode()[:300]}")
    return out, time.monotonic() - t0


def text_docs(path, doc_chars, pool):
    docs, cur = [], ""
    for para in open(path, encoding="utf-8").read().split("\n\n"):
        para = para.strip()
        if not para:
            continue
        cur = f"{cur}\n{para}" if cur else para
        if len(cur) >= doc_chars:
            docs.append(cur + "\n")
            cur = ""
        if len(docs) == pool:
            break
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True, help="router HTTP address host:port")
    ap.add_argument("--api-key", default=os.environ.get("API_KEY", ""))
    ap.add_argument("--docs", help="text file of blank-line separated paragraphs")
    ap.add_argument("--doc-chars", type=int, default=500)
    ap.add_argument("--synthetic-docs", type=int, default=0,
                    help="instead of --docs: this many documents of random token ids")
    ap.add_argument("--doc-tokens", type=int, default=700)
    ap.add_argument("--pool", type=int, default=40)
    ap.add_argument("--per-request", type=int, default=3)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--compare-outputs", type=int, default=0,
                    help="also generate this many greedy tokens both ways and compare them")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    url = f"http://{a.http}/v1/completions"

    if a.synthetic_docs:
        # The synthetic models' tokenizer reads decimal numbers as token ids.
        docs = [" ".join(str(rng.randrange(3, 1000)) for _ in range(a.doc_tokens)) + "\n"
                for _ in range(a.synthetic_docs)]
        questions = lambda: " ".join(str(rng.randrange(3, 1000)) for _ in range(a.question_tokens))
    else:
        docs = text_docs(a.docs, a.doc_chars, a.pool)
        words = " ".join(docs).split()
        questions = lambda: "Question: " + " ".join(rng.choice(words) for _ in range(8)) + "?\nAnswer:"
    if len(docs) < a.per_request:
        raise SystemExit(f"demo_client: only {len(docs)} documents")

    req = urllib.request.Request(f"http://{a.http}/v1/models")
    if a.api_key:
        req.add_header("Authorization", f"Bearer {a.api_key}")
    with urllib.request.urlopen(req, timeout=30) as r:
        model = json.load(r)["data"][0]["id"]

    def send(segments, reuse, max_tokens):
        body = {"model": model, "segments": segments, "max_tokens": max_tokens, "temperature": 0}
        if not reuse:
            body["reuse"] = {"enable": False, "register_prefix": False}
        out, dt = post(url, body, a.api_key, a.timeout)
        return out, dt

    # Every pool document once, alone: the worker stores a segment at its first miss.
    for i, d in enumerate(docs):
        print(f"\rstoring the pool: {i + 1}/{len(docs)} documents", end="", file=sys.stderr, flush=True)
        send([d], True, 1)
    print(file=sys.stderr)

    weights = [1.0 / (r + 1) ** a.zipf for r in range(len(docs))]
    rows = []
    for i in range(a.requests):
        chosen = []
        while len(chosen) < a.per_request:
            d = rng.choices(range(len(docs)), weights)[0]
            if d not in chosen:
                chosen.append(d)
        rng.shuffle(chosen)
        segs = [docs[d] for d in chosen] + [{"text": questions(), "cacheable": False}]
        base, t_base = send(segs, False, 1)
        on, t_on = send(segs, True, 1)
        u = on["usage"]["sparsex"]
        row = {"docs": chosen, "ttft_off_s": t_base, "ttft_on_s": t_on, "prompt_tokens": on["usage"]["prompt_tokens"],
               "prefix_tokens": u["prefix_tokens"], "reused_tokens": u["reused_tokens"],
               "recomputed_tokens": u["recomputed_tokens"], "new_tokens": u["new_tokens"],
               "off_prefix_tokens": base["usage"]["sparsex"]["prefix_tokens"],
               "first_token_same": base["choices"][0]["text"] == on["choices"][0]["text"]}
        if a.compare_outputs:
            b2, _ = send(segs, False, a.compare_outputs)
            o2, _ = send(segs, True, a.compare_outputs)
            row["output_same"] = b2["choices"][0]["text"] == o2["choices"][0]["text"]
        rows.append(row)
        off = statistics.mean(r["ttft_off_s"] for r in rows)
        onm = statistics.mean(r["ttft_on_s"] for r in rows)
        share = sum(r["reused_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))
        print(f"\r[{i + 1:3d}/{a.requests}] TTFT without reuse {off:6.2f} s | with reuse {onm:6.2f} s "
              f"| {off / onm:4.1f}x | reused {100 * share:4.1f}% of prompt tokens", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)

    n = len(rows)
    tot = lambda k: sum(r[k] for r in rows)
    off = statistics.mean(r["ttft_off_s"] for r in rows)
    onm = statistics.mean(r["ttft_on_s"] for r in rows)
    summary = {
        "requests": n, "ttft_without_reuse_mean_s": off, "ttft_with_reuse_mean_s": onm,
        "ttft_without_reuse_p50_s": statistics.median(r["ttft_off_s"] for r in rows),
        "ttft_with_reuse_p50_s": statistics.median(r["ttft_on_s"] for r in rows),
        "speedup": off / onm, "prompt_tokens": tot("prompt_tokens"),
        "prefix_tokens": tot("prefix_tokens"), "reused_tokens": tot("reused_tokens"),
        "recomputed_tokens": tot("recomputed_tokens"), "new_tokens": tot("new_tokens"),
        "prefix_tokens_without_reuse": tot("off_prefix_tokens"),
        "first_token_same": sum(r["first_token_same"] for r in rows),
        "rows": rows,
    }
    if a.compare_outputs:
        summary["output_same"] = sum(r["output_same"] for r in rows)
    pct = lambda x: 100.0 * x / max(1, summary["prompt_tokens"])
    print(f"{n} requests of {a.per_request} documents (pool {len(docs)}, Zipf {a.zipf}), "
          "each sent without and with reuse")
    print(f"  time to first token, mean   {off:8.2f} s without reuse   {onm:8.2f} s with reuse   "
          f"{off / onm:.1f}x")
    print(f"  time to first token, median {summary['ttft_without_reuse_p50_s']:8.2f} s"
          f"                  {summary['ttft_with_reuse_p50_s']:8.2f} s")
    print(f"  prompt tokens {summary['prompt_tokens']}: reused {pct(summary['reused_tokens']):.1f}% "
          f"(of which recomputed {100.0 * summary['recomputed_tokens'] / max(1, summary['reused_tokens']):.1f}%), "
          f"exact prefix {pct(summary['prefix_tokens']):.1f}%, new {pct(summary['new_tokens']):.1f}%; "
          f"without reuse the exact prefix cache served {pct(summary['prefix_tokens_without_reuse']):.1f}%")
    if not a.synthetic_docs:  # random weights: nearly flat logits, any change flips the argmax
        print(f"  first token equal with and without reuse: {summary['first_token_same']}/{n}")
    if a.compare_outputs:
        print(f"  {a.compare_outputs}-token greedy output equal: {summary['output_same']}/{n}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
