"""Gluon kernel configurations side by side, in alternating passes (H200 probe).

``bench_kernel.py --gluon`` times each configuration once per shape; differences of 1-2 %
need more: here every shape times all ``--configs`` in turn, ``--passes`` times, and keeps
each pass (median reported), with the error against the fp32 reference per configuration.

    python benchmarks/probe_gluon_configs.py --configs "64,64,2,6,128;64,64,2,6,256" \
        --out benchmarks/results/gluon_configs.json
"""
from __future__ import annotations

import os
import statistics
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import check, counts, make_case, time_triton  # noqa: E402
from common import floor_ms, probe_parser, probe_shapes  # noqa: E402

from dcp_pass.runtime.decode.kernels import mla_gluon as G  # noqa: E402


def main():
    ap = probe_parser("benchmarks/results/gluon_configs.json",
                      "64x8x32768,64x8x131072,64x32x32768,128x8x32768,128x32x131072", 3)
    ap.add_argument("--configs", default="64,64,2,6,128;64,64,2,6,256")
    a = ap.parse_args()
    configs = [G.GluonConfig.parse(c) for c in a.configs.split(";")]

    def one_shape(H, B, T, ceil):
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        errs = {c.tag(): check(sets, "gluon", c) for c in configs}
        times = {c.tag(): [] for c in configs}
        for _ in range(a.passes):
            for c in configs:
                times[c.tag()].append(time_triton(sets, c, path="gluon"))
        for c in configs:
            ms = statistics.median(times[c.tag()])
            yield dict(H=H, B=B, T=T, config=c.tag(), ms=ms, passes=times[c.tag()], of_floor=floor / ms,
                       mm_frac=flops / (ms * 1e-3) / ceil["mm_rate"], rel_err=errs[c.tag()][0],
                       lse_err=errs[c.tag()][1])

    probe_shapes(a.out, a.shapes, one_shape, [("H", "H"), ("B", "B"), ("T", "T"), ("config", "config"), ("ms", "ms"),
                                              ("floor/ms", "of_floor"), ("mm frac", "mm_frac"),
                                              ("rel err", "rel_err")])


if __name__ == "__main__":
    main()
