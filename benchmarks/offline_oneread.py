"""Offline sm_90 compile of the one-read kernel (``kernels/mla_oneread.py``), no GPU needed.

Registers, spill stack, shared memory, MMA kinds and the warp layout Triton gave each dot
(the point of the kernel: ``warpsPerCTA = [4, 2]`` for both GEMMs, not the chained
``[8, 1]``), for DeepSeek-V3 shapes (fused 512 + 64 cache, bf16, kv_lens on). Uses
``offline_wide.compile_launch`` (same argument specialisation as the JIT).

    python benchmarks/offline_oneread.py [--mask] [--causal] [--configs "64,64,8,2;..."] [--ttgir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offline_wide import compile_launch  # noqa: E402

from dcp_pass.runtime.decode.kernels import mla_oneread as R  # noqa: E402
from dcp_pass.runtime.decode.kernels.common import MlaArgs  # noqa: E402


class _Captured:
    def __init__(self, kernel, args, consts, num_warps, num_stages):
        self.kernel, self.args, self.consts = kernel, args, consts
        self.num_warps, self.num_stages = num_warps, num_stages


def plan(cfg, mask: bool, causal: bool, heads: int = 128):
    """The launch `launch_oneread` would make (captured instead of run; CPU tensors)."""
    B, S, H, T = 2, 1, heads, 1024
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(B, T, 576, generator=g).to(torch.bfloat16)
    lens = torch.full((B,), T, dtype=torch.int64)
    a = MlaArgs(q, None, kv, None, 512, 0.07, torch.zeros(B, S, H, T) if mask else None, lens,
                causal=(torch.full((B, S), T), 1, 0) if causal else None)
    got = []
    saved = R.launch, R.check_launchable
    R.launch = lambda kernel, grid, args, consts, w, s=None: got.append(_Captured(kernel, args, consts, w, s))
    R.check_launchable = lambda *x: None
    try:
        R.launch_oneread(a, None, None, num_splits=2, config=cfg)
    finally:
        R.launch, R.check_launchable = saved
    return got[0]


def dot_layouts(ttgir: str):
    """warpsPerCTA of the MMA layouts the dots use, in order of appearance."""
    return re.findall(r"#ttg\.nvidia_mma<\{versionMajor = 3[^}]*warpsPerCTA = \[(\d+, \d+)\][^}]*instrShape = \[([\d, ]+)\]", ttgir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mask", action="store_true")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--configs", default="64,64,8,2;64,32,8,2;64,32,8,3")
    ap.add_argument("--ttgir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for c in a.configs.split(";"):
        bh, bn, w, st = (int(x) for x in c.split(","))
        cfg = R.OneReadConfig(bh, bn, w, st)
        rec = dict(config=cfg.tag())
        try:
            r = compile_launch(plan(cfg, a.mask, a.causal), R._oneread_kernel_src)
            ttgir = r.pop("ttgir")
            r["mma_layouts"] = dot_layouts(ttgir)
            r["async_copies"] = ttgir.count("async_copy_global_to_local")
            r["volatile_loads"] = ttgir.count("isVolatile = true")
            if a.ttgir:
                os.makedirs(a.ttgir, exist_ok=True)
                with open(os.path.join(a.ttgir, f"oneread_{bh}_{bn}_{w}_{st}.ttgir"), "w") as f:
                    f.write(ttgir)
        except Exception as e:  # noqa: BLE001
            r = dict(error=repr(e)[:600])
        rec.update(r)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
