"""Write dcp_pass/runtime/decode/kernels/path_table.py from measured kernel timings (issue #14 item 3).

Sources (H200, committed under benchmarks/results/):
* kernel_v4_wide_h200.json   split vs wide Triton kernels, 64/128 heads, B 8/32, 64K/128K keys
* kernel_v9_gluon_h200.json   split vs wide vs the Gluon one-read kernel, 64/128 heads, B 8/32, 4K-128K keys
* flashinfer_probe_h200x2.json  FlashInfer's fa3 MLA kernel vs the Triton dispatcher, 16/128 heads

    python benchmarks/make_path_table.py   # rewrites the module; commit it with the JSONs
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


def main():
    body = "\n".join(f"    ({h}, {b}, {t}, {json.dumps(ms)})," for h, b, t, ms in rows())
    text = f'''"""Measured attention paths per shape: which kernel is fastest where (generated; do not edit).

Written by benchmarks/make_path_table.py from benchmarks/results/kernel_v4_wide_h200.json,
kernel_v9_gluon_h200.json and flashinfer_probe_h200x2.json (one H200, bf16, 512 + 64
latent, one query token per row). Each row: (query rows per rank, batch, keys per rank,
{{path: milliseconds}}).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

MEASURED = (
{body}
)


@functools.lru_cache(maxsize=1024)
def fastest(rows: int, batch: int, keys: int, candidates: tuple) -> Optional[str]:
    """The fastest of `candidates` at the measured shape nearest to (rows, batch, keys).

    Nearest in log2 space, rows weighted most (they decide compute- vs memory-bound), among
    measured shapes that timed at least two of the candidates; None when there is none.
    """
    best, best_d = None, math.inf
    for h, b, t, ms in MEASURED:
        timed = {{p: v for p, v in ms.items() if p in candidates}}
        if len(timed) < 2:
            continue
        d = (4 * abs(math.log2(max(rows, 1) / h)) + abs(math.log2(max(batch, 1) / b))
             + abs(math.log2(max(keys, 1) / t)))
        if d < best_d:
            best, best_d = min(timed, key=timed.get), d
    return best
'''
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}: {len(rows())} shapes")


if __name__ == "__main__":
    main()
