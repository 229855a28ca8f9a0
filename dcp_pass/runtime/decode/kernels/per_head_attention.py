"""Shard-local attention over per-head keys and values: the split-KV Triton kernel (the registry's "per_head").

For grouped-query and multi-head attention (Llama, Qwen, Mistral, ...) and MLA models that
re-expand the latent per head. The operands come as one
:class:`~dcp_pass.runtime.decode.call.AttentionCall` with ``v`` set; the kernel reads its rank
view (``call.shard()``):

* ``q`` [B, S, H, D]      queries (``call.q_lat``)
* ``k`` [B, T, Hk, D]     the rank's rows of the keys (``call.kv``; local row i is global
  position ``i * c + r``)
* ``v`` [B, T, Hk, Dv]    the rank's rows of the values; query head h reads kv head
  ``h // (H // Hk)``

any strides. ``scores = q . k * scale (+ mask)``; keys past the rank's share of the global
count, before the window start, or (with a causal cap) after the query's global position are
invisible, and rows past the count are never read. A row with no visible key returns output 0
and LSE -inf; a NaN inside the count reaches every row that reads it. The LSE comes in the
call's base (e or 2).

Two-stage flash-decoding, as the MLA split kernel (``mla_attention.py``): stage 1 gives each
program one kv head, a block of its rows (query token x query head of the group) and one split
of the keys, so each K and V tile is read once for every query head and token that reads it
(GQA-packed: the group's rows are the rows of one dot); stage 2 is the split merge the MLA
kernels use (``splits.reduce_launch``). Split lengths come from the device counts, the split
count from shapes (``splits.split_count``): no host sync, CUDA-graph capturable, and every
launch goes through ``common.launch`` (replayable).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .common import (
    HAS_TRITON,
    LOG2E,
    TRITON_DTYPES,
    AttentionCall,
    ShardView,
    causal_operand,
    check_base,
    check_launchable,
    cuda_properties,
    keys_up_to,
    launch,
    lens_operand,
    mask_operand,
    outputs,
    positions_i32,
    pow2,
    shard_keys,
    triton_device_reason,
)
from .splits import partial_outputs, reduce_launch, split_count

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = ["MAX_HEAD_DIM", "PerHeadConfig", "pick_config", "run", "supports"]

MAX_HEAD_DIM = 256  # key and value columns a program holds (D and Dv up to this)


def _stage1_kernel_src(
    Q,
    K,
    V,
    LENS,
    MASK,
    QPOS,
    O,
    L,
    T,
    T_ALL,
    FIRST,
    G,
    R,
    cp_world,
    cp_rank,
    sm_scale_log2,
    lse_scale,
    lens_sb,
    lens_c,
    lens_r,
    sq_b,
    sq_s,
    sq_h,
    sq_d,
    sk_b,
    sk_t,
    sk_h,
    sk_d,
    sv_b,
    sv_t,
    sv_h,
    sv_d,
    sm_b,
    sm_s,
    sm_h,
    sm_t,
    sqp_b,
    sqp_s,
    so_b,
    so_sp,
    so_s,
    so_h,
    so_d,
    sl_b,
    sl_sp,
    sl_s,
    sl_h,
    D: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_LENS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_SHARED: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One (kv head, row block, split, batch row): online base-2 softmax over the split's keys.

    The block's rows are (query token, query head of the group) pairs, row ``i`` of the kv
    head being token ``i // G``, query head ``kh * G + i % G`` (R = S * G rows per kv head).
    Writes the normalised partial output and its base-2 LSE times ``lse_scale`` (the final
    output directly when NUM_SPLITS == 1).
    """
    pid0 = tl.program_id(0)
    kh = pid0 // ROW_BLOCKS
    rb = pid0 % ROW_BLOCKS
    pid_sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    s_idx = rows // G
    h_idx = kh * G + rows % G
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < D_V

    q = tl.load(
        Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h + offs_d[None, :] * sq_d,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    if HAS_LENS:
        # the rank's share of the global count in the whole cache's rows, less the rows before
        # the window start (the view begins FIRST rows in)
        kv_len = tl.minimum(tl.maximum(shard_keys(LENS, b, lens_sb, T_ALL, lens_c, lens_r) - FIRST, 0), T)
    else:
        kv_len = T
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_sp * split_len
    end = tl.minimum(start + split_len, kv_len)
    if CAUSAL:
        qpos = positions_i32(tl.load(QPOS + b * sqp_b + s_idx * sqp_s, mask=row_ok, other=-1))
        # keys k with k * c + r <= qmax are the only ones any row of the block can see
        end = tl.minimum(end, keys_up_to(tl.max(qpos, axis=0), cp_world, cp_rank))

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)

    k_head = K + b * sk_b + kh.to(tl.int64) * sk_h
    v_head = V + b * sv_b + kh.to(tl.int64) * sv_h
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        offs_n64 = offs_n.to(tl.int64)
        k = tl.load(
            k_head + offs_n64[:, None] * sk_t + offs_d[None, :] * sk_d, mask=n_ok[:, None] & d_ok[None, :], other=0.0
        )
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * sm_scale_log2
        if HAS_MASK and MASK_SHARED and MASK_BOOL:
            keep = tl.load(MASK + b * sm_b + offs_n * sm_t, mask=n_ok, other=1)
            qk = tl.where(keep[None, :] != 0, qk, float("-inf"))
        elif HAS_MASK and MASK_SHARED:
            mk = tl.load(MASK + b * sm_b + offs_n * sm_t, mask=n_ok, other=0.0)
            qk = qk + mk[None, :] * 1.4426950408889634
        elif HAS_MASK and MASK_BOOL:
            keep = tl.load(
                MASK + b * sm_b + s_idx[:, None] * sm_s + h_idx[:, None] * sm_h + offs_n[None, :] * sm_t,
                mask=row_ok[:, None] & n_ok[None, :],
                other=1,
            )
            qk = tl.where(keep != 0, qk, float("-inf"))
        elif HAS_MASK:
            mk = tl.load(
                MASK + b * sm_b + s_idx[:, None] * sm_s + h_idx[:, None] * sm_h + offs_n[None, :] * sm_t,
                mask=row_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            qk = qk + mk * 1.4426950408889634
        valid = n_ok[None, :]
        if CAUSAL:
            valid = valid & ((offs_n[None, :] * cp_world + cp_rank) <= qpos[:, None])
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_head + offs_n64[:, None] * sv_t + offs_dv[None, :] * sv_d, mask=n_ok[:, None] & dv_ok[None, :], other=0.0
        )
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)) * lse_scale
    o = acc / l_safe[:, None]
    o_rows = O + b * so_b + pid_sp * so_sp + s_idx[:, None] * so_s + h_idx[:, None] * so_h
    tl.store(o_rows + offs_dv[None, :] * so_d, o.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(L + b * sl_b + pid_sp * sl_sp + s_idx * sl_s + h_idx * sl_h, lse, mask=row_ok)


if HAS_TRITON:
    _stage1_jit = triton.jit(_stage1_kernel_src)


# --------------------------------------------------------------------------------------
# launch configuration (shape-derived only)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PerHeadConfig:
    block_r: int  # rows (query token x query head of a group) per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    num_splits: int

    # the registry's kernels this configures (registry.KERNELS names)
    kernels = ("per_head",)


# (block_n, warps, stages, waves) on CUDA: the fastest of a sweep of 48 (32 / 64 / 128 keys,
# 4 or 8 warps, 2-4 stages, 4-32 splits) on an H100 at the Llama-8B layer, B=8, 16K and 64K
# keys (benchmarks/results/per_head_sweep_h100.json). Offline for sm_90 at 128 / 128 dims: 76
# registers and 70 KiB of shared memory with 16-row blocks (three programs an SM), 177 and
# 112 KiB with 64-row blocks, no spills.
TUNED = (64, 4, 3, 2.0)


def _smem_limit(device: torch.device) -> int:
    return int(getattr(cuda_properties(device), "shared_memory_per_block_optin", 232448)) - 8192


def smem_estimate(block_r: int, block_n: int, stages: int, bd: int, bdv: int, elem: int, mask_tile: int) -> int:
    """Upper estimate of stage 1's shared memory: pipelined K, V (and mask) tiles, and Q."""
    return stages * block_n * ((bd + bdv) * elem + mask_tile) + block_r * bd * elem


def pick_config(
    rows: int,
    d: int,
    d_v: int,
    batch: int,
    kv_heads: int,
    t_cap: int,
    device: torch.device,
    num_splits: Optional[int] = None,
    *,
    elem_bytes: int = 2,
    mask_rows: int = 0,
) -> PerHeadConfig:
    """Launch parameters from shapes only (no host sync, safe under CUDA-graph capture).

    ``rows``: rows per kv head (query tokens x the group's query heads), ``mask_rows``: rows of a
    pipelined mask tile (0: none, 1: one row per request). The tile is shrunk (keys, then
    stages) until its shared memory fits the device."""
    block_r = min(max(16, pow2(rows)), 64 if max(d, d_v) <= 128 else 32)
    if device.type != "cuda":  # interpreter: small tiles, a few splits to exercise stage 2
        ns = num_splits if num_splits is not None else max(1, min(3, triton.cdiv(max(t_cap, 1), 16)))
        return PerHeadConfig(block_r, 16, 4, 1, ns)
    block_n, warps, stages, waves = TUNED
    bd, bdv = pow2(d), pow2(d_v)
    mask_tile = 4 * (block_r if mask_rows > 1 else mask_rows)
    limit = _smem_limit(device)
    for bn, st in ((block_n, stages), (block_n, 2), (32, 2), (16, 2), (16, 1)):
        if bn <= block_n and smem_estimate(block_r, bn, st, bd, bdv, elem_bytes, mask_tile) <= limit:
            block_n, stages = bn, st
            break
    else:
        block_n, stages = 16, 1
    programs = kv_heads * triton.cdiv(rows, block_r)
    ns = num_splits if num_splits is not None else split_count(batch, programs, t_cap, device, waves)
    return PerHeadConfig(block_r, block_n, warps, stages, max(1, int(ns)))


# --------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why this kernel cannot run a call of this shape (None: it can): per-head keys and values
    of 16-bit (or fp32) dtypes, head and value dims up to 256, on CUDA or under the interpreter."""
    if not shape.per_head:
        return "it reads per-head keys and values (GQA / MHA), not an MLA latent cache"
    if not HAS_TRITON:
        return "triton is not importable"
    if shape.dtype not in TRITON_DTYPES:
        return f"it takes float16, bfloat16 or float32 caches, not {shape.dtype}"
    if not shape.same_dtypes:
        return "the queries, keys and values are not of one dtype"
    if max(shape.d_main, shape.v_dim) > MAX_HEAD_DIM:
        return (
            f"head dims {shape.d_main} (keys) and {shape.v_dim} (values): the kernel holds up to "
            f"{MAX_HEAD_DIM} columns of each"
        )
    return triton_device_reason(shape)


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[PerHeadConfig] = None,
):
    """The registry's entry; ``config`` replaces the shape-derived launch parameters,
    ``num_splits`` the split count."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable")
    view = call.shard()
    if view.v is None:
        raise ValueError("the per-head kernel takes per-head keys and values (AttentionCall(..., v=...))")
    return _launch(view, out, lse_out, num_splits, config)


def _check_operands(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k and v must be 4-D ([B,S,H,D], [B,T,Hk,D], [B,T,Hk,Dv]), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, _, H, D = q.shape
    Hk = k.shape[2]
    if Hk == 0 or H % Hk:
        raise ValueError(f"the query's {H} heads must be a multiple of the {Hk} key/value heads")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, T, Hk, D={D}], got {tuple(k.shape)}")
    if v.shape[0] != B or v.shape[2] != Hk or v.shape[1] < k.shape[1]:
        raise ValueError(f"v must be [B, T, Hk, Dv] with k's [B, T, Hk] = {tuple(k.shape[:3])}, got {tuple(v.shape)}")


def _launch(a: ShardView, out, lse_out, num_splits, config):
    base = check_base(a.lse_base)
    q, k, v = a.q_lat, a.kv, a.v
    _check_operands(q, k, v)
    B, S, H, D = q.shape
    T, Hk, d_v = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hk
    R = S * G
    device = q.device
    out, lse_out, done = outputs(q, d_v, out, lse_out, T == 0)
    if done:
        return out, lse_out
    # a boolean mask is read in place (a prefill's [S, T] mask would be 4x its size as fp32)
    mask_b, ms, mask_shared = mask_operand(a.mask, B, S, H, T, device, keep_bool=True)
    check_launchable(device, a.kv_lens, "the per-head kernel", k.dtype)
    if config is None:
        cfg = pick_config(
            R,
            D,
            d_v,
            B,
            Hk,
            T,
            device,
            num_splits,
            elem_bytes=k.element_size(),
            mask_rows=0 if mask_b is None else 1 if mask_shared else 2,
        )
    else:
        cfg = config if num_splits is None else replace(config, num_splits=num_splits)
    ns = cfg.num_splits

    dummy = k  # any tensor: pointer for absent optional operands (never dereferenced)
    lens, lens_sb, lens_c, lens_r = lens_operand(a.kv_lens, a.lens_stripe, B, dummy)
    q_pos, qps, cp_world, cp_rank = causal_operand(a.causal, B, S, dummy)
    o_part, l_part, ops, lps, l_scale = partial_outputs(out, lse_out, ns, H, base)
    row_blocks = triton.cdiv(R, cfg.block_r)
    grid = (Hk * row_blocks, ns, B)
    launch(
        _stage1_jit,
        grid,
        (
            q,
            k,
            v,
            lens,
            mask_b if mask_b is not None else dummy,
            q_pos,
            o_part,
            l_part,
            T,
            T + a.first_row,
            a.first_row,
            G,
            R,
            cp_world,
            cp_rank,
            float(a.scale) * LOG2E,
            l_scale,
            lens_sb,
            lens_c,
            lens_r,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *ms,
            *qps,
            *ops,
            *lps,
        ),
        dict(
            D=D,
            D_V=d_v,
            BLOCK_D=pow2(D),
            BLOCK_DV=pow2(d_v),
            BLOCK_R=cfg.block_r,
            BLOCK_N=cfg.block_n,
            ROW_BLOCKS=row_blocks,
            NUM_SPLITS=ns,
            HAS_LENS=a.kv_lens is not None,
            HAS_MASK=mask_b is not None,
            MASK_SHARED=mask_shared,
            MASK_BOOL=mask_b is not None and mask_b.dtype == torch.uint8,
            CAUSAL=a.causal is not None,
            IEEE=k.dtype == torch.float32,
        ),
        cfg.num_warps,
        cfg.num_stages,
    )
    if ns > 1:
        kernel, grid, args, consts, warps = reduce_launch(o_part, l_part, out, lse_out, H, base, d_v, ns)
        launch(kernel, grid, args, consts, warps)
    return out, lse_out
