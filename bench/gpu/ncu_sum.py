#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (--csv --page raw, gpu__time_duration.sum) by kernel: where a
prefill's GPU time goes. --minus subtracts another profile's sums (the same program run with
less work, e.g. the reuse benchmark without its reuse runs), --scale divides the result (two
reuse runs -> one), --by-grid keeps launches of one kernel with different grids apart (an
element-wise kernel on the full layers' and the sparse layers' rows; persistent GEMMs launch the
same grid for both).

  ncu_sum.py reuse.csv [--minus full.csv] [--scale 2] [--by-grid] [--json out.json] [--top 25]
"""
import argparse
import json
import sys
from collections import defaultdict

from ncu_steps import load


def sums(path, by_grid=False):
    out, count = defaultdict(float), defaultdict(int)
    for name, us, grid in load(path, keep_templates=True):
        if by_grid:
            name = f"{name} {grid}"
        out[name] += us
        count[name] += 1
    return out, count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--minus")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--by-grid", action="store_true")
    a = ap.parse_args()
    us, n = sums(a.csv, a.by_grid)
    if a.minus:
        mu, mn = sums(a.minus, a.by_grid)
        for k in set(us) | set(mu):
            us[k] = us.get(k, 0.0) - mu.get(k, 0.0)
            n[k] = n.get(k, 0) - mn.get(k, 0)
    rows = sorted(((k, v / a.scale, n[k] / a.scale) for k, v in us.items() if abs(v) > 1e-9),
                  key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"{'kernel':60s} {'ms':>10s} {'launches':>9s} {'share':>6s}")
    for k, v, c in rows[:a.top]:
        label = k[:90] if a.by_grid else k[:60]
        print(f"{label:60s} {v / 1000:10.2f} {c:9.0f} {100 * v / total if total else 0:5.1f}%")
    print(f"{'total':60s} {total / 1000:10.2f}")
    if a.json:
        json.dump({"source": a.csv, "minus": a.minus, "scale": a.scale,
                   "total_ms": total / 1000,
                   "kernels": [{"kernel": k, "ms": v / 1000, "launches": c} for k, v, c in rows]},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
