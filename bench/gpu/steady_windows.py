#!/usr/bin/env python3
"""At full size: reuse under a stream of new document orderings, per window.

Two subcommands (python3 standard library only; bench/gpu/steady.sh runs both):

  sample   polls the worker's and the cache server's /metrics (and, with --gpu, nvidia-smi;
           with --pid NAME=PID, the process's resident memory) every --interval seconds and
           appends one JSON line per poll, until killed or --max_s.
  analyze  reads sparsex-loadgen's --records (one JSON line per request), the memory samples and
           the workload's orderings (sparsex-loadgen --dry_run), and reports per window of
           --window requests (by request index, i.e. send order): the reused share, TTFT p50 /
           p99 and errors; the weakest window after the warm-up (window 0) over the best one;
           memory peaks against their bounds. Writes --out (JSON) and prints a table. Exit
           status: 0 all checks pass, 1 a check failed, 2 no usable records.

The reused share is the one of tests/scheduler/steady_state_test.cc and docs/fidelity.md
("Reuse under a stream of new orderings"): (reused + exact-prefix tokens) / prompt tokens,
summed over the window's completed requests.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request

# Worker and cache-server gauges sampled (the memory bounds and what explains the share).
WORKER_METRICS = ("sparsex_worker_kv_bytes", "sparsex_worker_host_segments",
                  "sparsex_worker_kv_blocks", "sparsex_worker_unspilled_segments",
                  "sparsex_worker_pending_stores", "sparsex_worker_stores_dropped",
                  "sparsex_worker_queue_depth", "sparsex_worker_running",
                  "sparsex_worker_fetch_timeouts", "sparsex_worker_reuse_disabled")
CACHE_METRICS = ("sparsex_cache_used_bytes", "sparsex_cache_capacity_bytes",
                 "sparsex_cache_blocks")
SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')


def scrape(addr, names, timeout=2.0):
    """{'name{labels}': value} for the samples of the named metrics; {} when unreachable."""
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except Exception:  # a stopped or busy server: a gap in the samples, not a failure
        return {}
    out = {}
    for line in text.splitlines():
        m = SAMPLE_RE.match(line)
        if m and m.group(1) in names:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gpu_used_mib():
    """Used memory of each GPU (MiB), or None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return [float(x) for x in r.stdout.split()] if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def cmd_sample(a):
    pids = dict(p.split("=", 1) for p in a.pid)
    t_end = time.time() + a.max_s
    with open(a.out, "a") as f:
        while time.time() < t_end:
            t = time.time()
            s = {"t": t}
            if a.worker:
                s["worker"] = scrape(a.worker, WORKER_METRICS)
            if a.cache:
                s["cache"] = scrape(a.cache, CACHE_METRICS)
            if pids:
                s["rss"] = {n: rss_bytes(p) for n, p in pids.items()}
            if a.gpu:
                s["gpu_used_mib"] = gpu_used_mib()
            f.write(json.dumps(s) + "\n")
            f.flush()
            time.sleep(max(0.0, a.interval - (time.time() - t)))
    return 0


def percentile(v, p):
    """Linear interpolation between closest ranks (as bench/loadgen/stats.cc)."""
    if not v:
        return None
    v = sorted(v)
    idx = p / 100.0 * (len(v) - 1)
    lo = int(math.floor(idx))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (idx - lo)


def load_jsonl(path):
    out = []
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by a kill
    return out


def orderings(path):
    """{request index: tuple of document ids in prompt order} from --dry_run output."""
    out = {}
    if not path or not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            m = re.match(r"request (\d+) ", line)
            if m:
                out[int(m.group(1))] = tuple(int(d) for d in re.findall(r"document#(\d+)", line))
    return out


def window_stats(recs):
    ok = [r for r in recs if r.get("code") == "OK" and r.get("usage")]
    sums = {k: sum(r["usage"].get(k) or 0 for r in ok)
            for k in ("prompt_tokens", "reused_tokens", "prefix_tokens", "recomputed_tokens",
                      "new_tokens", "segments_hit", "segments_fetched", "fetch_failures")}
    ttft = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    wttft = [r["usage"]["worker_ttft_ms"] for r in ok if r["usage"].get("worker_ttft_ms") is not None]
    p = sums["prompt_tokens"]
    return {
        "requests": len(recs), "completed": len(ok), "errors": len(recs) - len(ok),
        "reused_share": (sums["reused_tokens"] + sums["prefix_tokens"]) / p if p else None,
        "segment_reuse_share": sums["reused_tokens"] / p if p else None,
        "prefix_share": sums["prefix_tokens"] / p if p else None,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "worker_ttft_p50_ms": percentile(wttft, 50), "worker_ttft_p99_ms": percentile(wttft, 99),
        "start_ms": min((r.get("scheduled_ms") or 0) for r in recs) if recs else None,
        "end_ms": max((r.get("end_ms") or r.get("scheduled_ms") or 0) for r in recs) if recs else None,
        **{k: sums[k] for k in sums},
    }


def peak(samples, key_fn):
    vals = [v for v in (key_fn(s) for s in samples) if v is not None]
    return max(vals) if vals else None


def gauge(s, part, name):
    d = s.get(part) or {}
    return d.get(name)


def cmd_analyze(a):
    recs = load_jsonl(a.records)
    if not recs:
        print(f"steady_windows: no records in {a.records}", file=sys.stderr)
        return 2
    recs.sort(key=lambda r: r.get("index", 0))
    # Request end times: scheduled + e2e (the records carry both, relative to the run's start).
    for r in recs:
        if r.get("e2e_ms") is not None:
            r["end_ms"] = (r.get("scheduled_ms") or 0) + (r.get("lag_ms") or 0) + r["e2e_ms"]
    mem = load_jsonl(a.memory)
    orders = orderings(a.orderings)
    n_win = (len(recs) + a.window - 1) // a.window
    windows = []
    for w in range(n_win):
        chunk = recs[w * a.window:(w + 1) * a.window]
        st = window_stats(chunk)
        st["window"] = w
        st["full"] = len(chunk) == a.window
        # Memory per window: the samples taken while its requests ran (the run started at
        # --t0, the wall time the script launched the load generator: alignment within the
        # load generator's start-up, a few ms).
        if mem and a.t0 and st["start_ms"] is not None:
            lo, hi = a.t0 + st["start_ms"] / 1000.0, a.t0 + st["end_ms"] / 1000.0
            ws = [s for s in mem if lo <= s["t"] <= hi]
            st["host_store_peak_bytes"] = peak(ws, lambda s: gauge(s, "worker", 'sparsex_worker_kv_bytes{tier="host"}'))
            st["device_tier_peak_bytes"] = peak(ws, lambda s: gauge(s, "worker", 'sparsex_worker_kv_bytes{tier="device"}'))
            st["host_segments_peak"] = peak(ws, lambda s: gauge(s, "worker", "sparsex_worker_host_segments"))
        # New orderings: how many of the window's orderings were never sent before it.
        if orders:
            seen_before = set(orders[i] for i in range(0, w * a.window) if i in orders)
            ids = [r.get("index") for r in chunk]
            st["new_orderings"] = sum(1 for i in ids if i in orders and orders[i] not in seen_before)
        windows.append(st)

    # Flatness: full windows after the warm-up window, weakest over best.
    after = [w for w in windows[1:] if w["full"] and w["reused_share"] is not None]
    best = max((w["reused_share"] for w in after), default=None)
    worst = min((w["reused_share"] for w in after), default=None)
    ratio = worst / best if best else None
    total = window_stats(recs)

    # Orderings over the whole run.
    ord_info = None
    if orders:
        sent = [orders[r["index"]] for r in recs if r.get("index") in orders]
        counts = {}
        for o in sent:
            counts[o] = counts.get(o, 0) + 1
        ord_info = {"requests": len(sent), "distinct_orderings": len(counts),
                    "requests_with_a_repeated_ordering": sum(c for c in counts.values() if c > 1),
                    "distinct_document_sets": len(set(frozenset(o) for o in sent)),
                    "documents_used": len(set(d for o in sent for d in o))}

    # The workload's own spread: a cache that always held the k documents most popular over the
    # whole run (an oracle no online policy beats on average) hits, per window, the share of the
    # window's document draws that fall on them. Its worst/best window says how flat any cache
    # of k documents can be on this request stream: Zipf draws of 100 requests vary by window.
    oracle = None
    if orders and a.oracle_docs:
        sent_ids = [r["index"] for r in recs if r.get("index") in orders]
        pop = {}
        for i in sent_ids:
            for d in orders[i]:
                pop[d] = pop.get(d, 0) + 1
        ranked = sorted(pop, key=lambda d: (-pop[d], d))
        oracle = []
        for k in sorted({int(x) for x in a.oracle_docs.split(",") if x}):
            top = set(ranked[:k])
            shares = []
            for w in range(n_win):
                ids = [r.get("index") for r in recs[w * a.window:(w + 1) * a.window]]
                draws = [d for i in ids if i in orders for d in orders[i]]
                shares.append(sum(d in top for d in draws) / len(draws) if draws else None)
            aft = [x for w, x in zip(windows[1:], shares[1:]) if w["full"] and x is not None]
            oracle.append({"docs": k, "window_draw_share": shares,
                           "worst_over_best": min(aft) / max(aft) if aft and max(aft) else None})

    # Memory against bounds. The device tier's bytes are checked when the worker exports them
    # (sparsex_worker_kv_bytes{tier="device"}); GPU memory (nvidia-smi) is reported beside them:
    # its growth after start-up includes the device tier and the transient prefill buffers.
    memory = {"samples": len(mem)}
    checks = {}
    host_peak = peak(mem, lambda s: gauge(s, "worker", 'sparsex_worker_kv_bytes{tier="host"}'))
    memory["host_store_peak_bytes"] = host_peak
    memory["host_store_bound_bytes"] = a.host_bound
    if host_peak is not None and a.host_bound:
        checks["host_store_within_bound"] = host_peak <= a.host_bound
    dev_peak = peak(mem, lambda s: gauge(s, "worker", 'sparsex_worker_kv_bytes{tier="device"}'))
    memory["device_tier_peak_bytes"] = dev_peak
    memory["device_tier_bound_bytes"] = a.device_bound
    if dev_peak is not None and a.device_bound:
        checks["device_tier_within_bound"] = dev_peak <= a.device_bound
    elif a.device_bound:
        memory["device_tier_note"] = "the worker exports no device-tier bytes: not checked"
    memory["host_segments_peak"] = peak(mem, lambda s: gauge(s, "worker", "sparsex_worker_host_segments"))
    memory["unspilled_segments_peak"] = peak(mem, lambda s: gauge(s, "worker", "sparsex_worker_unspilled_segments"))
    memory["pending_stores_peak"] = peak(mem, lambda s: gauge(s, "worker", "sparsex_worker_pending_stores"))
    last = lambda part, name: next((gauge(s, part, name) for s in reversed(mem) if gauge(s, part, name) is not None), None)
    memory["stores_dropped"] = last("worker", "sparsex_worker_stores_dropped")
    memory["reuse_disabled_peak"] = peak(mem, lambda s: gauge(s, "worker", "sparsex_worker_reuse_disabled"))
    for tier in ("memory", "disk"):
        used = peak(mem, lambda s: gauge(s, "cache", f'sparsex_cache_used_bytes{{tier="{tier}"}}'))
        cap = last("cache", f'sparsex_cache_capacity_bytes{{tier="{tier}"}}')
        memory[f"cache_{tier}_peak_bytes"] = used
        memory[f"cache_{tier}_capacity_bytes"] = cap
        if used is not None and cap:  # capacity 0: unbounded
            checks[f"cache_{tier}_within_bound"] = used <= cap
    for name in sorted({n for s in mem for n in (s.get("rss") or {})}):
        memory[f"rss_{name}_peak_bytes"] = peak(mem, lambda s: (s.get("rss") or {}).get(name))
    gpu = [sum(s["gpu_used_mib"]) for s in mem if s.get("gpu_used_mib")]
    if gpu:
        memory["gpu_used_first_mib"] = gpu[0]
        memory["gpu_used_peak_mib"] = max(gpu)
        memory["gpu_used_growth_mib"] = max(gpu) - gpu[0]

    if ratio is not None:  # one window after the warm-up cannot show a trend
        checks["windows_flat"] = ratio >= a.flat and len(after) >= 2
    checks["no_errors"] = total["errors"] == 0
    checks["enough_requests"] = total["completed"] >= a.min_requests
    result = {
        "config": {k: v for k, v in vars(a).items() if k not in ("func",)},
        "window": a.window, "windows": windows, "total": total,
        "after_warmup": {"windows": len(after), "best_reused_share": best,
                         "worst_reused_share": worst, "worst_over_best": ratio,
                         "threshold": a.flat},
        "orderings": ord_info, "oracle": oracle, "memory": memory, "checks": checks,
        "pass": all(checks.values()) if checks else False,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    f2 = lambda v, fmt: "-" if v is None else format(v, fmt)
    mib = lambda v: "-" if v is None else f"{v / 2**20:.0f}" if v >= 100 * 2**20 else f"{v / 2**20:.2f}"
    print(f"{'win':>3} {'reqs':>4} {'err':>3} {'reused':>6} {'prefix':>6} {'ttft50':>8} {'ttft99':>8} "
          f"{'wttft50':>8} {'fetched':>7} {'new_ord':>7} {'host_MiB':>8} {'dev_MiB':>7}")
    for w in windows:
        print(f"{w['window']:>3} {w['requests']:>4} {w['errors']:>3} {f2(w['reused_share'], '.3f'):>6} "
              f"{f2(w['prefix_share'], '.3f'):>6} {f2(w['ttft_p50_ms'], '.1f'):>8} "
              f"{f2(w['ttft_p99_ms'], '.1f'):>8} {f2(w['worker_ttft_p50_ms'], '.1f'):>8} "
              f"{w['segments_fetched']:>7} {f2(w.get('new_orderings'), 'd'):>7} "
              f"{mib(w.get('host_store_peak_bytes')):>8} {mib(w.get('device_tier_peak_bytes')):>7}"
              f"{'' if w['full'] else '  (partial)'}")
    print(f"all: {total['completed']}/{total['requests']} completed, reused share "
          f"{f2(total['reused_share'], '.3f')}, TTFT p50 {f2(total['ttft_p50_ms'], '.1f')} ms, "
          f"p99 {f2(total['ttft_p99_ms'], '.1f')} ms")
    print(f"after warm-up: worst/best window {f2(ratio, '.3f')} (worst {f2(worst, '.3f')}, best "
          f"{f2(best, '.3f')}; threshold {a.flat})")
    for o in oracle or []:
        print(f"oracle holding the {o['docs']} most popular documents: window draw shares "
              + " ".join(f2(x, '.3f') for x in o["window_draw_share"])
              + f"; worst/best after warm-up {f2(o['worst_over_best'], '.3f')}")
    if ord_info:
        print(f"orderings: {ord_info['distinct_orderings']} distinct of {ord_info['requests']} "
              f"({ord_info['requests_with_a_repeated_ordering']} requests share an ordering with "
              f"another), {ord_info['distinct_document_sets']} document sets, "
              f"{ord_info['documents_used']} documents")
    print("memory (MiB): host store peak {} / bound {}; device tier peak {} / bound {}; cache memory "
          "peak {} / {}; cache disk peak {} / {}{}".format(
              mib(host_peak), mib(a.host_bound), mib(dev_peak), mib(a.device_bound),
              mib(memory["cache_memory_peak_bytes"]), mib(memory["cache_memory_capacity_bytes"]),
              mib(memory["cache_disk_peak_bytes"]), mib(memory["cache_disk_capacity_bytes"]),
              f"; GPU used {gpu[0]:.0f} -> peak {max(gpu):.0f}" if gpu else ""))
    if "device_tier_note" in memory:
        print("device tier: " + memory["device_tier_note"])
    print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in checks.items()))
    print("PASS" if result["pass"] else "FAIL")
    return 0 if result["pass"] else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--worker", help="worker metrics host:port")
    s.add_argument("--cache", help="cache server metrics host:port")
    s.add_argument("--pid", action="append", default=[], help="NAME=PID: sample its VmRSS")
    s.add_argument("--gpu", action="store_true", help="sample nvidia-smi's used memory")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--max_s", type=float, default=900.0, help="stop after this many seconds")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_sample)
    z = sub.add_parser("analyze")
    z.add_argument("--records", required=True, help="sparsex-loadgen --records JSONL")
    z.add_argument("--memory", help="samples written by `sample`")
    z.add_argument("--orderings", help="sparsex-loadgen --dry_run output of the same workload")
    z.add_argument("--t0", type=float, default=0.0, help="wall time the load generator started")
    z.add_argument("--window", type=int, default=100)
    z.add_argument("--oracle_docs", default="",
                   help="comma-separated k: the flatness of a cache always holding the k most "
                        "popular documents (the workload's own spread), e.g. what each tier holds")
    z.add_argument("--flat", type=float, default=0.9, help="worst / best window must reach this")
    z.add_argument("--min_requests", type=int, default=1000)
    z.add_argument("--host_bound", type=float, default=0, help="host store bound, bytes")
    z.add_argument("--device_bound", type=float, default=0, help="device tier bound, bytes")
    z.add_argument("--out", help="write the result JSON here")
    z.set_defaults(func=cmd_analyze)
    a = p.parse_args()
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
