#!/usr/bin/env python3
"""Clocks and power of the GPU-heavy part of a run, from the nvidia-smi samples that
staged_env.sh's `sample_clocks` writes (timestamp, clocks.sm, clocks.mem, power.draw,
temperature.gpu, utilization.gpu, clock event reasons; CSV without header or units).

A card at its power limit runs its kernels at whatever clock the limit allows (an H100 at
700 W: ~1515 MHz of 1980 through a 32K prefill, docs/perf-notes.md), so idle time
removed from a run buys nothing there and only less energy shortens it: the summary says how
many samples ran power-capped (reason bit 0x4, the software power cap).

    clocks_summary.py clocks_a.csv [clocks_b.csv ...] [--min-watts 300] [--out clocks.json]
"""
import argparse
import csv
import json
import statistics
import sys


def summary(path, min_watts):
    rows = []
    try:
        lines = list(csv.reader(open(path, newline="")))
    except OSError:
        lines = []  # no nvidia-smi on the machine, or the sampler never started
    for r in lines:
        try:
            rows.append((float(r[1]), float(r[3]), float(r[4]), int(r[6].strip(), 16)))
        except (ValueError, IndexError):
            continue  # a sample with [N/A] fields, or a line cut off when sampling stopped
    busy = [r for r in rows if r[1] >= min_watts]
    out = {"file": path, "samples": len(rows), "busy_samples": len(busy)}
    if busy:
        clk, watts = [r[0] for r in busy], [r[1] for r in busy]
        out.update({
            "sm_clock_median_mhz": statistics.median(clk),
            "sm_clock_mean_mhz": round(statistics.mean(clk), 1),
            "sm_clock_max_mhz": max(clk),
            "power_median_w": statistics.median(watts),
            "temperature_max_c": max(r[2] for r in busy),
            "power_capped_share": round(sum(1 for r in busy if r[3] & 0x4) / len(busy), 3),
        })
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--min-watts", type=float, default=300.0,
                    help="samples below this draw count as idle or host-bound phases")
    ap.add_argument("--out")
    a = ap.parse_args()
    res = [summary(p, a.min_watts) for p in a.csv]
    for s in res:
        if not s["busy_samples"]:
            print(f"{s['file']}: {s['samples']} samples, none at >= {a.min_watts:g} W")
            continue
        print(f"{s['file']}: {s['busy_samples']} of {s['samples']} samples at >= {a.min_watts:g} W: "
              f"SM clock median {s['sm_clock_median_mhz']:.0f} MHz (max "
              f"{s['sm_clock_max_mhz']:.0f}), power median {s['power_median_w']:.0f} W, "
              f"power-capped {100 * s['power_capped_share']:.0f}% of them, temperature max "
              f"{s['temperature_max_c']:.0f} C")
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
