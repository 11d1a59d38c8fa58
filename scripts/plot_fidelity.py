#!/usr/bin/python3
"""Plots KL(full || reuse) against the computed share of token-layers, one line per selector
and number of full layers, from the JSON written by `sparsex fidelity`.

usage: scripts/plot_fidelity.py docs/fidelity.json docs/fidelity.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src, out = sys.argv[1], sys.argv[2]
    recs = json.load(open(src))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = {}
    for r in recs:
        if r["selector"] == "naive":
            continue
        groups.setdefault((r["selector"], r["full_layers"], r["encoding"]), []).append(r)
    for (sel, f, enc), rs in sorted(groups.items()):
        rs = [r for r in rs if r["ratio"] < 1.0]
        style = "-" if enc == "none" else ":"
        for ax, key in zip(axes, ["kl_mean", "kl_median"]):
            ax.plot([r["compute_share"] for r in rs], [r[key] for r in rs], style, marker="o",
                    ms=3, label=f"{sel} F={f} {enc}")
    for r in recs:
        if r["selector"] == "naive":
            for ax, key in zip(axes, ["kl_mean", "kl_median"]):
                ax.plot([r["compute_share"]], [r[key]], "k*", ms=10)
                ax.annotate(f"naive ({r['encoding']})", (r["compute_share"], r[key]))
    for ax, key in zip(axes, ["mean KL(full || reuse)", "median KL(full || reuse)"]):
        ax.set_xlabel("computed share of token-layers (full prefill = 1)")
        ax.set_ylabel(key)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("stories260K, 50 RAG prompts: fidelity vs compute (r = 0 ... 0.5)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
