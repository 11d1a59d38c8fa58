#!/usr/bin/env python3
"""Idle time in a GPU trace: Nsight Systems' (`nsys stats -r cuda_gpu_trace -f csv`) or the
CUPTI tracer's (bench/gpu_trace/cupti_trace.cc, which adds each operation's launch time).

Prints the traced span, the time some kernel or copy ran (overlaps merged), the idle time
between them binned by gap length, and the largest gaps with the operations on either side:
launch gaps show as many short gaps, host stalls as a few long ones. With launch times, each
gap is split into the part the host caused (the next operation was queued after the device
ran dry) and the rest (queued in time: dependencies, launch latency); and the kernel time by
name.

    nsys_gaps.py trace.csv [--out gaps.json] [--top 15] [--api trace.csv.api.csv]

--api (the CUPTI tracer's list of the host's CUDA calls): what the host called during each of
the largest gaps, by name.
"""
import argparse
import csv
import json
import sys


def col(header, *names):
    for n in names:
        for i, h in enumerate(header):
            if h.strip().lower().startswith(n.lower()):
                return i
    return None


def tally(items, top):
    """(name, duration) pairs summed by name: the `top` largest as {name, count, total}."""
    by = {}
    for name, d in items:
        t = by.setdefault(name, [0, 0.0])
        t[0] += 1
        t[1] += d
    return [(n, c, t) for n, (c, t) in sorted(by.items(), key=lambda x: -x[1][1])][:top]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--out")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--api")
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv, newline="")))
    if not rows:
        print("nsys_gaps: empty trace")
        return 1
    h = rows[0]
    i_start, i_dur = col(h, "Start"), col(h, "Duration")
    i_name = col(h, "Name")
    i_launch = col(h, "Launch")
    if i_start is None or i_dur is None or i_name is None:
        print(f"nsys_gaps: unexpected columns {h}")
        return 1
    ops = []
    for r in rows[1:]:
        try:
            s, d = float(r[i_start]), float(r[i_dur])
        except (ValueError, IndexError):
            continue
        ln = float(r[i_launch]) if i_launch is not None and r[i_launch] else 0.0
        ops.append((s, s + d, r[i_name], ln))
    ops.sort()
    if not ops:
        print("nsys_gaps: no operations")
        return 1
    kernels = [o for o in ops if not o[2].startswith("[CUDA")]
    # Merged busy intervals (cur_s, cur_e); cur_name is the operation that ends the current one.
    # A gap's host part: from the device running dry to the next operation's launch call.
    busy, gaps, host_late = 0.0, [], 0.0
    cur_s, cur_e, cur_name, _ = ops[0]
    for s, e, n, ln in ops[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_name, n, cur_e, s))
            if ln > cur_e:
                host_late += min(ln, s) - cur_e
            cur_s, cur_e, cur_name = s, e, n
        elif e > cur_e:
            cur_e, cur_name = e, n
    busy += cur_e - cur_s
    span = ops[-1][1] - ops[0][0]
    bins = [(0, 2e3), (2e3, 10e3), (10e3, 100e3), (100e3, float("inf"))]
    binned = []
    for lo, hi in bins:
        g = [x[0] for x in gaps if lo <= x[0] < hi]
        binned.append({"from_us": lo / 1e3, "to_us": None if hi == float("inf") else hi / 1e3,
                       "count": len(g), "ms": sum(g) / 1e6})
    top = sorted(gaps, reverse=True)[: a.top]
    res = {
        "span_ms": span / 1e6,
        "busy_ms": busy / 1e6,
        "idle_ms": (span - busy) / 1e6,
        "kernel_ms": sum(o[1] - o[0] for o in kernels) / 1e6,
        "kernels": len(kernels),
        "operations": len(ops),
        "gap_bins": binned,
        "largest_gaps": [{"us": g[0] / 1e3, "after": g[1][:80], "before": g[2][:80]} for g in top],
    }
    if a.api:
        calls = []
        for r in list(csv.reader(open(a.api, newline="")))[1:]:
            try:
                calls.append((float(r[0]), float(r[1]), r[2]))
            except (ValueError, IndexError):
                continue
        for g, entry in zip(top, res["largest_gaps"]):
            # The part of each call inside the gap [g[3], g[4]).
            inside = [(cn, min(cs + cd, g[4]) - max(cs, g[3])) for cs, cd, cn in calls
                      if cs < g[4] and cs + cd > g[3]]
            entry["host_calls"] = [{"name": n, "count": c, "us": t / 1e3}
                                   for n, c, t in tally(inside, 5)]
    if i_launch is not None:
        res["idle_host_late_ms"] = host_late / 1e6
        res["by_name"] = [{"name": n, "count": c, "ms": t / 1e6}
                          for n, c, t in tally(((o[2][:80], o[1] - o[0]) for o in ops), 25)]
    print(f"traced span {res['span_ms']:.2f} ms: busy {res['busy_ms']:.2f}, idle "
          f"{res['idle_ms']:.2f} ({res['kernels']} kernels summing {res['kernel_ms']:.2f} ms, "
          f"{res['operations']} operations)")
    if "idle_host_late_ms" in res:
        print(f"  of the idle time {res['idle_host_late_ms']:.2f} ms with the next operation "
              f"not yet queued (host-bound), the rest queued in time")
    for b in binned:
        to = "inf" if b["to_us"] is None else f"{b['to_us']:g}"
        print(f"  gaps {b['from_us']:g}-{to} us: {b['count']} summing {b['ms']:.2f} ms")
    for g in res["largest_gaps"]:
        print(f"  {g['us']:9.1f} us after {g['after']} | before {g['before']}")
        for c in g.get("host_calls", []):
            print(f"      host: {c['count']} x {c['name']} ({c['us']:.1f} us in the gap)")
    for t in res.get("by_name", []):
        print(f"  {t['ms']:9.2f} ms in {t['count']:5d} x {t['name']}")
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
