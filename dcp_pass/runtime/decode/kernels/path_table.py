"""Measured attention paths per shape: which kernel is fastest where (generated; do not edit).

Written by benchmarks/make_path_table.py from benchmarks/results/kernel_v4_wide_h200.json,
kernel_v8_gluon_h200.json and flashinfer_probe_h200x2.json (one H200, bf16, 512 + 64
latent, one query token per row). Each row: (query rows per rank, batch, keys per rank,
{path: milliseconds}).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

MEASURED = (
    (16, 8, 32768, {"split": 0.1997, "flashinfer": 0.238}),
    (16, 8, 131072, {"split": 0.4022, "flashinfer": 0.4662}),
    (64, 8, 32768, {"split": 0.179, "wide": 0.193, "gluon": 0.1075}),
    (64, 8, 65536, {"split": 0.3333, "wide": 0.3525}),
    (64, 8, 131072, {"split": 0.6396, "wide": 0.6946, "gluon": 0.3851}),
    (64, 32, 32768, {"split": 0.6377, "wide": 0.6901, "gluon": 0.3818}),
    (64, 32, 65536, {"split": 1.264, "wide": 1.3211}),
    (64, 32, 131072, {"split": 2.5012, "wide": 2.7209, "gluon": 1.5313}),
    (128, 8, 4096, {"wide": 0.2563, "flashinfer": 0.2127}),
    (128, 8, 32768, {"split": 0.3051, "wide": 0.2346, "gluon": 0.1784, "flashinfer": 0.2865}),
    (128, 8, 65536, {"split": 0.583, "wide": 0.4395}),
    (128, 8, 131072, {"split": 1.13, "wide": 0.894, "gluon": 0.6828, "flashinfer": 0.7257}),
    (128, 32, 32768, {"split": 1.1447, "wide": 0.8795, "gluon": 0.6702}),
    (128, 32, 65536, {"split": 2.285, "wide": 1.7062}),
    (128, 32, 131072, {"split": 4.5382, "wide": 3.5289, "gluon": 2.7296}),
)


@functools.lru_cache(maxsize=1024)
def fastest(rows: int, batch: int, keys: int, candidates: tuple) -> Optional[str]:
    """The fastest of `candidates` at the measured shape nearest to (rows, batch, keys).

    Nearest in log2 space, rows weighted most (they decide compute- vs memory-bound), among
    measured shapes that timed at least two of the candidates; None when there is none.
    """
    best, best_d = None, math.inf
    for h, b, t, ms in MEASURED:
        timed = {p: v for p, v in ms.items() if p in candidates}
        if len(timed) < 2:
            continue
        d = (4 * abs(math.log2(max(rows, 1) / h)) + abs(math.log2(max(batch, 1) / b))
             + abs(math.log2(max(keys, 1) / t)))
        if d < best_d:
            best, best_d = min(timed, key=timed.get), d
    return best
