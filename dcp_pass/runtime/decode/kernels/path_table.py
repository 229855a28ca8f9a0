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
    (16, 8, 4096, {"split": 0.0256, "wide": 0.0287, "gluon": 0.0212, "seesaw": 0.0235, "flashinfer": 0.2153}),
    (
        16,
        8,
        32768,
        {
            "split": 0.0941,
            "wide": 0.1687,
            "gluon": 0.0917,
            "seesaw": 0.0999,
            "flashinfer": 0.2871,
            "split_fp8": 0.1295,
            "wide_fp8": 0.1982,
            "gluon_fp8": 0.1052,
            "gluon_fp8_narrow": 0.0706,
        },
    ),
    (
        16,
        8,
        131072,
        {
            "split": 0.2979,
            "wide": 0.5975,
            "gluon": 0.3077,
            "seesaw": 0.3243,
            "flashinfer": 0.5105,
            "split_fp8": 0.4403,
            "wide_fp8": 0.7132,
            "gluon_fp8": 0.3561,
            "gluon_fp8_narrow": 0.1969,
        },
    ),
    (16, 32, 4096, {"split": 0.0582, "wide": 0.0964, "gluon": 0.0561, "seesaw": 0.0609, "flashinfer": 0.2506}),
    (
        16,
        32,
        32768,
        {
            "split": 0.2957,
            "wide": 0.5969,
            "gluon": 0.3113,
            "seesaw": 0.3227,
            "flashinfer": 0.495,
            "split_fp8": 0.4379,
            "wide_fp8": 0.7066,
            "gluon_fp8": 0.3548,
            "gluon_fp8_narrow": 0.1969,
        },
    ),
    (
        16,
        32,
        131072,
        {
            "split": 1.1359,
            "wide": 2.3238,
            "gluon": 1.2945,
            "seesaw": 1.4037,
            "flashinfer": 1.5255,
            "split_fp8": 1.6961,
            "wide_fp8": 2.7467,
            "gluon_fp8": 1.3715,
            "gluon_fp8_narrow": 0.81,
        },
    ),
    (64, 8, 4096, {"split": 0.0353, "wide": 0.036, "gluon": 0.0269, "seesaw": 0.029, "flashinfer": 0.2188}),
    (
        64,
        8,
        32768,
        {
            "split": 0.1807,
            "wide": 0.1939,
            "gluon": 0.0967,
            "seesaw": 0.1046,
            "flashinfer": 0.2898,
            "split_fp8": 0.6273,
            "wide_fp8": 0.3037,
            "gluon_fp8": 0.1114,
        },
    ),
    (
        64,
        8,
        131072,
        {
            "split": 0.6501,
            "wide": 0.6989,
            "gluon": 0.3325,
            "seesaw": 0.3441,
            "flashinfer": 0.5343,
            "split_fp8": 2.4505,
            "wide_fp8": 1.1373,
            "gluon_fp8": 0.361,
        },
    ),
    (64, 32, 4096, {"split": 0.1024, "wide": 0.1101, "gluon": 0.0605, "seesaw": 0.0651, "flashinfer": 0.257}),
    (
        64,
        32,
        32768,
        {
            "split": 0.6492,
            "wide": 0.7009,
            "gluon": 0.3325,
            "seesaw": 0.3369,
            "flashinfer": 0.516,
            "split_fp8": 2.4516,
            "wide_fp8": 1.1228,
            "gluon_fp8": 0.3805,
        },
    ),
    (
        64,
        32,
        131072,
        {
            "split": 2.5532,
            "wide": 2.7571,
            "gluon": 1.3908,
            "seesaw": 1.5901,
            "flashinfer": 1.5878,
            "split_fp8": 9.7617,
            "wide_fp8": 4.4186,
            "gluon_fp8": 1.5298,
        },
    ),
    (128, 8, 4096, {"split": 0.0505, "wide": 0.0462, "gluon": 0.0312, "seesaw": 0.0328, "flashinfer": 0.2241}),
    (
        128,
        8,
        32768,
        {
            "split": 0.3076,
            "wide": 0.2367,
            "gluon": 0.1524,
            "seesaw": 0.1488,
            "flashinfer": 0.334,
            "split_fp8": 1.2307,
            "wide_fp8": 0.3683,
            "gluon_fp8": 0.1868,
        },
    ),
    (
        128,
        8,
        131072,
        {
            "split": 1.1386,
            "wide": 0.8987,
            "gluon": 0.6016,
            "seesaw": 0.5728,
            "flashinfer": 0.8108,
            "split_fp8": 4.8606,
            "wide_fp8": 1.3965,
            "gluon_fp8": 0.7181,
        },
    ),
    (128, 32, 4096, {"split": 0.1654, "wide": 0.1351, "gluon": 0.0852, "seesaw": 0.0852, "flashinfer": 0.2785}),
    (
        128,
        32,
        32768,
        {
            "split": 1.1667,
            "wide": 0.8958,
            "gluon": 0.6079,
            "seesaw": 0.5695,
            "flashinfer": 0.786,
            "split_fp8": 4.9528,
            "wide_fp8": 1.3885,
            "gluon_fp8": 0.7067,
        },
    ),
    (
        128,
        32,
        131072,
        {
            "split": 4.5872,
            "wide": 3.6336,
            "gluon": 2.5695,
            "seesaw": 2.3566,
            "flashinfer": 2.6328,
            "split_fp8": 19.8415,
            "wide_fp8": 5.4577,
            "gluon_fp8": 2.8848,
        },
    ),
)


CALL_COST = (
    ("causal", "gluon", 64, 1.046),
    ("causal", "gluon", 128, 1.001),
    ("causal", "gluon_fp8", 16, 1.01),
    ("causal", "gluon_fp8", 64, 1.011),
    ("causal", "gluon_fp8", 128, 1.005),
    ("causal", "gluon_fp8_narrow", 16, 1.01),
    ("causal", "seesaw", 64, 1.046),
    ("causal", "seesaw", 128, 1.024),
    ("causal", "split", 16, 1.022),
    ("causal", "split", 64, 1.271),
    ("causal", "split", 128, 1.283),
    ("causal", "split_fp8", 16, 0.983),
    ("causal", "split_fp8", 64, 1.068),
    ("causal", "split_fp8", 128, 1.081),
    ("causal", "wide", 64, 0.999),
    ("causal", "wide", 128, 1.02),
    ("causal", "wide_fp8", 16, 0.975),
    ("causal", "wide_fp8", 64, 1.01),
    ("causal", "wide_fp8", 128, 1.003),
    ("mask", "gluon", 64, 1.0),
    ("mask", "gluon", 128, 0.981),
    ("mask", "gluon_fp8", 16, 0.993),
    ("mask", "gluon_fp8", 64, 1.004),
    ("mask", "gluon_fp8", 128, 1.01),
    ("mask", "gluon_fp8_narrow", 16, 1.026),
    ("mask", "seesaw", 64, 0.994),
    ("mask", "seesaw", 128, 1.004),
    ("mask", "split", 16, 1.041),
    ("mask", "split", 64, 0.995),
    ("mask", "split", 128, 1.007),
    ("mask", "split_fp8", 16, 1.016),
    ("mask", "split_fp8", 64, 1.021),
    ("mask", "split_fp8", 128, 1.051),
    ("mask", "wide", 64, 1.022),
    ("mask", "wide", 128, 1.033),
    ("mask", "wide_fp8", 16, 0.999),
    ("mask", "wide_fp8", 64, 1.001),
    ("mask", "wide_fp8", 128, 1.018),
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
        d = 4 * abs(math.log2(max(rows, 1) / h)) + abs(math.log2(max(batch, 1) / b)) + abs(math.log2(max(keys, 1) / t))
        if d < best_d:
            best, best_d = min(timed, key=timed.get), d
    return best
