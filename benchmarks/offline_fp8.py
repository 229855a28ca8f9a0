"""Offline sm_90 compile of the split-KV and two-GEMM kernels over an fp8 latent cache (no GPU needed).

The launches are the kernels' own (``mla_attention._launch`` / ``mla_wide.plan`` over CPU
tensors shaped as on the GPU: packed 656-byte DeepSeek-V3 rows read through their views,
bf16 queries, kv_lens on), captured instead of run, and compiled for sm_90 with the
specialisation the JIT gives them (offline_wide.compile_launch). Per kernel: registers,
spill traffic (local loads / stores), shared memory, MMA kinds and the TTGIR's layout
conversions and shared-memory round trips, for each fp8 read (``--fp8-reads``) beside the
bf16 cache. See docs/kernels.md, "Checking a kernel offline".

    python benchmarks/offline_fp8.py [--heads 16,128] [--fp8-reads fold,dequant] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offline_wide import _DT, compile_launch, finish  # noqa: E402

from dcp_pass import env  # noqa: E402
from dcp_pass.runtime.decode import kv_format  # noqa: E402
from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_attention as M  # noqa: E402
from dcp_pass.runtime.decode.kernels.common import FP8_READS  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_wide as W  # noqa: E402

_DT.update({torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8"})
LAT, ROPE = 512, 64


class _Captured:
    def __init__(self, kernel, grid, args, consts, num_warps, num_stages, maxnreg=None):
        self.kernel, self.grid, self.args, self.consts = kernel, grid, list(args), dict(consts)
        self.num_warps, self.num_stages, self.maxnreg = num_warps, num_stages, maxnreg


@contextlib.contextmanager
def captured_launches():
    """Every launch of the split kernel's module recorded instead of run (its checks for a
    launchable CPU device skipped: nothing runs)."""
    seen = []
    saved = M.launch, M.check_launchable
    M.launch = lambda k, grid, args, consts, w, s=None, r=None: seen.append(_Captured(k, grid, args, consts, w, s, r))
    M.check_launchable = lambda *a, **k: None
    try:
        yield seen
    finally:
        M.launch, M.check_launchable = saved




def calls(H: int, B: int = 2, T: int = 1024):
    """(name, call) of the bf16 fused cache and the packed fp8 rows, DeepSeek-V3 widths."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, H, LAT + ROPE, generator=g).bfloat16()
    values = torch.randn(B, T, LAT + ROPE, generator=g).bfloat16()
    lens = torch.full((B,), T, dtype=torch.int64)
    layout = kv_format.Fp8Layout(LAT, ROPE, torch.bfloat16)
    lat, sc, rope = kv_format.views(kv_format.pack(values, layout), layout)
    yield "bf16", AttentionCall(q, None, values, None, LAT, 0.07, kv_lens=lens)
    yield "fp8", AttentionCall(q[..., :LAT], q[..., LAT:], lat, rope, LAT, 0.07, kv_lens=lens, kv_scale=sc)


def ttgir_counts(ttgir: str) -> dict:
    """Layout conversions and shared-memory allocations the compiler left in the kernel."""
    return dict(convert_layout=ttgir.count("ttg.convert_layout"), local_alloc=ttgir.count("ttg.local_alloc"),
                local_load=ttgir.count("ttg.local_load"), reshape=ttgir.count("tt.reshape"))


def split_launch(call, H: int, fp8_read: str, tiles=None):
    """The split kernel's stage 1; `tiles` (block_h, block_n, warps, stages, v_split[, max_regs])
    replaces the tuned entry of the call's row bucket (the fold reads' own where they have one)."""
    rows = call.q_lat.shape[2]
    bucket = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    fp8 = call.kv_scale is not None
    fold, once = fp8 and fp8_read.startswith("fold"), fp8 and fp8_read == "fold_once"
    tuned = ((M._TUNED_FP8_ONCE.get(bucket) if once else None) or (M._TUNED_FP8_FOLD.get(bucket) if fold else None)
             or M._TUNED[bucket])
    tuned = tuned[:5] + tuned[6:7]
    bh, bn, warps, stages, v_split, *regs = tiles or tuned
    cfg = M.MLAKernelConfig(bh, bn, warps, stages, 2, v_split, regs[0] if regs else None)
    out = torch.empty(call.q_lat.shape[:3] + (LAT,), dtype=torch.bfloat16)
    lse = torch.empty(call.q_lat.shape[:3])
    with captured_launches() as seen, env.overridden("DCP_FP8_READ", fp8_read):
        M._launch(call.shard(), out, lse, None, cfg)
    return [("split", seen[0], M._stage1_kernel_src)]


def wide_launches(call, fp8_read: str, tiles=None):
    """Kernels A and B (and the fold-queries kernel) of the two-GEMM path; `tiles` the first
    eight WideConfig fields replacing the default."""
    out = torch.empty(call.q_lat.shape[:3] + (LAT,), dtype=torch.bfloat16)
    lse = torch.empty(call.q_lat.shape[:3])
    fp8, rows = call.kv_scale is not None, call.q_lat.shape[1] * call.q_lat.shape[2]
    if tiles:
        cfg = W.WideConfig(*tiles, num_splits=2)
    else:  # pick_wide_config's CUDA tiles for the call (it needs a CUDA device to count SMs)
        block_m = max(16, min(W.WIDE_DEFAULT.block_m, rows))
        fold = fp8 and fp8_read.startswith("fold")
        cfg = W.WideConfig(block_m=block_m, block_n=64 if fold else 128, warps_a=4 if block_m <= 64 else 8,
                           stages_a=4 if fold else 3, block_v=128 if fp8 else 256, stages_b=3 if fold else 2,
                           num_splits=2)
    with env.overridden("DCP_FP8_READ", fp8_read):
        launches = W.plan(call.shard(), out, lse, cfg)
    names = {W._fold_queries_jit: ("wide_Q", W._fold_queries_kernel_src),
             W._scores_jit: ("wide_A", W._scores_kernel_src), W._values_jit: ("wide_B", W._values_kernel_src)}
    return [(names[x.kernel][0], x, names[x.kernel][1]) for x in launches if x.kernel in names]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--fp8-reads", default=",".join(FP8_READS))
    ap.add_argument("--kernels", default="split,wide")
    ap.add_argument("--split-tiles", default=None,
                    help="semicolon-separated block_h,block_n,warps,stages,v_split[,max_regs] of the split "
                         "kernel (default: the tuned ones)")
    ap.add_argument("--wide-tiles", default=None,
                    help="semicolon-separated block_m,block_n,block_k,warps_a,stages_a,block_v,warps_b,stages_b")
    ap.add_argument("--ttgir", default=None, help="directory to write the TTGIR of each kernel")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for H in (int(h) for h in a.heads.split(",")):
        for name, call in calls(H):
            for read in a.fp8_reads.split(",") if name == "fp8" else (FP8_READS[0],):  # (bf16: no fp8 read)
                todo = []
                if "split" in a.kernels:
                    for t in (a.split_tiles.split(";") if a.split_tiles else [None]):
                        tiles = tuple(int(x) for x in t.split(",")) if t else None
                        todo += [("split" + (f"_{'x'.join(map(str, tiles))}" if tiles else ""), launch, src)
                                 for _, launch, src in split_launch(call, H, read, tiles)]
                if "wide" in a.kernels:
                    for t in (a.wide_tiles.split(";") if a.wide_tiles else [None]):
                        tiles = tuple(int(x) for x in t.split(",")) if t else None
                        todo += [(n + (f"_{'x'.join(map(str, tiles))}" if tiles else ""), launch, src)
                                 for n, launch, src in wide_launches(call, read, tiles)]
                for kname, launch, src in todo:
                    rec = dict(H=H, cache=name, fp8_read=read if name == "fp8" else "", kernel=kname, warps=launch.num_warps,
                               stages=launch.num_stages, maxnreg=getattr(launch, "maxnreg", None))
                    try:
                        r = compile_launch(launch, src)
                        ttgir = r.pop("ttgir")
                        rec.update(r, **ttgir_counts(ttgir))
                        if a.ttgir:
                            os.makedirs(a.ttgir, exist_ok=True)
                            with open(os.path.join(a.ttgir, f"{kname}_h{H}_{name}_{read}.ttgir"), "w") as f:
                                f.write(ttgir)
                    except Exception as e:  # noqa: BLE001 - one failing compile must not lose the others
                        rec["error"] = f"{type(e).__name__}: {e}"[-800:]
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
    finish(rows, a.json)


if __name__ == "__main__":
    main()
