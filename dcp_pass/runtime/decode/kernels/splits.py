"""How the keys of a row are split across programs, and how the splits are merged back.

Shared by both Triton MLA kernels (``mla_attention``'s fused split-KV kernel and
``mla_wide``'s two-GEMM kernel), which import from here and never from each other:

* :func:`split_count`: the number of key splits, from shapes and the SM count only;
* :func:`partial_outputs`: where a split kernel writes its per-split results (the final
  output directly for one split, fp32 scratch with base-2 LSEs for more);
* :func:`reduce_launch`: the stage-2 kernel that merges the scratch into the output.
"""

from __future__ import annotations

import torch

from .common import HAS_TRITON, cuda_properties, lse_scale, pow2

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["split_count", "partial_outputs", "reduce_launch"]


# --------------------------------------------------------------------------------------
# split count (shape-derived only)
# --------------------------------------------------------------------------------------
def _sm_count(device: torch.device) -> int:
    return cuda_properties(device).multi_processor_count if device.type == "cuda" else 4


def split_count(
    batch: int, n_programs: int, t_cap: int, device: torch.device, waves: float = 1.0, min_tokens: int = 256
) -> int:
    """Splits so that at most ``waves`` x SM-count programs run (whole waves, no ragged
    last wave), each over >= min_tokens keys; ``n_programs`` = programs per split per row."""
    target = max(1, int(waves * _sm_count(device)))
    ns = target // max(1, batch * n_programs)
    return max(1, min(ns, triton.cdiv(max(t_cap, 1), min_tokens)))


# --------------------------------------------------------------------------------------
# stage 2: merge of the split partials
# --------------------------------------------------------------------------------------
def _reduce_kernel_src(
    OP,
    LP,
    O,
    L,
    H,
    lse_scale,
    sop_b,
    sop_sp,
    sop_r,
    sop_d,
    slp_b,
    slp_sp,
    slp_r,
    so_b,
    so_s,
    so_h,
    so_d,
    sl_b,
    sl_s,
    sl_h,
    D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Merge NUM_SPLITS base-2 partials of one (row, batch, BLOCK_DV columns) into the output.

    All splits are loaded as one [SPLITS_P2, BLOCK_DV] tile, so the loads are independent and
    in flight together rather than one split after another (on the H200 the same at 8-16
    splits; rows with hundreds of splits, 16 heads at B=1, are where it can matter)."""
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    dc = tl.program_id(2)
    s_idx = r // H
    h_idx = r % H
    offs_sp = tl.arange(0, SPLITS_P2)
    sp_ok = offs_sp < NUM_SPLITS
    offs_d = dc * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D_V
    lse = tl.load(LP + b * slp_b + r * slp_r + offs_sp * slp_sp, mask=sp_ok, other=float("-inf"))
    o = tl.load(
        OP + b * sop_b + r * sop_r + offs_sp[:, None] * sop_sp + offs_d[None, :] * sop_d,
        mask=sp_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    # a NaN LSE gives a NaN weight, and a NaN partial a NaN product even at weight 0: NaN in, NaN out
    w = tl.exp2(lse - m_use)
    den = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * o, 0)
    empty = den == 0.0
    out = acc / tl.where(empty, 1.0, den)
    lse_out = tl.where(empty, float("-inf"), m_use + tl.log2(tl.where(empty, 1.0, den))) * lse_scale
    tl.store(O + b * so_b + s_idx * so_s + h_idx * so_h + offs_d * so_d, out.to(O.dtype.element_ty), mask=d_ok)
    if dc == 0:
        tl.store(L + b * sl_b + s_idx * sl_s + h_idx * sl_h, lse_out)


if HAS_TRITON:
    _reduce_jit = triton.jit(_reduce_kernel_src)


def partial_outputs(out, lse_out, ns, H, base):
    """Where a split kernel writes its per-split results, with strides as (b, split, s, h[, d]).

    One split writes the final output and LSE directly (LSE in ``base``); more splits
    write fp32 partials with base-2 LSEs into scratch, merged by :func:`reduce_launch`'s kernel
    (partials in bf16 were measured slower on the H200, not faster: the wgmma accumulator
    layout makes their stores half-sector writes, and the stage-2 merge of them is slower).
    Returns (o_part, l_part, o_strides, l_strides, lse_scale).
    """
    if ns == 1:
        ops = (out.stride(0), 0, out.stride(1), out.stride(2), out.stride(3))
        lps = (lse_out.stride(0), 0, lse_out.stride(1), lse_out.stride(2))
        return out, lse_out, ops, lps, lse_scale(base)
    B, S, _, v_dim = out.shape
    o_part = torch.empty(B, ns, S * H, v_dim, dtype=torch.float32, device=out.device)
    l_part = torch.empty(B, ns, S * H, dtype=torch.float32, device=out.device)
    ops = (o_part.stride(0), o_part.stride(1), H * o_part.stride(2), o_part.stride(2), o_part.stride(3))
    lps = (l_part.stride(0), l_part.stride(1), H * l_part.stride(2), l_part.stride(2))
    return o_part, l_part, ops, lps, 1.0


def reduce_launch(o_part, l_part, out, lse_out, H, base, v_dim, ns):
    """Stage 2, the merge of ``ns`` split partials into ``out`` / ``lse_out`` (LSE in ``base``).

    Returns ``(kernel, grid, args, constexprs, num_warps)``, launched as
    ``kernel[grid](*args, **constexprs, num_warps=num_warps)``; grid (S * H, B, column blocks).
    """
    B, S = out.shape[0], out.shape[1]
    args = (
        o_part,
        l_part,
        out,
        lse_out,
        H,
        lse_scale(base),
        *o_part.stride(),
        *l_part.stride(),
        *out.stride(),
        *lse_out.stride(),
    )
    splits_p2 = pow2(ns, 2)
    # one program holds a [splits, columns] tile of at most 4096 fp32 values (32 per thread)
    block_dv = max(16, min(pow2(v_dim), 4096 // splits_p2))
    consts = dict(D_V=v_dim, BLOCK_DV=block_dv, NUM_SPLITS=ns, SPLITS_P2=splits_p2)
    return _reduce_jit, (S * H, B, triton.cdiv(v_dim, block_dv)), args, consts, 4
