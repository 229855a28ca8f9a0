"""Host (CPU) cost per call of the shard-local attention entry points.

Without CUDA graphs every decode step pays each launch's Python and dispatcher time; a
step whose GPU work is shorter than its host work is host-bound. This times, on a tiny
decode shape so the GPU never holds the host back, the mean wall time per call of N
calls issued back to back (one sync at the end), for each layer of the call stack:

* ``custom_op``  torch.ops.dcp.mla_local_attention, as the compiled graph calls it (int key count)
* ``op_lens``    the same with device key counts (global, c=2), as static-position decode
                 graphs call it: replayed after its first call (runtime/decode/replay.py)
* ``op_lens_python`` the same with DCP_REPLAY=0: its Python path every call
* ``dispatcher`` backends.attend with the device's kernel backend (on CUDA "triton": shape
                 checks, config, both Triton launches; on CPU "torch", the reference)
* ``empty_x2``   two torch.empty calls (the allocation floor)

With ``--cache fp8_e4m3`` the cache is packed fp8 rows (kv_format), and ``op_lens`` /
``op_lens_python`` cycle over ``--layers`` caches of one shape, as a model's layers call the
op: every layer shares one replay signature, and the narrow fp8 kernel's TMA descriptors are
moved to each layer's cache (made once per cache); the rows without device key counts are
left out there.

    python benchmarks/bench_host.py --out host.json
    python benchmarks/bench_host.py --cache fp8_e4m3 --layers 4 --out host_fp8.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import KV_LORA, ROPE, SCALE, env_info, fmt_table, without_replay, write_json  # noqa: E402

import dcp_pass.runtime.decode.ops  # noqa: E402,F401  (registers torch.ops.dcp)
from dcp_pass.runtime.decode.backends import attend  # noqa: E402
from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402


def per_call_us(fn, n=200, dev="cuda"):
    for _ in range(10):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--cache", default="", choices=["", "fp8_e4m3"], help="'': the model's dtype")
    ap.add_argument("--layers", type=int, default=1, help="caches of one shape the fp8 op calls cycle over")
    a = ap.parse_args()
    if a.cache:
        if not torch.cuda.is_available():
            sys.exit("--cache fp8_e4m3 times the fp8 kernels' launches: it needs a CUDA device")
        return fp8_rows(a)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = "triton" if dev == "cuda" else "torch"  # the Triton backend needs CUDA tensors
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    rows = []
    for H in [int(h) for h in a.heads.split(",")]:
        B, T = 1, 256
        q = torch.randn(B, 1, H, KV_LORA + ROPE, dtype=dtype, device=dev)
        kv = torch.randn(B, T + 1, KV_LORA + ROPE, dtype=dtype, device=dev)
        mask = torch.zeros(1, 1, 1, T, device=dev)
        glens = torch.full((B,), 2 * T, dtype=torch.int64, device=dev)
        for name, fn in [
            ("custom_op", lambda: torch.ops.dcp.mla_local_attention(q, None, kv, None, T, 1, 0, KV_LORA, SCALE, None, "e",
                                                                     "auto")),
            ("custom_op+mask", lambda: torch.ops.dcp.mla_local_attention(q, None, kv, None, T, 1, 0, KV_LORA, SCALE, mask,
                                                                          "e", "auto")),
            ("op_lens", lambda: torch.ops.dcp.mla_local_attention(q, None, kv, None, 2 * T, 2, 0, KV_LORA, SCALE, None,
                                                                  "e", "auto", glens)),
            ("op_lens_python", lambda: without_replay(lambda: torch.ops.dcp.mla_local_attention(
                q, None, kv, None, 2 * T, 2, 0, KV_LORA, SCALE, None, "e", "auto", glens))),
            ("dispatcher", lambda: attend(AttentionCall(q, None, kv[:, :T], None, KV_LORA, SCALE), kernels)),
            ("empty_x2", lambda: (torch.empty(B, 1, H, KV_LORA, device=dev), torch.empty(B, 1, H, device=dev))),
        ]:
            rows.append(dict(H=H, entry=name, us_per_call=per_call_us(fn, dev=dev)))
            print(rows[-1], flush=True)
    report(rows, [("H", "H"), ("entry", "entry"), ("host us/call", "us_per_call")], a.out)


def report(rows, columns, out):
    """The rows as a table on stdout and, with `out`, as JSON beside the machine's description."""
    md = fmt_table(rows, columns)
    print(md)
    if out:
        write_json(out, dict(env=env_info(), rows=rows, table_md=md))


def fp8_rows(a):
    """op_lens and op_lens_python over `a.layers` packed fp8 caches, called in turn."""
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, pack

    layout = Fp8Layout(KV_LORA, ROPE, torch.bfloat16)
    rows = []
    for H in [int(h) for h in a.heads.split(",")]:
        B, T = 1, 256
        q = torch.randn(B, 1, H, KV_LORA + ROPE, dtype=torch.bfloat16, device="cuda")
        caches = [pack(torch.randn(B, T + 1, KV_LORA + ROPE, device="cuda"), layout) for _ in range(a.layers)]
        glens = torch.full((B,), 2 * T, dtype=torch.int64, device="cuda")
        turn = [0]

        def op():
            turn[0] += 1
            return torch.ops.dcp.mla_local_attention(q, None, caches[turn[0] % a.layers], None, 2 * T, 2, 0, KV_LORA,
                                                     SCALE, None, "e", "auto", glens, kv_format=layout.spec())

        for name, fn in [("op_lens", op), ("op_lens_python", lambda: without_replay(op))]:
            rows.append(dict(H=H, entry=name, cache=a.cache, layers=a.layers, us_per_call=per_call_us(fn)))
            print(rows[-1], flush=True)
    report(rows, [("H", "H"), ("entry", "entry"), ("layers", "layers"), ("host us/call", "us_per_call")], a.out)


if __name__ == "__main__":
    main()
