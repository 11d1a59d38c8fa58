#!/usr/bin/python3
"""Plots, against the computed share of token-layers, the mean KL(full || reuse) and the relative
quality drop (with their bootstrap 95% intervals), one line per selector and number of full
layers, from the JSON written by `sparsex fidelity` (encoding `none`; `:block` selectors dashed;
the 1%-drop line on the right).

usage: scripts/plot_fidelity.py docs/fidelity.json docs/fidelity.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src, out = sys.argv[1], sys.argv[2]
    doc = json.load(open(src))
    recs = doc["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    groups = {}
    for r in recs:
        if r["selector"] == "naive" or r["encoding"] != "none":
            continue
        groups.setdefault((r["selector"], r["full_layers"]), []).append(r)
    colors = {}
    for (sel, f), rs in sorted(groups.items()):
        rs = sorted((r for r in rs if r["ratio"] < 1.0), key=lambda r: r["ratio"])
        base = sel.split(":")[0]
        color = colors.setdefault(base, f"C{len(colors)}")
        style = "-" if f == 2 else ":"
        x = [r["compute_share"] for r in rs]
        for ax, key in zip(axes, ["kl_mean", "quality_drop"]):
            y = [r[key] for r in rs]
            lo = [r[key] - r[key + "_ci"][0] for r in rs]
            hi = [r[key + "_ci"][1] - r[key] for r in rs]
            ax.errorbar(x, y, yerr=[lo, hi], fmt=style,
                        marker="s" if sel.endswith(":block") else "o", ms=3, color=color,
                        capsize=2, lw=1, label=f"{sel} F={f}")
    for r in recs:
        if r["selector"] == "naive" and r["encoding"] == "none":
            for ax, key in zip(axes, ["kl_mean", "quality_drop"]):
                ax.plot([r["compute_share"]], [r[key]], "k*", ms=10)
                ax.annotate("naive", (r["compute_share"], r[key]))
    axes[1].axhline(0.01, color="k", lw=0.8, ls="-.")
    axes[1].annotate("1% drop", (0.8, 0.0105))
    axes[0].set_ylabel("mean KL(full || reuse), 95% CI")
    axes[1].set_ylabel("relative quality drop, 95% CI")
    axes[0].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("computed share of token-layers (full prefill = 1); F=2 solid, F=1 dotted, blocks square")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"stories260K, {doc['prompts']} RAG prompts (seeds {doc['seeds']}): "
                 "fidelity vs compute (r = 0 ... 0.5)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
