"""Offline feasibility of a warp-specialised MLA decode tile on sm_90 (no GPU needed).

Not a kernel of the product: the smallest Gluon program with the pieces the next step for
issue #14 needs (docs/kernel_notes.md v9 / v10), compiled for Hopper to see that they exist
and what they cost in registers with the installed Triton:

* ``gl.warp_specialize`` with two consumer warpgroups (the default partition and one
  worker) that each issue their own wgmma (64-row score tile, n = 64) and a loader warp;
* tiles copied by the loader with ``cp.async`` and handed over through mbarriers
  (``async_copy.mbarrier_arrive``: the arrival lands when the thread's copies have);
* the probabilities kept in registers as the value GEMM's left operand (no shared-memory
  hand-off inside a warpgroup), each warpgroup holding half of the 512 value columns.

Reports registers at launch, the per-partition register budgets (``setmaxnreg``), spills,
shared memory and the wgmma shapes. The latent tile is 512 wide (no rope part: Gluon
shapes are powers of two; the real kernel keeps the rope columns in a second buffer).

    PYTHONPATH=<triton 3.6> python benchmarks/offline_warp_specialize.py
"""
from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait  # noqa: E402

from offline_wide import cubin_report  # noqa: E402

_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared

ROWS, KEYS, D = 64, 64, 512


@gluon.jit
def _consumer(half: gl.constexpr, q_s, k_s, full, empty, O, n_tiles, scale_log2):
    """One warpgroup: the scores of every tile against all of q, and value columns
    [256 half, 256 half + 256)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    acc = gl.zeros([64, 256], gl.float32, layout=o_l)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_l))
    for it in range(n_tiles):
        slot = it % 2
        mbarrier.wait(full.index(slot), (it // 2) & 1)
        tile = k_s.index(slot)
        s = warpgroup_mma(q_s, tile.permute((1, 0)), gl.zeros([64, 64], gl.float32, layout=s_l), use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
        p = gl.exp2(s * scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_reg = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(p_reg, tile.slice(256 * half, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(slot))
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_l))[:, None]
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
    cols = 256 * half + gl.arange(0, 256, layout=gl.SliceLayout(0, o_l))
    gl.store(O + rows[:, None] * 512 + cols[None, :], o)


@gluon.jit
def _loader(k_s, full, empty, KV, n_tiles):
    """One warp: tile `it` into ring slot it % 2 once both warpgroups released it."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, 512, layout=gl.SliceLayout(0, ld))
    for it in range(n_tiles):
        slot = it % 2
        mbarrier.wait(empty.index(slot), ((it // 2) & 1) ^ 1, pred=it >= 2)
        _async_load(k_s.index(slot), KV + (it * 64 + r)[:, None] * 512 + c[None, :])
        cp.mbarrier_arrive(full.index(slot), increment_count=False)


@gluon.jit
def _ws_tile_kernel(Q, KV, O, n_tiles, scale_log2):
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, q_l))
    c = gl.arange(0, 512, layout=gl.SliceLayout(0, q_l))
    q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 512], sl, gl.load(Q + r[:, None] * 512 + c[None, :]))
    k_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], sl)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=32)  # the loader warp's 32 copying threads
        mbarrier.init(empty.index(i), count=2)  # both warpgroups
    gl.warp_specialize([(_consumer, (0, q_s, k_s, full, empty, O, n_tiles, scale_log2)),
                        (_consumer, (1, q_s, k_s, full, empty, O, n_tiles, scale_log2)),
                        (_loader, (k_s, full, empty, KV, n_tiles))], [4, 1], [240, 40])


def main():
    sig = {"Q": "*bf16", "KV": "*bf16", "O": "*fp32", "n_tiles": "i32", "scale_log2": "fp32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    opts = backend.parse_options(dict(num_warps=4, num_stages=1))
    try:
        k = triton.compile(GluonASTSource(_ws_tile_kernel, sig, {}, attrs), target=target, options=opts.__dict__)
    except Exception as e:  # the point of the probe is whether this Triton can
        print(json.dumps(dict(triton=triton.__version__, error=f"{type(e).__name__}: {str(e)[-400:]}")))
        return
    rep = cubin_report(k)
    rep.pop("ttgir")
    rep["setmaxnreg"] = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])
    print(json.dumps(dict(triton=triton.__version__, **rep)))


if __name__ == "__main__":
    main()
