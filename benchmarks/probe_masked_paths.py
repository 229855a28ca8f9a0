"""What a decode step's mask row or causal cap costs on each attention path (H200 probe).

For every shape and path (a registry kernel's name, or "gluon": the default Gluon config's
kernel), the same inputs are timed plain, with a [B, 1, 1, T] mask row (hiding the last 7
keys, as static-position decode does), with a causal cap (int-position decode) and with both,
in alternating passes; the error of each against the fp32 reference with the same operands.
A path that cannot take a shape (wide below 64 rows, gluon off Hopper) is left out.
``--cache fp8_e4m3``: the same over packed fp8 rows (bench_fp8.py's), for the fp8 kernels.

    python benchmarks/probe_masked_paths.py --paths split,wide,gluon --shapes 64x8x32768,128x8x32768 \
        --out benchmarks/results/masked_paths_int32_h200.json
    python benchmarks/probe_masked_paths.py --paths split --shapes 16x8x131072,16x32x32768 \
        --out benchmarks/results/masked_paths_16h_h200.json
    python benchmarks/probe_masked_paths.py --paths gluon_lock_step,gluon_roles,gluon_seesaw \
        --shapes 64x8x32768,64x32x32768,128x8x32768,128x8x131072 --out benchmarks/results/masked_paths_roles_h200.json
    python benchmarks/probe_masked_paths.py --cache fp8_e4m3 --paths split,gluon_fp8 \
        --shapes 16x8x131072,64x8x32768,128x8x32768 --out benchmarks/results/masked_paths_fp8_h200.json

benchmarks/make_path_table.py reads these files into path_table.CALL_COST.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import check, counts, make_case, time_triton  # noqa: E402
from common import floor_ms, probe_parser, probe_shapes  # noqa: E402

import torch  # noqa: E402

CALLS = ("plain", "mask", "causal", "mask+causal")


def call_extras(kind, B, T, device):
    """The mask / causal operands of a decode step (AttentionCall's keywords): "mask" hides the last 7 positions of
    every request with a [B, 1, 1, T] row (static-position decode), "causal" caps the keys
    at each request's query position T - 8 (int-position decode), "mask+causal" both; "plain": none."""
    extras = {}
    if "mask" in kind:
        mask = torch.zeros(B, 1, 1, T, device=device)
        mask[..., T - 7:] = float("-inf")
        extras["mask"] = mask
    if "causal" in kind:
        extras["q_pos"] = torch.full((B, 1), T - 8, device=device, dtype=torch.int64)
    return extras


def fp8_case(B, H, T):
    """(timing, checking) functions over packed fp8 rows (bench_fp8.py's sets and call)."""
    import bench_fp8 as F8
    from dcp_pass.runtime.decode.backends import attend
    from dcp_pass.runtime.decode.kernels.reference import attention_impl

    sets = F8.make_sets(B, H, T, True)

    def timed(path, extras):
        return F8.time_calls(lambda *s: F8.fp8_call(*s).replace(**extras), path, sets)

    def checked(path, extras):
        one = {k: v[:1] for k, v in extras.items()}
        call = F8.first_row(F8.fp8_call(*sets[0])).replace(**one)
        o, lse = attend(call, path)
        ro, rl = attention_impl(call, torch.float32)
        return ((o.float() - ro).norm() / ro.norm()).item(), (lse - rl).abs().max().item()

    return timed, checked, F8.counts(B, H, T, F8.LAYOUT.row_bytes)


def main():
    ap = probe_parser("benchmarks/results/masked_paths.json", "16x8x131072,64x8x32768,128x8x32768", 3)
    ap.add_argument("--paths", default="split,wide,gluon")
    ap.add_argument("--cache", default="bf16", choices=("bf16", "fp8_e4m3"))
    a = ap.parse_args()

    def one_shape(H, B, T, ceil):
        if a.cache == "fp8_e4m3":
            timed, checked, (nbytes, flops) = fp8_case(B, H, T)
        else:
            sets = make_case(B, 1, H, T)
            nbytes, flops = counts(B, 1, H, T)
            timed = lambda path, extras: time_triton(sets, None, path=path, extras=extras)  # noqa: E731
            checked = lambda path, extras: check(sets, path, None, extras)  # noqa: E731
        floor = floor_ms(nbytes, flops, ceil)
        device = "cuda"
        variants = []
        for path in a.paths.split(","):
            for call in CALLS:
                extras = call_extras(call, B, T, device)
                try:
                    err = checked(path, extras)
                except Exception as e:  # a path this shape or machine does not take
                    print(f"skip {path} {call} {H}x{B}x{T}: {type(e).__name__}: {e}"[:300], flush=True)
                    continue
                variants.append((path, call, extras, err))
        times = {(p, c): [] for p, c, _, _ in variants}
        for _ in range(a.passes):
            for path, call, extras, _ in variants:
                times[(path, call)].append(timed(path, extras))
        plain = {p: statistics.median(times[(p, "plain")]) for p, c, _, _ in variants if c == "plain"}
        for path, call, _, err in variants:
            ms = statistics.median(times[(path, call)])
            yield dict(H=H, B=B, T=T, cache=a.cache, path=path, call=call, ms=ms, passes=times[(path, call)], of_floor=floor / ms,
                       vs_plain=(ms / plain[path]) if path in plain else None, rel_err=err[0], lse_err=err[1])

    probe_shapes(a.out, a.shapes, one_shape, [("H", "H"), ("B", "B"), ("T", "T"), ("path", "path"), ("call", "call"),
                                              ("ms", "ms"), ("floor/ms", "of_floor"), ("x plain", "vs_plain"),
                                              ("rel err", "rel_err")])


if __name__ == "__main__":
    main()
