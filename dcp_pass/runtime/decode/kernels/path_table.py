"""Measured attention paths per shape: which kernel is fastest where.

``MEASURED`` is generated: benchmarks/make_path_table.py rewrites it from the committed H200
timings it lists (one H200, bf16, 512 + 64 latent, one query token per row); do not edit
it by hand. Each row: (query rows per rank, batch, keys per rank, {path: milliseconds}).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

MEASURED = (
    (16, 8, 32768, {"split": 0.1997, "flashinfer": 0.238}),
    (16, 8, 131072, {"split": 0.4022, "flashinfer": 0.4662}),
    (64, 8, 4096, {"split": 0.0351, "wide": 0.0361, "gluon": 0.0287}),
    (64, 8, 32768, {"split": 0.1793, "wide": 0.1924, "gluon": 0.108}),
    (64, 8, 65536, {"split": 0.332, "wide": 0.3608, "gluon": 0.1966}),
    (64, 8, 131072, {"split": 0.652, "wide": 0.719, "gluon": 0.3954}),
    (64, 32, 4096, {"split": 0.102, "wide": 0.1101, "gluon": 0.0651}),
    (64, 32, 32768, {"split": 0.6406, "wide": 0.6978, "gluon": 0.3882}),
    (64, 32, 65536, {"split": 1.3679, "wide": 1.4143, "gluon": 0.7584}),
    (64, 32, 131072, {"split": 2.5158, "wide": 2.9638, "gluon": 1.6265}),
    (128, 8, 4096, {"split": 0.0507, "wide": 0.046, "gluon": 0.0359, "flashinfer": 0.2127}),
    (128, 8, 32768, {"split": 0.3055, "wide": 0.2375, "gluon": 0.1796, "flashinfer": 0.2865}),
    (128, 8, 65536, {"split": 0.5776, "wide": 0.47, "gluon": 0.3472}),
    (128, 8, 131072, {"split": 1.1398, "wide": 0.9632, "gluon": 0.698, "flashinfer": 0.7257}),
    (128, 32, 4096, {"split": 0.1665, "wide": 0.1349, "gluon": 0.1018}),
    (128, 32, 32768, {"split": 1.1471, "wide": 0.895, "gluon": 0.687}),
    (128, 32, 65536, {"split": 2.3797, "wide": 1.8884, "gluon": 1.3868}),
    (128, 32, 131072, {"split": 4.5787, "wide": 3.8111, "gluon": 2.8076}),
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
