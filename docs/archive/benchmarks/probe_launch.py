"""Where the host time of one shard-local attention call goes, and what launching it from
inductor would cost instead (issue #11 item 4: measure before choosing).

Rows, each the mean host time per call of N calls back to back (one sync at the end), on
decode shapes small enough that the GPU never holds the host back:

* ``custom_op[_lens]``  torch.ops.dcp.mla_local_attention as a graph calls it (int count / device counts, c=2)
* ``triton_entry``      the kernels' entry point (checks, config, outputs, launches)
* ``jit_launch``        only the Triton launches with their arguments prepared (JITFunction.run)
* ``inductor_custom_op`` a torch.compile'd function around the custom op (what a decode step pays)

A torch.library.triton_op variant (wrap_triton launches in inductor's generated code) was
measured on 2026-11-30 and did not compile with torch 2.11: inductor's copy of the split
kernel failed Triton's tl.dot accumulator check (results/probe_launch_before_h200.json).

    python benchmarks/probe_launch.py --out benchmarks/results/probe_launch_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import KV_LORA, ROPE, SCALE, env_info, fmt_table, without_replay, write_json  # noqa: E402



def _kernels():
    """The kernels module (and the custom op registered), wherever the runtime tree keeps them."""
    import importlib
    import pkgutil

    import dcp_pass.runtime as runtime
    names = [m.name for m in pkgutil.walk_packages(runtime.__path__, "dcp_pass.runtime.")]
    importlib.import_module(next(n for n in names if n.endswith(".ops")))
    return importlib.import_module(next(n for n in names if n.endswith("kernels.mla_attention")))


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def recorded_launches(M, fn):
    """(jit function, grid, args, options) of each launch `fn` makes."""
    from dcp_pass.runtime.decode.kernels.common import recording_launches

    with recording_launches() as log:
        fn()
    return [(jit, grid, args, options) for jit, _compiled, grid, args, options in log]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="1x16x256,8x16x16384,8x128x16384", help="BxHxT list")
    ap.add_argument("--no-inductor", action="store_true", help="skip the torch.compile rows (they compile for minutes)")
    a = ap.parse_args()
    M = _kernels()
    dev, dtype = "cuda", torch.bfloat16
    rows, errors = [], {}
    for shape in a.shapes.split(","):
        B, H, T = (int(x) for x in shape.split("x"))
        q = torch.randn(B, 1, H, KV_LORA + ROPE, dtype=dtype, device=dev)
        kv = torch.randn(B, T + 1, KV_LORA + ROPE, dtype=dtype, device=dev)
        glens = torch.full((B,), 2 * T, dtype=torch.int64, device=dev)
        lens = torch.full((B,), T, dtype=torch.int64, device=dev)
        cases = {
            "custom_op": lambda: torch.ops.dcp.mla_local_attention(q, None, kv, None, T, 1, 0, KV_LORA, SCALE, None,
                                                                   "e", "auto"),
            "custom_op_lens": lambda: torch.ops.dcp.mla_local_attention(q, None, kv, None, 2 * T, 2, 0, KV_LORA, SCALE,
                                                                        None, "e", "auto", glens),
            "custom_op_lens_python": lambda: without_replay(lambda: torch.ops.dcp.mla_local_attention(
                q, None, kv, None, 2 * T, 2, 0, KV_LORA, SCALE, None, "e", "auto", glens)),
            "triton_entry": lambda: M.mla_attention_triton(q, None, kv, None, KV_LORA, SCALE, None, lens, "e"),
        }
        log = recorded_launches(M, cases["triton_entry"])
        cases["jit_launch"] = lambda: [k[g](*ar, **kw) for k, g, ar, kw in log]  # Triton's own launch path
        n_launches = len(log)

        def plain(q, kv, glens):
            return torch.ops.dcp.mla_local_attention(q, None, kv, None, 2 * T, 2, 0, KV_LORA, SCALE, None, "e",
                                                     "auto", glens)
        try:
            if not a.no_inductor:
                comp = torch.compile(plain, backend="inductor", fullgraph=True)
                comp(q, kv, glens)
                cases["inductor_custom_op"] = lambda: comp(q, kv, glens)
        except Exception:
            errors[f"inductor_custom_op {shape}"] = traceback.format_exc()[-3000:]
        for name, fn in cases.items():
            try:
                rows.append(dict(B=B, H=H, T=T, entry=name, launches=n_launches, us_per_call=per_call_us(fn)))
                print(rows[-1], flush=True)
            except Exception:
                errors[f"{name} {shape}"] = traceback.format_exc()[-3000:]
    if a.out:  # where the custom op's Python time goes (device counts, the decode path)
        import cProfile
        import pstats
        B, H, T = 1, 16, 256
        q = torch.randn(B, 1, H, KV_LORA + ROPE, dtype=dtype, device=dev)
        kv = torch.randn(B, T + 1, KV_LORA + ROPE, dtype=dtype, device=dev)
        glens = torch.full((B,), 2 * T, dtype=torch.int64, device=dev)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            torch.ops.dcp.mla_local_attention(q, None, kv, None, 2 * T, 2, 0, KV_LORA, SCALE, None, "e", "auto", glens)
        torch.cuda.synchronize()
        prof.disable()
        with open(os.path.splitext(a.out)[0] + "_profile.txt", "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
    md = fmt_table(rows, [("B", "B"), ("H", "H"), ("T", "T"), ("entry", "entry"), ("launches", "launches"),
                          ("host us/call", "us_per_call")])
    print(md)
    for k, v in errors.items():
        print("==", k, "\n", v)
    if a.out:
        write_json(a.out, dict(env=env_info(), rows=rows, table_md=md, errors=errors))


if __name__ == "__main__":
    main()
