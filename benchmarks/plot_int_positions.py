"""Table and plot of the reference-style (int start_pos) model: backend='dcp' vs plain torch.compile.

Reads bench_model.py result files (several runs of one grid), recomputes for every DCP=2
row `speedup_vs_plain` against the best plain run at its context and batch (DCP=1 leaves
every graph unchanged, so it IS plain torch.compile; its best mode and its faster end_pos
parity), and writes a markdown table and a PNG.

    python benchmarks/plot_int_positions.py out.png out.md results/model_int_*.json
"""
from __future__ import annotations

import json
import sys


def load_rows(paths):
    rows = []
    for path in paths:
        data = json.load(open(path))
        for r in data["rows"]:
            if "step_ms_median" in r and r.get("positions", "int") == "int":
                if r.get("step_ms_ranks"):  # a step ends when its slowest rank ends
                    r["step_ms_median"] = max(r["step_ms_ranks"])
                rows.append(r)
    return rows


def plain_best(rows, ctx, batch):
    """Fastest plain torch.compile step at (ctx, batch): any mode, the faster parity."""
    times = [min(t for t in (r.get("step_ms_even"), r.get("step_ms_odd"), r["step_ms_median"]) if t)
             for r in rows if r["c"] == 1 and r["ctx"] == ctx and r["batch"] == batch]
    return min(times) if times else None


def table(rows):
    lines = ["| ctx | B | plain default ms (even / odd) | plain reduce-overhead ms (even / odd) | "
             "DCP=2 default ms | DCP=2 CUDA graphs ms | speedup_vs_plain (graphs) |",
             "|---|---|---|---|---|---|---|"]
    out = []
    for ctx, batch in sorted({(r["ctx"], r["batch"]) for r in rows}):
        def find(c, mode):
            return next((r for r in rows if (r["ctx"], r["batch"], r["c"], r["mode"]) == (ctx, batch, c, mode)), None)

        def pair(r):
            return f"{r['step_ms_even']:.2f} / {r['step_ms_odd']:.2f}" if r else "-"

        best = plain_best(rows, ctx, batch)
        d2g, d2d = find(2, "reduce-overhead"), find(2, "default")
        speed = best / d2g["step_ms_median"] if best and d2g else None
        out.append(dict(ctx=ctx, batch=batch, plain_best_ms=best,
                        dcp2_graph_ms=d2g and d2g["step_ms_median"], speedup_vs_plain=speed))
        d2d_ms = f"{d2d['step_ms_median']:.2f}" if d2d else "-"
        d2g_ms = f"{d2g['step_ms_median']:.2f}" if d2g else "-"
        lines.append(f"| {ctx // 1024}K | {batch} | {pair(find(1, 'default'))} | {pair(find(1, 'reduce-overhead'))} | "
                     f"{d2d_ms} | {d2g_ms} | {f'{speed:.2f}x' if speed else '-'} |")
    return "\n".join(lines), out


def plot(summary, dst):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({s["batch"] for s in summary})
    fig, ax = plt.subplots(figsize=(6, 4))
    for batch in batches:
        pts = sorted((s["ctx"], s["speedup_vs_plain"]) for s in summary if s["batch"] == batch and s["speedup_vs_plain"])
        ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], "-o", label=f"B={batch}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context per request (K tokens)")
    ax.set_ylabel("speedup vs best plain torch.compile")
    ax.set_title("int start_pos model, DCP=2 + CUDA graphs, 2 x H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main():
    png, md, *paths = sys.argv[1:]
    rows = load_rows(paths)
    text, summary = table(rows)
    with open(md, "w") as f:
        f.write(text + "\n")
    plot(summary, png)
    print(text)


if __name__ == "__main__":
    main()
