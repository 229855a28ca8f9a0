"""Plot step time vs context for DCP=1 and DCP=c from a bench_layer.py result file.

    python benchmarks/plot_layer.py results.json out.png [--mode graph_ms]
"""
from __future__ import annotations

import json
import sys


def main():
    src, dst = sys.argv[1], sys.argv[2]
    mode = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--mode" else "graph_ms"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in json.load(open(src))["rows"] if r.get(mode)]
    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    styles = {"none": "-o", "a2a_rq": "-s", "a2a_gq": "--^", "ag_rs": ":v"}
    for ax, B in zip(axes[0], batches):
        series = sorted({(r["c"], r["comm"]) for r in rows if r["B"] == B})
        for c, comm in series:
            pts = sorted((r["L"], r[mode]) for r in rows if r["B"] == B and r["c"] == c and r["comm"] == comm)
            label = f"DCP={c}" + ("" if comm == "none" else f" {comm}")
            ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], styles.get(comm, "-"), label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel(f"step time ({mode.replace('_ms', '')}, ms)")
        ax.set_title(f"one MLA layer decode, B={B}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()
