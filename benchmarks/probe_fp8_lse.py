"""Probe: the fp8 split/wide kernels' LSE against the fp32 reference of the dequantised cache,
per dtype and split count (prints the LSE difference and its ratio to the reference)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch

from dcp_pass.runtime.decode.backends import attend
from kit.kernels import fp8_call, poisoned, ref32

g = torch.Generator().manual_seed(0)
lens = torch.tensor([4096, 64, 0, 2500], device="cuda")
for dt in (torch.bfloat16, torch.float16):
    for H in (16, 128):
        call = fp8_call(4, 1, H, 512, 64, 4096, dt, "cuda", gen=g, kv_lens=lens, scale=192 ** -0.5)
        ro, rl = ref32(call)
        bf = call.replace(kv=None, kv_scale=None) if False else None
        for kernel, opts in (("split", {"num_splits": 1}), ("split", {}), ("wide", {})):
            out, lse = poisoned(4, 1, H, 512, dt, "cuda")
            try:
                attend(call, kernel, out, lse, **opts)
            except Exception as e:
                print(dt, H, kernel, opts, "ERR", type(e).__name__, str(e)[:120]); continue
            fin = torch.isfinite(rl)
            d = (lse - rl)[fin]
            ratio = (lse[fin] / rl[fin])
            oe = ((out.double() - ro.double()).norm() / ro.double().norm()).item()
            print(dt, H, kernel, opts, f"out {oe:.2e} lse diff max {d.abs().max().item():.3f} mean {d.mean().item():.3f}"
                  f" ratio {ratio.min().item():.4f}..{ratio.max().item():.4f} ref lse {rl[fin].mean().item():.3f}")
