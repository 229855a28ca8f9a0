"""Measured attention paths per shape: which kernel is fastest where.

``MEASURED`` and ``CALL_COST`` are generated: benchmarks/make_path_table.py rewrites them
from the committed H200 timings it lists (one H200, bf16, 512 + 64 latent, one query token
per row); do not edit them by hand. ``MEASURED``: (query rows per rank, batch, keys per
rank, {path: milliseconds}) of plain calls. ``CALL_COST``: (call, path, query rows, time
over the plain call's) for a decode step's mask row ("mask") and a causal cap ("causal"),
which cost the paths differently (the split kernel's 64-row tile 1.27x with a causal cap,
the two-GEMM kernel 1.00x), so the fastest path of a causal call can be another one.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

MEASURED = (
    (16, 8, 4096, {"split": 0.0256, "wide": 0.0283, "gluon": 0.0211, "flashinfer": 0.2151}),
    (16, 8, 32768, {"split": 0.0943, "wide": 0.1688, "gluon": 0.0909, "flashinfer": 0.2864}),
    (16, 8, 131072, {"split": 0.2987, "wide": 0.5982, "gluon": 0.3058, "flashinfer": 0.4954}),
    (16, 32, 4096, {"split": 0.0587, "wide": 0.0967, "gluon": 0.0557, "flashinfer": 0.2505}),
    (16, 32, 32768, {"split": 0.2972, "wide": 0.5981, "gluon": 0.305, "flashinfer": 0.4938}),
    (16, 32, 131072, {"split": 1.1524, "wide": 2.3338, "gluon": 1.244, "flashinfer": 1.5276}),
    (64, 8, 4096, {"split": 0.0355, "wide": 0.036, "gluon": 0.0273, "flashinfer": 0.2185}),
    (64, 8, 32768, {"split": 0.1794, "wide": 0.1928, "gluon": 0.096, "flashinfer": 0.2896}),
    (64, 8, 131072, {"split": 0.6537, "wide": 0.6918, "gluon": 0.3356, "flashinfer": 0.5223}),
    (64, 32, 4096, {"split": 0.1027, "wide": 0.1103, "gluon": 0.0612, "flashinfer": 0.2567}),
    (64, 32, 32768, {"split": 0.6462, "wide": 0.697, "gluon": 0.3028, "flashinfer": 0.515}),
    (64, 32, 131072, {"split": 2.5363, "wide": 2.8076, "gluon": 1.3622, "flashinfer": 1.6046}),
    (128, 8, 4096, {"split": 0.0515, "wide": 0.0458, "gluon": 0.0311, "flashinfer": 0.2243}),
    (128, 8, 32768, {"split": 0.3105, "wide": 0.2336, "gluon": 0.1504, "flashinfer": 0.3332}),
    (128, 8, 131072, {"split": 1.1406, "wide": 0.8684, "gluon": 0.587, "flashinfer": 0.7761}),
    (128, 32, 4096, {"split": 0.168, "wide": 0.134, "gluon": 0.0844, "flashinfer": 0.2787}),
    (128, 32, 32768, {"split": 1.1665, "wide": 0.8746, "gluon": 0.597, "flashinfer": 0.7611}),
    (128, 32, 131072, {"split": 4.5601, "wide": 3.5012, "gluon": 2.5959, "flashinfer": 2.5003}),
)


CALL_COST = (
    ('causal', 'gluon', 64, 1.027),
    ('causal', 'gluon', 128, 1.024),
    ('causal', 'split', 16, 1.022),
    ('causal', 'split', 64, 1.271),
    ('causal', 'split', 128, 1.283),
    ('causal', 'wide', 64, 0.999),
    ('causal', 'wide', 128, 1.02),
    ('mask', 'gluon', 64, 1.033),
    ('mask', 'gluon', 128, 1.021),
    ('mask', 'split', 16, 1.041),
    ('mask', 'split', 64, 0.995),
    ('mask', 'split', 128, 1.007),
    ('mask', 'wide', 64, 1.022),
    ('mask', 'wide', 128, 1.033),
)

CALLS = ("plain", "mask", "causal")


def call_kind(mask, causal) -> str:
    """The CALL_COST kind of a call: a causal cap outweighs a mask row (it costs more)."""
    return "causal" if causal is not None else "mask" if mask is not None else "plain"


def call_cost(call: str, path: str, rows: int) -> float:
    """Time of a `call` over the plain call's for `path`, at the measured rows nearest in log2
    (1.0 for plain calls and for paths without a measurement of that call)."""
    measured = [(abs(math.log2(max(rows, 1) / h)), f) for c, p, h, f in CALL_COST if c == call and p == path]
    return min(measured)[1] if measured else 1.0


@functools.lru_cache(maxsize=1024)
def fastest(rows: int, batch: int, keys: int, candidates: tuple, call: str = "plain") -> Optional[str]:
    """The fastest of `candidates` for a `call` ("plain", "mask", "causal") at the measured
    shape nearest to (rows, batch, keys): its plain timings times each path's call_cost.

    Nearest in log2 space, rows weighted most (they decide compute- vs memory-bound), among
    measured shapes that timed at least two of the candidates; None when there is none.
    """
    if call not in CALLS:
        raise ValueError(f"call must be one of {CALLS}, got {call!r}")
    cost = {p: call_cost(call, p, rows) for p in candidates}  # depends on the query's rows only
    best, best_d = None, math.inf
    for h, b, t, ms in MEASURED:
        timed = {p: v * cost[p] for p, v in ms.items() if p in candidates}
        if len(timed) < 2:
            continue
        d = (4 * abs(math.log2(max(rows, 1) / h)) + abs(math.log2(max(batch, 1) / b))
             + abs(math.log2(max(keys, 1) / t)))
        if d < best_d:
            best, best_d = min(timed, key=timed.get), d
    return best
