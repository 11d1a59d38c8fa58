#!/usr/bin/env python3
"""Idle time in an Nsight Systems GPU trace (`nsys stats -r cuda_gpu_trace -f csv`).

Prints the traced span, the time some kernel or copy ran (overlaps merged), the idle time
between them binned by gap length, and the largest gaps with the operations on either side:
launch gaps show as many short gaps, host stalls as a few long ones.

    nsys_gaps.py trace.csv [--out gaps.json] [--top 15]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--out")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv, newline="")))
    if not rows:
        print("nsys_gaps: empty trace")
        return 1
    h = rows[0]
    i_start, i_dur = col(h, "Start"), col(h, "Duration")
    i_name = col(h, "Name")
    if i_start is None or i_dur is None or i_name is None:
        print(f"nsys_gaps: unexpected columns {h}")
        return 1
    ops = []
    for r in rows[1:]:
        try:
            s, d = float(r[i_start]), float(r[i_dur])
        except (ValueError, IndexError):
            continue
        ops.append((s, s + d, r[i_name]))
    ops.sort()
    if not ops:
        print("nsys_gaps: no operations")
        return 1
    kernels = [o for o in ops if not o[2].startswith("[CUDA")]
    # Merged busy intervals (cur_s, cur_e); cur_name is the operation that ends the current one.
    busy, gaps = 0.0, []
    cur_s, cur_e, cur_name = ops[0]
    for s, e, n in ops[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_name, n))
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
        "kernel_ms": sum(e - s for s, e, _ in kernels) / 1e6,
        "kernels": len(kernels),
        "operations": len(ops),
        "gap_bins": binned,
        "largest_gaps": [{"us": g / 1e3, "after": b[:80], "before": n[:80]} for g, b, n in top],
    }
    print(f"traced span {res['span_ms']:.2f} ms: busy {res['busy_ms']:.2f}, idle "
          f"{res['idle_ms']:.2f} ({res['kernels']} kernels summing {res['kernel_ms']:.2f} ms, "
          f"{res['operations']} operations)")
    for b in binned:
        to = "inf" if b["to_us"] is None else f"{b['to_us']:g}"
        print(f"  gaps {b['from_us']:g}-{to} us: {b['count']} summing {b['ms']:.2f} ms")
    for g in res["largest_gaps"]:
        print(f"  {g['us']:9.1f} us after {g['after']} | before {g['before']}")
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
