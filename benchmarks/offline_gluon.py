"""Offline sm_90 compile of the Gluon one-read kernel (``kernels/gluon/lock_step.py``), no GPU needed.

Registers, spill stack, shared memory, wgmma shapes and copy kinds per tile config,
DeepSeek-V3 shapes (fused 512 + 64 cache, bf16, kv_lens on). Compile with the Triton the
GPU machine runs (3.6 there): e.g. ``PYTHONPATH=/path/to/triton-3.6 python
benchmarks/offline_gluon.py``; Gluon's API moves between Triton releases.

    python benchmarks/offline_gluon.py [--configs "64,64,2;64,32,3"] [--ttgir DIR] [--roles] [--seesaw] [--fp8]

``--fp8``: the fp8-cache kernel (``kernels/gluon/fp8.py``) on packed 656-byte rows, its
arguments built by its own launcher from CPU tensors and marked as the JIT marks them.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from offline_wide import cubin_report, finish, save_ttgir  # noqa: E402

from dcp_pass.runtime.decode.kernels.gluon import lock_step as G  # noqa: E402

PTRS = {"Q": "*bf16", "QT": "*bf16", "KV": "*bf16", "KT": "*bf16", "LENS": "*i64", "MASK": "*fp32", "QPOS": "*i64",
        "O": "*fp32", "L": "*fp32"}


def compile_gluon(jit, src, consts: dict, num_warps: int, not_divisible: tuple):
    """Compile a Gluon kernel for sm_90 with DeepSeek-V3's argument kinds: pointers (16-byte
    aligned), the two fp32 scalars, ``consts`` as constexprs, every other argument an i32
    marked divisible by 16 unless named in ``not_divisible``; its :func:`cubin_report`."""
    sig, attrs = {}, {}
    for i, n in enumerate(inspect.signature(src).parameters):
        if n in PTRS:
            sig[n], attrs[(i,)] = PTRS[n], [["tt.divisibility", 16]]
        elif n in ("sm_scale_log2", "lse_scale"):
            sig[n] = "fp32"
        elif n in consts:
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
            if n not in not_divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options(dict(num_warps=num_warps, num_stages=1))
    return cubin_report(triton.compile(GluonASTSource(jit, sig, consts, attrs), target=target, options=opts.__dict__))


def compile_config(cfg: "G.GluonConfig", num_splits: int = 2, mask: bool = False, causal: bool = False):
    """The lock-step kernel (``kernels/gluon/lock_step.py``) for one config."""
    consts = dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, STAGES=cfg.stages, NUM_SPLITS=num_splits, HAS_LENS=True,
                  SCHEDULE=G.lock_step_schedule(cfg, mask or causal), HAS_MASK=mask, CAUSAL=causal,
                  Q_REG=G._q_reg_for(cfg, mask or causal))
    # (q is loaded with plain loads, so its rope strides need no divisibility)
    return compile_gluon(G._mla_gluon_jit, G._mla_gluon_kernel_src, consts, 8,
                         ("H", "SH", "lens_c", "lens_r", "lens_sb", "cp_world", "cp_rank", "sm_t", "sqp_s", "sqt_s",
                          "sqt_h"))


def compile_roles(num_splits: int = 16, separate_rope: bool = False, seesaw: bool = False, mask: bool = False,
                  causal: bool = False):
    """The role-split kernel (``kernels/gluon/roles.py``), or with `seesaw` the seesaw kernel
    (``kernels/gluon/seesaw.py``), fused cache (576-element rows) or two caches, kv_lens on,
    with a decode step's mask row and / or a causal cap."""
    if seesaw:
        from dcp_pass.runtime.decode.kernels.gluon import seesaw as S

        jit, src = S._seesaw_jit, S._seesaw_kernel_src
    else:
        from dcp_pass.runtime.decode.kernels.gluon import roles as R

        jit, src = R._roles_jit, R._roles_kernel_src

    consts = dict(SKV_T=512 if separate_rope else 576, SKT_T=64 if separate_rope else 576, BLOCK_H=64, BLOCK_N=64,
                  NUM_SPLITS=num_splits, HAS_LENS=True, HAS_MASK=mask, CAUSAL=causal)
    # (q's strides are marked too: it is copied by cp.async, and the launch takes it only so)
    return compile_gluon(jit, src, consts, 4, ("H", "SH", "lens_c", "lens_r", "lens_sb", "sm_b", "sm_t", "sqp_b",
                                              "sqp_s", "cp_world", "cp_rank"))


_ARG_TYPES = {"torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.float32": "*fp32",
              "torch.float8_e4m3fn": "*fp8e4nv", "torch.int64": "*i64", "torch.int32": "*i32"}


def compile_launched(jit, src, args: tuple, consts: dict, num_warps: int):
    """Compile a Gluon kernel for sm_90 with the argument kinds the JIT would give ``args``:
    tensors as pointers (divisible by 16 when their data is 16-byte aligned), floats as fp32,
    ints equal to 1 as constants, other ints as i32 (divisible by 16 when they are), TMA tensor
    descriptors (Gluon's host TensorDescriptor) as the JIT mangles them."""
    from triton.runtime.jit import mangle_type

    sig, attrs, consts = {}, {}, dict(consts)
    names = list(inspect.signature(src).parameters)
    for i, (n, v) in enumerate(zip(names, args)):
        if type(v).__name__ == "TensorDescriptor":
            sig[n] = mangle_type(v)
        elif hasattr(v, "data_ptr"):
            sig[n] = _ARG_TYPES[str(v.dtype)]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[n] = "fp32"
        elif v == 1:
            sig[n], consts[n] = "constexpr", 1
        else:
            sig[n] = "i32" if abs(v) < 2 ** 31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for n in names[len(args):]:
        sig[n] = "constexpr"
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options(dict(num_warps=num_warps, num_stages=1))
    return cubin_report(triton.compile(GluonASTSource(jit, sig, consts, attrs), target=target, options=opts.__dict__))


def fp8_call(batch: int, keys: int, heads: int, separate_rope: bool, **extras):
    """A CPU AttentionCall over FlashMLA's packed rows (512 e4m3 + 4 fp32 scales + 64 bf16 rope:
    656 bytes), or a 528-byte latent row beside a bf16 rope buffer, DeepSeek-V3's scale, kv_lens
    on, q [B, 1, H, 576] split into its two parts (``extras``: the call's mask / q_pos)."""
    import torch

    from dcp_pass.runtime.decode.call import AttentionCall
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, views

    q = torch.zeros(batch, 1, heads, 576, dtype=torch.bfloat16)
    if separate_rope:
        latent, scales, _ = views(torch.zeros(batch, keys, 528, dtype=torch.uint8), Fp8Layout(512, 0, torch.bfloat16))
        rope = torch.zeros(batch, keys, 64, dtype=torch.bfloat16)
    else:
        latent, scales, rope = views(torch.zeros(batch, keys, 656, dtype=torch.uint8),
                                     Fp8Layout(512, 64, torch.bfloat16))
    lens = torch.full((batch,), keys, dtype=torch.int64)
    return AttentionCall(q[..., :512], q[..., 512:], latent, rope, 512, 192 ** -0.5, kv_lens=lens, kv_scale=scales,
                         **extras)


def _fp8_extras(batch: int, keys: int, mask: bool, causal: bool) -> dict:
    """A decode step's mask row (zeros) and / or a causal cap at the last key, for :func:`fp8_call`."""
    import torch

    extras = {}
    if mask:
        extras["mask"] = torch.zeros(batch, 1, 1, keys)
    if causal:
        extras["q_pos"] = torch.full((batch, 1), keys - 1, dtype=torch.int64)
    return extras


def compile_fp8(num_splits: int = 16, batch: int = 2, keys: int = 4096, heads: int = 128, separate_rope: bool = False,
                mask: bool = False, causal: bool = False):
    """The fp8-cache kernel (``kernels/gluon/fp8.py``) on :func:`fp8_call`'s operands, with a
    decode step's mask row and / or a causal cap."""
    from dcp_pass.runtime.decode.kernels.gluon import fp8 as F

    call = fp8_call(batch, keys, heads, separate_rope, **_fp8_extras(batch, keys, mask, causal))
    _, _, (grid, args, consts, _) = F.launch_args(call.shard(), num_splits=num_splits)
    return compile_launched(F._fp8_jit, F._fp8_kernel_src, args, consts, 4)


def compile_fp8_narrow(num_splits: int = 16, batch: int = 2, keys: int = 4096, heads: int = 16,
                       separate_rope: bool = False, scorers: int = 2, mask: bool = False, causal: bool = False):
    """The narrow fp8 kernel (``kernels/gluon/fp8_narrow.py``) on :func:`fp8_call`'s operands,
    16 heads, with 1 or 2 scorer warpgroups, a decode step's mask row and / or a causal cap."""
    from dcp_pass.runtime.decode.kernels.gluon import fp8_narrow as N

    call = fp8_call(batch, keys, heads, separate_rope, **_fp8_extras(batch, keys, mask, causal))
    _, _, (grid, args, consts, _) = N.launch_args(call.shard(), num_splits=num_splits, scorers=scorers)
    return compile_launched(N._narrow_jit, N._narrow_kernel_src, args, consts, 4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64,64,2,3,128;64,64,2,3,0;64,64,2,2,0;64,64,2,1,0")
    ap.add_argument("--ttgir", default=None)
    ap.add_argument("--mask", action="store_true")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--roles", action="store_true", help="the role-split kernel (gluon/roles.py) instead")
    ap.add_argument("--seesaw", action="store_true", help="the seesaw kernel (gluon/seesaw.py) instead")
    ap.add_argument("--fp8", action="store_true", help="the fp8-cache kernel (gluon/fp8.py) instead")
    ap.add_argument("--fp8-narrow", action="store_true",
                    help="the narrow fp8 kernel (gluon/fp8_narrow.py, 16 rows) instead")
    a = ap.parse_args()
    if a.fp8_narrow:
        rows = []
        tag = ("_mask" if a.mask else "") + ("_causal" if a.causal else "")
        for separate, scorers in ((False, 2), (True, 2), (False, 1)):
            r = compile_fp8_narrow(separate_rope=separate, scorers=scorers, mask=a.mask, causal=a.causal)
            save_ttgir(a.ttgir, f"gluon_fp8_narrow_s{scorers}" + tag + ("_separate_rope" if separate else ""),
                       r.pop("ttgir"))
            rows.append(dict(config=f"fp8 narrow, {scorers} scorers, " + (
                "528-byte latent rows + rope buffer" if separate else "packed 656-byte rows") + tag.replace("_", " "),
                triton=triton.__version__, **r))
            print(json.dumps(rows[-1]), flush=True)
        finish(rows, a.json)
        return
    if a.fp8:
        rows = []
        for separate in (False, True):
            r = compile_fp8(separate_rope=separate, mask=a.mask, causal=a.causal)
            tag = ("_mask" if a.mask else "") + ("_causal" if a.causal else "")
            save_ttgir(a.ttgir, "gluon_fp8" + tag + ("_separate_rope" if separate else ""), r.pop("ttgir"))
            rows.append(dict(config="fp8 " + ("528-byte latent rows + rope buffer" if separate else "packed 656-byte rows")
                             + tag.replace("_", " "), triton=triton.__version__, **r))
            print(json.dumps(rows[-1]), flush=True)
        finish(rows, a.json)
        return
    if a.roles or a.seesaw:
        name = "seesaw" if a.seesaw else "roles"
        for separate in (False, True):
            r = compile_roles(separate_rope=separate, seesaw=a.seesaw, mask=a.mask, causal=a.causal)
            tag = ("_mask" if a.mask else "") + ("_causal" if a.causal else "") + ("_separate_rope" if separate else "")
            save_ttgir(a.ttgir, f"gluon_{name}{tag}", r.pop("ttgir"))
            print(json.dumps(dict(config=name + tag.replace("_", " ").replace("separate rope", "two caches"),
                                  triton=triton.__version__, **r)), flush=True)
        return
    rows = []
    for c in a.configs.split(";"):
        cfg = G.GluonConfig.parse(c)
        bh, bn, st = cfg.block_h, cfg.block_n, cfg.stages
        rec = dict(config=cfg.tag(), triton=triton.__version__)
        try:
            r = compile_config(cfg, mask=a.mask, causal=a.causal)
            save_ttgir(a.ttgir, f"gluon_{bh}_{bn}_{st}_v{G.lock_step_schedule(cfg)}_q{cfg.q_reg}", r.pop("ttgir"))
        except Exception as e:  # noqa: BLE001
            r = dict(error=f"{type(e).__name__}: {e}"[-1500:])
        rec.update(r)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    finish(rows, a.json)


if __name__ == "__main__":
    main()
