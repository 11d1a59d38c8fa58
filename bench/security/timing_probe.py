#!/usr/bin/env python3
"""Timing probe across tenants (docs/security.md, "Timing"): can tenant B tell, from its own
time to first token, which documents tenant A has sent?

Starts a local cluster (deploy/local/cluster.sh, tenants alice and bob), lets alice send N
documents, then has bob send those N and N fresh documents of the same length, shuffled, each
with a question of its own and max_tokens 1, and measures bob's latency per request. A
classifier that calls a document "sent by alice" when bob's latency is low has AUC =
P(latency of a fresh document > latency of an alice document) (Mann-Whitney). 0.5: the two are
indistinguishable. --insecure runs the same probe on a cluster without credentials (one shared
namespace), where the hits show.

  bench/security/timing_probe.py [--insecure] [--docs 40] [--out probe.json]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def auc(neg, pos):
    """P(a fresh document's latency > an alice document's latency), ties counted half."""
    wins = 0.0
    for f in neg:
        for a in pos:
            wins += 1.0 if f > a else 0.5 if f == a else 0.0
    return wins / (len(neg) * len(pos))


def post(url, body, key):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--insecure", action="store_true")
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--doc-chars", type=int, default=1200)
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    models = os.environ.get("SPARSEX_MODELS", os.path.join(ROOT, "..", "shared", "models"))
    text = open(os.path.join(models, "tinystories-text", "tinystories_sample.txt")).read()
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    rng = random.Random(a.seed)
    rng.shuffle(paras)
    docs = []
    for p in paras:
        if len(docs) == 2 * a.docs:
            break
        docs.append(p[: a.doc_chars])
    if len(docs) < 2 * a.docs:
        sys.exit("not enough text for %d documents" % (2 * a.docs))
    sent, fresh = docs[: a.docs], docs[a.docs:]
    run = tempfile.mkdtemp(prefix="spx-probe-")
    env = dict(os.environ, SPARSEX_RUN_DIR=run, SPARSEX_BIN_DIR=a.bin_dir)
    cmd = [os.path.join(ROOT, "deploy/local/cluster.sh"), "up", "--workers", "1",
           "--cache-servers", "1", "--grpc-port", "0", "--http-port", "0",
           "--tenants", "alice bob"] + (["--insecure"] if a.insecure else [])
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    try:
        cenv = dict(l.strip().split("=", 1) for l in open(os.path.join(run, "cluster.env"))
                    if "=" in l)
        url = "http://%s/v1/chat/completions" % cenv["ROUTER_HTTP"]
        alice, bob = cenv.get("API_KEY_ALICE", ""), cenv.get("API_KEY_BOB", "")

        def ask(key, doc, q):
            # The document and the question as two messages: each message is a segment.
            return post(url, {"messages": [{"role": "user", "content": doc},
                                           {"role": "user", "content": q}],
                              "max_tokens": 1, "temperature": 0}, key)

        for i, d in enumerate(sent):
            ask(alice, d, "Question %d: who was there?" % i)
        trials = [(d, 1) for d in sent] + [(d, 0) for d in fresh]
        rng.shuffle(trials)
        lat = {0: [], 1: []}
        reused = {0: 0, 1: 0}
        for i, (d, label) in enumerate(trials):
            t, out = ask(bob, d, "Probe %d: what happened next?" % i)
            lat[label].append(t)
            details = out.get("usage", {}).get("prompt_tokens_details") or {}
            reused[label] += int(details.get("cached_tokens", 0) or 0)
        res = {
            "mode": "insecure (one namespace)" if a.insecure else "API keys + tenant scopes",
            "documents": a.docs, "doc_chars": a.doc_chars,
            "auc": auc(lat[0], lat[1]),
            "median_ms_alice_docs": 1000 * sorted(lat[1])[len(lat[1]) // 2],
            "median_ms_fresh_docs": 1000 * sorted(lat[0])[len(lat[0]) // 2],
            "cached_tokens_seen_by_bob_on_alice_docs": reused[1],
            "cached_tokens_seen_by_bob_on_fresh_docs": reused[0],
            "date": time.strftime("%Y-%m-%d"),
        }
        print(json.dumps(res, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    finally:
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "down", "--clean"],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
