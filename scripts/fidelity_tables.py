#!/usr/bin/python3
"""Markdown tables for docs/fidelity.md from the JSON written by `sparsex fidelity`: mean KL
and relative quality drop per selector, F and ratio with bootstrap 95% intervals, the smallest
compute share at a 1% drop (with the H200 TTFT it implies), block vs token selection, and
paired per-prompt comparisons against sparsex.

usage: scripts/fidelity_tables.py docs/fidelity.json
"""
import json
import sys

# Measured cost curve on the H200 (docs/benchmarks.md, synthetic Llama-3-8B shape, 32769-token
# prompt of which 32512 reused): full prefill 1173.5 ms at share 1; reuse prefill F=2 r=0.15
# 373.4 ms at share 0.2126 (0.209 of layers plus the selection's layer-F QKV projection of every
# row, 0.1154 of a layer: ModelRunner::ProjectionCost for that shape). Linear between the two.
H200_L, H200_N, H200_REUSED, H200_PROJ = 32, 32769, 32512, 0.1154
H200_FULL_MS, H200_REUSE_MS = 1173.5, 373.4


def h200_ms(share):
    reuse_share = h200_share(2, 0.15)
    slope = (H200_FULL_MS - H200_REUSE_MS) / (1 - reuse_share)
    return H200_REUSE_MS + slope * (share - reuse_share)


def h200_share(F, r):
    """Compute share of the H200 benchmark prompt at F full layers and ratio r."""
    rows = (r * H200_REUSED + (H200_N - H200_REUSED)) / H200_N
    return F / H200_L + (1 - F / H200_L) * rows + H200_PROJ / H200_L


def fmt(v, ci, digits=5):
    return f"{v:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def main():
    doc = json.load(open(sys.argv[1]))
    recs = doc["settings"]
    print(f"prompts {doc['prompts']} (seeds {doc['seeds']}, {doc['prompts_per_seed']} per seed; "
          f"{doc['prompts_shortened']} shortened, {doc['prompts_skipped']} skipped); "
          f"bootstrap {doc['bootstrap']}\n")
    enc0 = "none"
    naive = next(r for r in recs if r["selector"] == "naive" and r["encoding"] == enc0)
    print(f"naive: KL {fmt(naive['kl_mean'], naive['kl_mean_ci'])}, drop "
          f"{fmt(naive['quality_drop'], naive['quality_drop_ci'], 4)}, top1 "
          f"{naive['top1_agree']:.3f}, greedy32 {naive['greedy32_agree']:.3f}, share "
          f"{naive['compute_share']:.3f}\n")
    sels = []
    for r in recs:
        if r["selector"] != "naive" and r["selector"] not in sels:
            sels.append(r["selector"])
    ratios = sorted({r["ratio"] for r in recs if r["selector"] != "naive"})
    Fs = sorted({r["full_layers"] for r in recs if r["selector"] != "naive"})
    by = {(r["selector"], r["full_layers"], r["encoding"], r["ratio"]): r for r in recs}
    for key, title, digits in [("kl_mean", "mean KL [95% CI]", 5),
                               ("quality_drop", "relative quality drop [95% CI]", 4)]:
        for F in Fs:
            print(f"\n{title}, F = {F}, encoding {enc0}\n")
            print("| selector | " + " | ".join(f"r={x:g}" for x in ratios) + " |")
            print("|---" * (len(ratios) + 1) + "|")
            for s in sels:
                cells = []
                for x in ratios:
                    r = by.get((s, F, enc0, x))
                    cells.append(fmt(r[key], r[key + "_ci"], digits) if r else "")
                print(f"| {s} | " + " | ".join(cells) + " |")
            shares = [by.get(("sparsex", F, enc0, x)) for x in ratios]
            print("| compute share | " + " | ".join(
                f"{r['compute_share']:.3f}" if r else "" for r in shares) + " |")
    print("\nKL / naive KL, paired bootstrap [95% CI]\n")
    print("| selector | F | " + " | ".join(f"r={x:g}" for x in ratios if 0 < x < 1) + " |")
    print("|---|---" + "|---" * len([x for x in ratios if 0 < x < 1]) + "|")
    for F in Fs:
        for s in sels:
            cells = []
            for x in ratios:
                if not 0 < x < 1:
                    continue
                r = by.get((s, F, enc0, x))
                cells.append(fmt(r["kl_vs_naive"], r["kl_vs_naive_ci"], 2) if r else "")
            print(f"| {s} | {F} | " + " | ".join(cells) + " |")
    print("\nKL / sparsex KL at the same F and r, paired bootstrap [95% CI] (>1: sparsex lower)\n")
    print("| selector | F | " + " | ".join(f"r={x:g}" for x in ratios if 0 < x < 1) + " |")
    print("|---|---" + "|---" * len([x for x in ratios if 0 < x < 1]) + "|")
    for F in Fs:
        for s in sels:
            if s == "sparsex":
                continue
            cells = []
            for x in ratios:
                if not 0 < x < 1:
                    continue
                r = by.get((s, F, enc0, x))
                cells.append(fmt(r["kl_vs_sparsex"], r["kl_vs_sparsex_ci"], 2)
                             if r and "kl_vs_sparsex" in r else "")
            print(f"| {s} | {F} | " + " | ".join(cells) + " |")
    print("\nsmallest compute share with relative quality drop <= 1%\n")
    print("| selector | F | r | share | share (interpolated) | share (CI upper <= 1%) | "
          "H200 32K TTFT at that r, ms |")
    print("|---|---|---|---|---|---|---|")
    for d in doc["drop_1pct"]:
        if d["encoding"] != enc0:
            continue
        ttft = (f"{h200_ms(h200_share(d['full_layers'], d['ratio'])):.0f}"
                if d["ratio"] is not None else "")
        num = (lambda v: "n/a" if v is None else f"{v:.3f}")
        print(f"| {d['selector']} | {d['full_layers']} | {num(d['ratio'])} | {num(d['share'])} | "
              f"{num(d['share_interpolated'])} | {num(d['share_ci_upper'])} | {ttft} |")
    other = [r for r in recs if r["encoding"] != enc0]
    if other:
        print("\nother encodings (sparsex)\n")
        for r in other:
            print(f"- {r['encoding']} {r['selector']} F={r['full_layers']} r={r['ratio']:g}: KL "
                  f"{fmt(r['kl_mean'], r['kl_mean_ci'])}, vs naive({r['encoding']}) "
                  f"{fmt(r['kl_vs_naive'], r['kl_vs_naive_ci'], 2)}, drop "
                  f"{fmt(r['quality_drop'], r['quality_drop_ci'], 4)}")
    print("\ntop-1 / greedy-32 agreement\n")
    for F in Fs:
        for s in sels:
            cells = []
            for x in ratios:
                r = by.get((s, F, enc0, x))
                if r and 0 < x < 1:
                    cells.append(f"{r['top1_agree']:.3f}/{r['greedy32_agree']:.3f}")
            print(f"| {s} | {F} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
