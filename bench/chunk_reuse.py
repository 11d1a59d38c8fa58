#!/usr/bin/env python3
"""Offline content-chunk analysis of the requests a sparsex-loadgen run sent.

Reads `sparsex-loadgen --dump_requests FILE` (one JSON line per request: chat `messages`, or
`segments` of text or token ids) and reports the share of prompt units that belong to a chunk
already seen in an earlier request: the reuse a cache keyed by content chunks could find,
whatever the client marked. With `--records` (the same run's `sparsex-loadgen --records`) it
prints next to it the share the server reported reusing (`usage`: reused_tokens and
prefix_tokens over prompt_tokens) for the same requests, so the two can be compared.

Units: token ids where the dump has them (`--content numbers`, traces), exact; for text, words
(whitespace-separated), an approximation of tokens (the server's shares are in tokens).
Chunking: content-defined over the units (a boundary where a rolling hash of the last
`--window` units hits, no chunk shorter than `--min` or longer than `--max`, about `--avg`
long), the router's rule for plain prompts (model/chunking.h) applied to words; or
`--chunking paragraphs` (text: blank-line or line separated spans) or `--chunking segments`
(the dump's own segments or messages).

Only python3's standard library (CI has no PyPI).

  sparsex-loadgen --api openai --content text --docs FILE ... --dump_requests req.jsonl \\
      --records rec.jsonl
  python3 bench/chunk_reuse.py req.jsonl --records rec.jsonl
"""
import argparse
import hashlib
import json
import sys


def units_of(req):
    """The request's prompt as a list of (unit, piece) where piece indexes its segment/message."""
    out = []
    if "messages" in req:
        for i, m in enumerate(req["messages"]):
            content = m.get("content", "")
            if isinstance(content, list):  # text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            out.extend((w, i, m.get("role", "")) for w in content.split())
    elif "segments" in req:
        for i, s in enumerate(req["segments"]):
            if "ids" in s:
                out.extend((int(t), i, s.get("kind", "")) for t in s["ids"])
            else:
                out.extend((w, i, s.get("kind", "")) for w in s.get("text", "").split())
    else:
        raise ValueError("a request line needs 'messages' or 'segments'")
    return out


def unit_hash(u):
    return int.from_bytes(hashlib.blake2b(str(u).encode(), digest_size=8).digest(), "little")


def chunk_cdc(units, min_len, avg, max_len, window):
    """[begin, end) ranges: content-defined boundaries from the last `window` units' hashes."""
    mask = 1
    while mask < avg:
        mask <<= 1
    mask -= 1
    hs = [unit_hash(u) for u in units]
    chunks, start = [], 0
    for i in range(len(units)):
        n = i + 1 - start
        if n >= max_len:
            chunks.append((start, i + 1))
            start = i + 1
            continue
        if n < min_len:
            continue
        h = 0
        for x in hs[max(start, i + 1 - window):i + 1]:
            h = (h * 0x100000001B3 ^ x) & 0xFFFFFFFFFFFFFFFF
        if (h >> 17) & mask == mask:
            chunks.append((start, i + 1))
            start = i + 1
    if start < len(units):
        chunks.append((start, len(units)))
    return chunks


def chunk_pieces(units):
    chunks, start = [], 0
    for i in range(1, len(units) + 1):
        if i == len(units) or units[i][1] != units[i - 1][1]:
            chunks.append((start, i))
            start = i
    return chunks


def analyze(requests, args):
    seen = set()
    rows = []
    for req in requests:
        us = units_of(req)
        if args.chunking == "cdc":
            ranges = chunk_cdc([u[0] for u in us], args.min, args.avg, args.max, args.window)
        else:
            ranges = chunk_pieces(us)
        keys = [hashlib.blake2b(json.dumps([u[0] for u in us[a:b]]).encode(),
                                digest_size=16).digest() for a, b in ranges]
        reused = sum(b - a for (a, b), k in zip(ranges, keys) if k in seen)
        seen.update(keys)
        rows.append({"run": req.get("run"), "index": req.get("index"),
                     "warmup": bool(req.get("warmup")), "units": len(us), "reused": reused,
                     "chunks": len(ranges)})
    return rows


def split_paragraphs(req):
    """--chunking paragraphs: text split at line breaks, so each paragraph is a piece."""
    if "messages" in req:
        text = [(m.get("role", ""), m.get("content", "")) for m in req["messages"]]
    else:
        text = [(s.get("kind", ""), s.get("text", "")) for s in req["segments"] if "text" in s]
    pieces = []
    for role, t in text:
        pieces.extend({"role": role, "content": p} for p in t.split("\n") if p.strip())
    return {**req, "messages": pieces}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requests", help="sparsex-loadgen --dump_requests file (JSON lines)")
    ap.add_argument("--records", help="the run's sparsex-loadgen --records file (server usage)")
    ap.add_argument("--chunking", choices=["cdc", "paragraphs", "segments"], default="cdc")
    ap.add_argument("--min", type=int, default=32, help="cdc: shortest chunk, units (32)")
    ap.add_argument("--avg", type=int, default=64, help="cdc: average chunk, units (64)")
    ap.add_argument("--max", type=int, default=256, help="cdc: longest chunk, units (256)")
    ap.add_argument("--window", type=int, default=8, help="cdc: rolling window, units (8)")
    ap.add_argument("--json", help="write the totals as a JSON object here")
    args = ap.parse_args()
    if not (1 <= args.min <= args.avg <= args.max) or args.window < 1:
        ap.error("need 1 <= --min <= --avg <= --max and --window >= 1")

    requests = []
    with open(args.requests, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                units_of(req)
            except (ValueError, TypeError, AttributeError) as e:
                sys.exit(f"{args.requests}:{n}: {e}")
            requests.append(split_paragraphs(req) if args.chunking == "paragraphs" else req)
    if not requests:
        sys.exit(f"{args.requests}: no requests")
    rows = analyze(requests, args)
    measured = [r for r in rows if not r["warmup"]]
    units = sum(r["units"] for r in measured)
    reused = sum(r["reused"] for r in measured)
    word_units = any("messages" in q or any("text" in s for s in q.get("segments", []))
                     for q in requests)
    unit = "words" if word_units else "tokens"
    out = {"requests": len(measured), "warmup_or_prime": len(rows) - len(measured),
           "chunking": args.chunking, "unit": unit, "prompt_units": units,
           "reused_units": reused, "chunk_reused_share": reused / units if units else None}
    print(f"{len(measured)} measured requests ({out['warmup_or_prime']} warmup/prime requests "
          f"seen first), {units} prompt {unit}, chunking {args.chunking}")
    print(f"offline: {reused} {unit} in a chunk seen in an earlier request: share "
          f"{out['chunk_reused_share']:.3f}" if units else "offline: no prompt units")

    if args.records:
        recs = {}
        with open(args.records, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        r = json.loads(line)
                    except ValueError as e:
                        sys.exit(f"{args.records}:{n}: {e}")
                    recs[(r.get("run"), r.get("index"))] = r
        p = ru = pr = missing = 0
        for r in measured:
            rec = recs.get((r["run"], r["index"]))
            if rec is None or "usage" not in rec:
                missing += 1
                continue
            u = rec["usage"]
            p += u.get("prompt_tokens", 0)
            ru += u.get("reused_tokens", 0)
            pr += u.get("prefix_tokens", 0)
        out.update({"server_requests": len(measured) - missing, "server_prompt_tokens": p,
                    "server_reused_tokens": ru, "server_prefix_tokens": pr,
                    "server_reused_share": ru / p if p else None,
                    "server_cached_share": (ru + pr) / p if p else None})
        if p:
            print(f"server: {len(measured) - missing} requests with usage, {p} prompt tokens: "
                  f"reused {ru / p:.3f}, exact prefix {pr / p:.3f}, together {(ru + pr) / p:.3f}")
        else:
            print("server: no usage in the records for these requests")
        if missing:
            print(f"server: {missing} requests without a record with usage (failed or absent)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
