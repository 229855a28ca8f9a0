"""The stage-2 split merge's tile shape, side by side inside the whole call (H200 probe).

``splits.reduce_launch`` gives each program [splits, BLOCK_DV] partials with BLOCK_DV =
4096 / splits (powers of two) on 4 warps. This probe times the attention call (Gluon at 64
and 128 heads, the split kernel at 16) with the merge's BLOCK_DV and warp count replaced,
alternating variants over ``--passes`` passes. Whether each variant's output equals the
default's bit for bit is recorded: the warp count can change the order of the sum over
splits, so a difference there is rounding, not an error.

    python benchmarks/probe_merge_configs.py --out benchmarks/results/merge_configs_probe_h200.json
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import counts, make_case, time_triton  # noqa: E402
from common import floor_ms, probe_parser, probe_shapes  # noqa: E402

from dcp_pass.runtime.decode.kernels import mla_attention as M  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_gluon as G  # noqa: E402
from dcp_pass.runtime.decode.kernels import splits as SP  # noqa: E402

# (columns per program relative to the default: x1/2, x1, x2; warps)
VARIANTS = [("default", None, None), ("dv/2 4w", 0.5, 4), ("dv/2 2w", 0.5, 2), ("dv 8w", 1, 8), ("dv*2 8w", 2, 8)]


def patched(scale, warps):
    real = SP.reduce_launch

    def reduce_launch(*args, **kwargs):
        kernel, grid, a, consts, w = real(*args, **kwargs)
        if scale is None:
            return kernel, grid, a, consts, w
        dv = max(16, int(consts["BLOCK_DV"] * scale))
        consts = dict(consts, BLOCK_DV=dv)
        return kernel, (grid[0], grid[1], -(-consts["D_V"] // dv)), a, consts, warps

    return reduce_launch


def with_merge(variant, fn):
    _, scale, warps = variant
    saved = G.reduce_launch, M.reduce_launch
    G.reduce_launch = M.reduce_launch = patched(scale, warps)
    try:
        return fn()
    finally:
        G.reduce_launch, M.reduce_launch = saved


def main():
    ap = probe_parser("benchmarks/results/merge_configs_probe.json",
                      "64x8x32768,128x8x32768,64x32x32768,16x1x131072,16x8x32768", 3)
    a = ap.parse_args()

    def one_shape(H, B, T, ceil):
        path = "gluon" if H >= 64 else "split"
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        call = lambda: M.mla_attention_triton(sets[0][0], None, sets[0][1], None, 512, 192 ** -0.5,  # noqa: E731
                                              path=path)
        ref = with_merge(VARIANTS[0], call)
        same = {}
        for v in VARIANTS:
            o = with_merge(v, call)
            same[v[0]] = bool(torch.equal(o[0], ref[0]) and torch.equal(o[1], ref[1]))
        times = {v[0]: [] for v in VARIANTS}
        for _ in range(a.passes):
            for v in VARIANTS:
                times[v[0]].append(with_merge(v, lambda: time_triton(sets, path=path)))
        base = min(times["default"])
        for v in VARIANTS:
            ms = min(times[v[0]])
            yield dict(H=H, B=B, T=T, path=path, merge=v[0], ms=ms, passes=times[v[0]], of_floor=floor / ms,
                       vs_default=base / ms, bitwise_equal=same[v[0]])

    probe_shapes(a.out, a.shapes, one_shape, [("H", "H"), ("B", "B"), ("T", "T"), ("path", "path"), ("merge", "merge"),
                                              ("ms", "ms"), ("floor/ms", "of_floor"), ("vs default", "vs_default"),
                                              ("bitwise equal", "bitwise_equal")])


if __name__ == "__main__":
    main()
