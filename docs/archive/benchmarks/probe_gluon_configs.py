"""Gluon kernel configurations side by side, in alternating passes (H200 probe).

``bench_kernel.py --gluon`` times each configuration once per shape; differences of 1-2 %
need more: here every shape times all ``--configs`` in turn, ``--passes`` times, and keeps
each pass (median reported), with the error against the fp32 reference per configuration.

    python benchmarks/probe_gluon_configs.py --configs "64,64,2,6,128;64,64,2,6,256" \
        --out benchmarks/results/gluon_configs.json

``--baseline FILE`` (an earlier ``mla_gluon.py``, e.g. ``git show HEAD~1:<path> > FILE``)
adds the ``--baseline-configs`` compiled from that source, tagged ``base``, to the same
alternating passes: old and new kernel source side by side in one run. Several files
(comma-separated, e.g. the variants of ``make_gluon_ablations.py``) are tagged by file name.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_kernel import check, counts, make_case, time_triton  # noqa: E402
from common import floor_ms, probe_parser, probe_shapes  # noqa: E402

from dcp_pass.runtime.decode.kernels import mla_gluon as G  # noqa: E402
from dcp_pass.runtime.decode.kernels.common import Causal  # noqa: E402


def call_extras(kind, B, T, device):
    """The mask / causal operands of a decode step (``--call``): "mask" hides the last 7
    positions of every request with a [B, 1, 1, T] row (static-position decode), "causal"
    caps the keys at each request's query position T - 8 (int-position decode); "plain": none."""
    if kind == "mask":
        mask = torch.zeros(B, 1, 1, T, device=device)
        mask[..., T - 7:] = float("-inf")
        return dict(mask=mask)
    if kind == "causal":
        return dict(causal=Causal(torch.full((B, 1), T - 8, device=device, dtype=torch.int64), 1, 0))
    return {}


def load_kernel(path, suffix="baseline"):
    """The kernel entry point of another copy of mla_gluon.py, loaded as a sibling module (so
    its relative imports resolve); every other part of the call stays this checkout's."""
    name = f"dcp_pass.runtime.decode.kernels._{suffix}_mla_gluon"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "dcp_pass.runtime.decode.kernels"
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod._mla_gluon_jit


@contextlib.contextmanager
def kernel_swapped(jit, merge=True):
    """Run launch_gluon with `jit` as its kernel (None: this checkout's); ``merge=False`` also
    drops the stage-2 merge launch (an ablation: only the kernel itself runs)."""
    own, own_launch = G._mla_gluon_jit, G.launch
    if not merge:
        G.launch = lambda kernel, *args: own_launch(kernel, *args) if kernel is G._mla_gluon_jit else None
    G._mla_gluon_jit = jit or own
    try:
        yield
    finally:
        G._mla_gluon_jit, G.launch = own, own_launch


def main():
    ap = probe_parser("benchmarks/results/gluon_configs.json",
                      "64x8x32768,64x8x131072,64x32x32768,128x8x32768,128x32x131072", 3)
    ap.add_argument("--configs", default="64,64,2,6,128;64,64,2,6,256")
    ap.add_argument("--baseline", default=None, help="another mla_gluon.py to time beside this one")
    ap.add_argument("--baseline-configs", default="64,64,2,6,128")
    ap.add_argument("--call", choices=("plain", "mask", "causal"), default="plain")
    ap.add_argument("--skip-merge", action="store_true",
                    help="ablation: also time every variant without its stage-2 merge (tagged 'no merge'; "
                         "the output is then never written, so its 'rel err' is not of that call)")
    a = ap.parse_args()
    # (tag, config, kernel, merge): kernel None is this checkout's; merge False skips stage 2
    variants = [(c.tag(), c, None, True) for c in (G.GluonConfig.parse(x) for x in a.configs.split(";"))]
    files = a.baseline.split(",") if a.baseline else []
    for path in files:
        stem = "base" if len(files) == 1 else os.path.splitext(os.path.basename(path))[0]
        base = load_kernel(path, "".join(ch if ch.isalnum() else "_" for ch in stem))
        variants += [(f"{stem} {c.tag()}", c, base, True)
                     for c in (G.GluonConfig.parse(x) for x in a.baseline_configs.split(";"))]

    if a.skip_merge:
        variants += [(tag + " no merge", c, jit, False) for tag, c, jit, _ in variants]

    def one_shape(H, B, T, ceil):
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        extras = call_extras(a.call, B, T, sets[0][0].device)
        errs, times = {}, {tag: [] for tag, *_ in variants}
        for tag, c, jit, merge in variants:
            with kernel_swapped(jit, merge):
                errs[tag] = check(sets, "gluon", c, extras)
        for _ in range(a.passes):
            for tag, c, jit, merge in variants:
                with kernel_swapped(jit, merge):
                    times[tag].append(time_triton(sets, c, path="gluon", extras=extras))
        for tag, *_ in variants:
            ms = statistics.median(times[tag])
            yield dict(H=H, B=B, T=T, call=a.call, config=tag, ms=ms, passes=times[tag], of_floor=floor / ms,
                       mm_frac=flops / (ms * 1e-3) / ceil["mm_rate"], rel_err=errs[tag][0], lse_err=errs[tag][1])

    probe_shapes(a.out, a.shapes, one_shape, [("H", "H"), ("B", "B"), ("T", "T"), ("config", "config"), ("ms", "ms"),
                                              ("floor/ms", "of_floor"), ("mm frac", "mm_frac"),
                                              ("rel err", "rel_err")])


if __name__ == "__main__":
    main()
