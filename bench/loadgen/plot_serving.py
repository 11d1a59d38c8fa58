#!/usr/bin/env python3
"""p99 TTFT vs request rate from sparsex-loadgen summaries, one line per (workload, mode).

    plot_serving.py rag_on.json rag_off.json chat_on.json ... -o serving.png

Each input is a JSON summary object or an array of them (sparsex-loadgen --out, --sweep). The
x axis is `rate` (open loop) or, for closed-loop summaries (rate null), `concurrency`. With
matplotlib the figure is a PNG (or whatever -o's extension names); without it an SVG is written
by hand (the -o name with .svg). --metric plots another field (e.g. ttft_p50_ms, tpot_p99_ms,
e2e_p99_ms, throughput_rps). Summaries with goodput_ok false are drawn hollow.
"""
import argparse
import json
import math
import os
import sys


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        rows.extend(data if isinstance(data, list) else [data])
    return rows


def series(rows, metric):
    """{(workload, mode): [(x, y, ok)]} sorted by x; x label."""
    out, closed = {}, False
    for r in rows:
        x = r.get("rate")
        if x is None:
            x = r.get("concurrency")
            closed = True
        y = r.get(metric)
        if x is None or y is None:
            continue
        key = (r.get("workload", "?"), r.get("mode", "?"))
        out.setdefault(key, []).append((float(x), float(y), bool(r.get("goodput_ok", True))))
    for v in out.values():
        v.sort()
    return out, ("concurrency (clients)" if closed else "request rate (req/s)")


def slo_of(rows, metric):
    if metric.startswith("ttft"):
        vals = {r.get("slo_ttft_ms") for r in rows if r.get("slo_ttft_ms") is not None}
    elif metric.startswith("tpot"):
        vals = {r.get("slo_tpot_ms") for r in rows if r.get("slo_tpot_ms") is not None}
    else:
        return None
    return vals.pop() if len(vals) == 1 else None


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def plot_matplotlib(data, xlabel, metric, slo, out, title, logy):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ((workload, mode), pts) in enumerate(sorted(data.items())):
        c = COLORS[i % len(COLORS)]
        style = "-" if mode != "reuse_off" else "--"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=c,
                label=f"{workload} / {mode}")
        for x, y, ok in pts:
            ax.plot([x], [y], "o", color=c, markerfacecolor=c if ok else "white")
    if slo is not None:
        ax.axhline(slo, color="gray", linestyle=":", label=f"SLO {slo:g} ms")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(metric)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def nice_ticks(lo, hi, n=5):
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + 1e-9 * step:
        ticks.append(round(t, 10))
        t += step
    return ticks


def plot_svg(data, xlabel, metric, slo, out, title, logy):
    W, H, L, R, T, B = 760, 470, 70, 200, 40, 55
    pw, ph = W - L - R, H - T - B
    xs = [p[0] for pts in data.values() for p in pts]
    ys = [p[1] for pts in data.values() for p in pts] + ([slo] if slo is not None else [])
    logy = logy and min(ys) > 0
    fy = (lambda v: math.log10(v)) if logy else (lambda v: v)
    xt = nice_ticks(0, max(xs))
    if logy:
        ylo, yhi = math.floor(fy(min(ys))), math.ceil(fy(max(ys)))
        yhi = max(yhi, ylo + 1)
        yt = list(range(ylo, yhi + 1))
    else:
        yt = nice_ticks(0, max(ys) * 1.05)
        ylo, yhi = yt[0], yt[-1]
    x0, x1 = xt[0], xt[-1]
    sx = lambda v: L + (v - x0) / (x1 - x0) * pw
    sy = lambda v: T + ph - (fy(v) - ylo) / (yhi - ylo) * ph
    e = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         f'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{L + pw / 2}" y="22" text-anchor="middle" font-size="14">{esc(title)}</text>']
    for t in xt:
        e.append(f'<line x1="{sx(t):.1f}" y1="{T}" x2="{sx(t):.1f}" y2="{T + ph}" stroke="#eee"/>')
        e.append(f'<text x="{sx(t):.1f}" y="{T + ph + 18}" text-anchor="middle">{t:g}</text>')
    for t in yt:
        v = 10 ** t if logy else t
        y = T + ph - (t - ylo) / (yhi - ylo) * ph
        e.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="#eee"/>')
        e.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    e.append(f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    e.append(f'<text x="{L + pw / 2}" y="{H - 12}" text-anchor="middle">{esc(xlabel)}</text>')
    e.append(f'<text x="16" y="{T + ph / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {T + ph / 2})">{esc(metric)}'
             f'{" (log)" if logy else ""}</text>')
    legend_y = T + 10
    if slo is not None:
        y = sy(slo)
        e.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="gray" '
                 f'stroke-dasharray="2,3"/>')
    for i, ((workload, mode), pts) in enumerate(sorted(data.items())):
        c = COLORS[i % len(COLORS)]
        dash = ' stroke-dasharray="6,4"' if mode == "reuse_off" else ""
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in pts)
        e.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for x, y, ok in pts:
            e.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" stroke="{c}" '
                     f'fill="{c if ok else "white"}"/>')
        ly = legend_y + 18 * i
        e.append(f'<line x1="{L + pw + 12}" y1="{ly}" x2="{L + pw + 36}" y2="{ly}" stroke="{c}" '
                 f'stroke-width="2"{dash}/>')
        e.append(f'<text x="{L + pw + 42}" y="{ly + 4}">{esc(workload)} / {esc(mode)}</text>')
    if slo is not None:
        ly = legend_y + 18 * len(data)
        e.append(f'<line x1="{L + pw + 12}" y1="{ly}" x2="{L + pw + 36}" y2="{ly}" stroke="gray" '
                 f'stroke-dasharray="2,3"/>')
        e.append(f'<text x="{L + pw + 42}" y="{ly + 4}">SLO {slo:g} ms</text>')
    e.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(e) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="sparsex-loadgen --out files")
    ap.add_argument("-o", "--out", default="serving_ttft.png")
    ap.add_argument("--metric", default="ttft_p99_ms")
    ap.add_argument("--title", default=None)
    ap.add_argument("--logy", action="store_true", help="logarithmic y axis")
    ap.add_argument("--svg", action="store_true",
                    help="write the hand-made SVG even with matplotlib")
    args = ap.parse_args()
    rows = load(args.inputs)
    data, xlabel = series(rows, args.metric)
    if not data:
        sys.exit(f"plot_serving.py: no summaries with {args.metric} in {', '.join(args.inputs)}")
    slo = slo_of(rows, args.metric)
    title = args.title or f"{args.metric} vs load"
    out = args.out
    try:
        if args.svg:
            raise ImportError
        import matplotlib  # noqa: F401
        plot_matplotlib(data, xlabel, args.metric, slo, out, title, args.logy)
    except ImportError:
        out = os.path.splitext(out)[0] + ".svg"
        plot_svg(data, xlabel, args.metric, slo, out, title, args.logy)
    print(f"wrote {out} ({len(data)} lines)")


if __name__ == "__main__":
    main()
