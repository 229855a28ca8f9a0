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
