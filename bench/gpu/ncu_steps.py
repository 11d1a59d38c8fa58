#!/usr/bin/env python3
"""Splits an Nsight Compute CSV (--csv --page raw, gpu__time_duration.sum) of
gpu_prefill_bench's decode steps into steps and sums each step's kernels by kernel.

The decode section runs its configurations one after another (batch 1, then batch B; plain
launches, then CUDA graphs, whose nodes ncu times one by one, so both give the same kernel
sequence). A warm step repeats the previous one kernel for kernel, so the file's tail is cut
into runs of a repeating period: each run is one batch size, its period one step.

  ncu_steps.py ncu_decode.csv [--batch 32] [--json out.json]
"""
import argparse
import csv
import json
import re
import statistics
import sys


def short(name, keep_templates=False):
    if keep_templates:  # namespaces and arguments off, template arguments kept
        name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
        depth, cut = 0, len(name)
        for i, ch in enumerate(name):
            depth += (ch == "<") - (ch == ">")
            if ch == "(" and depth == 0:
                cut = i
                break
        name = re.sub(r"\b[A-Za-z_]\w*::", "", name[:cut])
        return name.replace("void ", "").strip()
    name = re.sub(r"\(.*$", "", name)           # arguments
    while "<" in name:                          # template arguments, innermost first
        new = re.sub(r"<[^<>]*>", "", name)
        if new == name:
            break
        name = new
    name = name.split("::")[-1].strip()
    return name.replace("void ", "")


def load(path, keep_templates=False):
    with open(path, newline="") as f:
        lines = f.readlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no CSV header")
    rows = list(csv.DictReader(lines[start:]))
    out = []
    for r in rows:
        try:
            int(r["ID"])
            ns = float(str(r["gpu__time_duration.sum"]).replace(",", ""))
        except (ValueError, KeyError):
            continue  # the units row
        out.append((short(r["Kernel Name"], keep_templates), ns / 1000.0,
                    r.get("Grid Size", "")))
    return out


def runs(names, min_period=20, max_period=4000):
    """(start, end, period) of the repeating runs, from the end of the list backwards."""
    found = []
    end = len(names)
    while end > 2 * min_period:
        best = None
        for p in range(min_period, min(max_period, end // 2) + 1):
            if names[end - p:end] == names[end - 2 * p:end - p]:
                best = p
                break
        if best is None:
            break
        start = end - 2 * best
        while start - best >= 0 and names[start - best:start] == names[start:start + best]:
            start -= best
        found.append((start, end, best))
        end = start
        # skip the run's warm-up steps (record, capture: a different sequence) up to the
        # previous batch size's run
        while end > 2 * min_period:
            p_try = None
            for p in range(min_period, min(max_period, end // 2) + 1):
                if names[end - p:end] == names[end - 2 * p:end - p]:
                    p_try = p
                    break
            if p_try is not None:
                break
            end -= 1
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args()
    ks = load(a.csv)
    names = [k[0] for k in ks]
    report = {"kernels_profiled": len(ks), "runs": []}
    for start, end, p in runs(names)[:a.runs]:
        steps = (end - start) // p
        per = {}
        totals = []
        for s in range(steps):
            seg = ks[start + s * p:start + (s + 1) * p]
            totals.append(sum(k[1] for k in seg))
            for name, us, _ in seg:
                per.setdefault(name, []).append(us)
        rows = sorted(((n, len(v) // steps, sum(v) / steps) for n, v in per.items()),
                      key=lambda r: -r[2])
        run = {"kernels_per_step": p, "steps": steps,
               "kernel_sum_ms_median": statistics.median(totals) / 1000.0,
               "by_kernel": [{"kernel": n, "launches": c, "us": round(us, 1)} for n, c, us in rows]}
        report["runs"].append(run)
        print(f"run: {steps} steps of {p} kernels, kernel time per step {run['kernel_sum_ms_median']:.3f} ms")
        for n, c, us in rows:
            print(f"  {us:9.1f} us  {c:4d} x  {n}")
    report["runs"].reverse()  # file order: batch 1 first
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
