"""Write dcp_pass/runtime/decode/kernels/path_table.py from measured kernel timings.

Sources (H200, committed under benchmarks/results/):
* kernel_v4_wide_h200.json   split vs wide Triton kernels, 64/128 heads, B 8/32, 64K/128K keys
* kernel_v9_gluon_h200.json   split vs wide vs the Gluon one-read kernel, 64/128 heads, B 8/32, 4K-128K keys
* flashinfer_probe_h200x2.json  FlashInfer's fa3 MLA kernel vs the Triton dispatcher, 16/128 heads
* masked_paths_int32_h200.json, masked_paths_16h_h200.json  what a decode step's mask row or a
  causal cap costs each path (benchmarks/probe_masked_paths.py), per query rows

    python benchmarks/make_path_table.py   # rewrites the MEASURED and CALL_COST blocks; commit them with the JSONs
"""
from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "dcp_pass", "runtime", "decode", "kernels", "path_table.py")
GLUON_RUN = "kernel_v9_gluon_h200.json"
GLUON_TAG = "gluon 64x64/8w/2s/v3"


def rows() -> list[tuple]:
    out: dict[tuple, dict] = {}
    wide = json.load(open(os.path.join(HERE, "results", "kernel_v4_wide_h200.json")))
    for r in wide["table"]:
        out.setdefault((r["H"], r["B"], r["T"]), {}).update(split=round(r["ms"], 4), wide=round(r["wide_ms"], 4))
    # split, wide and the Gluon one-read kernel timed side by side in one run (its default tile)
    gluon = json.load(open(os.path.join(HERE, "results", GLUON_RUN)))
    for r in gluon["table"]:
        g = r.get("gluon_all", {}).get(GLUON_TAG)
        timings = out.setdefault((r["H"], r["B"], r["T"]), {})
        timings.update(split=round(r["ms"], 4), wide=round(r["wide_ms"], 4))
        if g:
            timings["gluon"] = round(g["ms"], 4)
    probe = json.load(open(os.path.join(HERE, "results", "flashinfer_probe_h200x2.json")))
    for r in probe["stages"]["perf"]["rows"]:
        # the probe timed the Triton dispatcher ("auto"): wide from 128 rows, split below
        triton_path = "wide" if r["H"] >= 128 else "split"
        timings = out.setdefault((r["H"], r["B"], r["T"]), {})
        timings.setdefault(triton_path, round(r["triton_ms"], 4))
        timings["flashinfer"] = round(r["flashinfer_ms"], 4)
    return sorted((h, b, t, ms) for (h, b, t), ms in out.items())


MASKED_RUNS = ("masked_paths_int32_h200.json", "masked_paths_16h_h200.json")


def call_costs() -> list[tuple]:
    """(call, path, query rows, time over the plain call's), "mask" and "causal" calls: the
    median over the shapes measured at those rows."""
    ratios: dict[tuple, list] = {}
    for name in MASKED_RUNS:
        for r in json.load(open(os.path.join(HERE, "results", name)))["rows"]:
            if r["call"] != "plain":
                ratios.setdefault((r["call"], r["path"], r["H"]), []).append(r["vs_plain"])
    return sorted((call, path, h, round(sorted(v)[len(v) // 2], 3)) for (call, path, h), v in ratios.items())


def _replace_block(text: str, name: str, body: str) -> str:
    head, rest = text.split(f"{name} = (\n", 1)
    tail = ("\n" + rest).split("\n)\n", 1)[1]
    return f"{head}{name} = (\n{body}\n)\n{tail}"


def main():
    """Rewrite only the generated blocks of path_table.py; its docstring and `fastest` are hand-written."""
    table, costs = rows(), call_costs()
    with open(OUT) as f:
        text = f.read()
    measured = "\n".join(f"    ({h}, {b}, {t}, {json.dumps(ms)})," for h, b, t, ms in table)
    text = _replace_block(text, "MEASURED", measured)
    text = _replace_block(text, "CALL_COST", "\n".join(f"    {c!r}," for c in costs))
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}: {len(table)} shapes, {len(costs)} call costs")


if __name__ == "__main__":
    main()
