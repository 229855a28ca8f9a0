"""Two-GEMM MLA decode attention for wide head blocks (compute-bound: >= WIDE_MIN_ROWS rows).

The registry's "wide" kernel; same contract as the split kernel (contiguous caches only).
The fused split-KV kernel serialises scores -> softmax -> values in one warpgroup and,
with its value split, computes the scores twice. Here the two products are separate
kernels, neither with a chained dot, so Triton gives both full-size wgmma tiles:

* kernel A (scores), one program per (row block, key tile, batch row): ``s = q . k``
  over all key columns (latent + rope) as a plain GEMM loop over BLOCK_K column chunks,
  ``s * scale * log2 e (+ mask * log2 e)``, invisible keys -inf; writes
  ``P = exp2(s - m_tile)`` in the cache dtype plus per-(row, tile) ``m_tile``, ``l_tile``
  (fp32).
* kernel B (values), one program per (row block, value-column chunk, split, batch row):
  first the split's max ``m`` and sum ``l = sum_t exp2(m_t - m) l_t`` from the small
  (m, l) arrays, then ``acc += (P_t * exp2(m_t - m)) @ V_t`` over the split's tiles (the
  per-row factor is applied to P in registers, so the accumulator is never rescaled).
  Writes the normalised partial and its base-2 LSE (the format of the fused kernel's
  stage 1), merged by the same stage-2 kernel; one split writes the final output.

Scratch: P [B, tiles, rows, BLOCK_N] (cache dtype), m and l [B, tiles, rows] (fp32),
sized from shapes. Split counts come from shapes, lengths from ``kv_lens`` on the device:
no host sync, CUDA-graph capturable. Program order: row blocks fastest (they share a K or
V tile), then value chunks (they share a P tile), so programs reading the same tile run
side by side and the second read hits L2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..call import KV_SCALE_BLOCK as SCALE_BLOCK
from .common import (
    HAS_TRITON,
    LOG2E,
    AttentionCall,
    ShardView,
    causal_operand,
    check_base,
    check_launchable,
    fold_dtype,
    fold_operand,
    fp8_dots_dtype,
    fp8_read,
    keys_up_to,
    launch,
    lens_operand,
    mask_operand,
    outputs,
    positions_i32,
    pow2,
    row_alignment,
    shard_keys,
    triton_reason,
)
from .splits import partial_outputs, reduce_launch, split_count

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["WideConfig", "pick_wide_config", "supports", "offered", "unmeasured", "run", "plan"]


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
def _visible_end_src(
    LENS,
    QPOS,
    b,
    T,
    S,
    cp_world,
    cp_rank,
    lens_sb,
    lens_c,
    lens_r,
    sqp_b,
    sqp_s,
    BLOCK_S: tl.constexpr,
    HAS_LENS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Batch row b's visible local keys [0, end), the same for both kernels (row-block independent).

    ``LENS[b]``: the global key count, of which rank ``lens_r`` of ``lens_c`` holds
    ``(n + c - 1 - r) // c`` (capped at T); CAUSAL: only keys at or before the row's last
    query position (local key k stands at global ``k * cp_world + cp_rank``).
    """
    if HAS_LENS:
        end = shard_keys(LENS, b, lens_sb, T, lens_c, lens_r)
    else:
        end = T
    if CAUSAL:
        offs_s = tl.arange(0, BLOCK_S)
        qp_all = positions_i32(tl.load(QPOS + b * sqp_b + offs_s * sqp_s, mask=offs_s < S, other=-1))
        end = tl.minimum(end, keys_up_to(tl.max(qp_all, axis=0), cp_world, cp_rank))
    return end


def _fold_queries_kernel_src(
    Q,
    QF,
    F,
    SH,
    H,
    sq_b,
    sq_s,
    sq_h,
    sq_d,
    sqf_b,
    sqf_r,
    sf_b,
    sf_r,
    D_MAIN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALE_W: tl.constexpr,
):
    """One (row block, column block, batch row): the queries' latent part as the fp16 operand
    of an fp8 fold read and their rows' factors (common.fold_operand), written once per call
    for every key tile's scores program to read as it reads 16-bit queries."""
    rb = tl.program_id(0)
    blk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < SH
    cols = blk * SCALE_W + tl.arange(0, SCALE_W)
    ok = row_ok[:, None] & (cols[None, :] < D_MAIN)
    q = tl.load(
        Q + b * sq_b + (rows // H)[:, None] * sq_s + (rows % H)[:, None] * sq_h + cols[None, :] * sq_d,
        mask=ok,
        other=0.0,
    )
    x, f = fold_operand(q, QF.dtype.element_ty)
    tl.store(QF + b * sqf_b + rows[:, None] * sqf_r + cols[None, :], x, mask=ok)
    tl.store(F + b * sf_b + rows * sf_r + blk, f, mask=row_ok)


def _scores_kernel_src(
    Q,
    QT,
    K,
    KT,
    LENS,
    MASK,
    QPOS,
    P,
    MT,
    LT,
    KS,
    QF,
    F,
    T,
    H,
    SH,
    S,
    cp_world,
    cp_rank,
    sm_scale_log2,
    lens_sb,
    lens_c,
    lens_r,
    sq_b,
    sq_s,
    sq_h,
    sq_d,
    sqt_b,
    sqt_s,
    sqt_h,
    sqt_d,
    sk_b,
    sk_t,
    sk_d,
    skt_b,
    skt_t,
    skt_d,
    sks_b,
    sks_t,
    sks_d,
    sm_b,
    sm_s,
    sm_h,
    sm_t,
    sqp_b,
    sqp_s,
    sp_b,
    sp_t,
    sp_r,
    sml_b,
    sml_t,
    sqf_b,
    sqf_r,
    sf_b,
    sf_r,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    N_RB: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    HAS_LENS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    MASK_SHARED: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    SCALE_BLOCK: tl.constexpr = 128,
    FP8_FOLD: tl.constexpr = False,
    FOLD_DTYPE: tl.constexpr = tl.float16,
    SCALE_W: tl.constexpr = 128,
    KT_ALIGN: tl.constexpr = 1,
    Q_FOLDED: tl.constexpr = False,
):
    """One (row block, key tile, batch row): P = exp2(s - m_tile), m_tile, l_tile.

    KV_FP8: K is an fp8 latent with one fp32 scale per SCALE_BLOCK columns. FP8_FOLD reads it
    in blocks of SCALE_W columns, each as ``dot(q_blk, k8_blk^T) * f s`` (the fp8 values enter
    the dot as FOLD_DTYPE unchanged, the keys' scales s and the query rows' factors f of
    common.fold_operand multiply the [rows, keys] partial scores); without it each BLOCK_K
    column chunk (inside one scale block) is read as k * its rows' scale, in fp32. Q_FOLDED:
    the queries' operand and factors were written by the fold-queries kernel (QF [B, rows,
    D_MAIN], F [B, rows, blocks]), as for bf16 queries with fp16 dots.
    KT_ALIGN: a power of two dividing every rope row's element offset (common.row_alignment).

    MASK_SHARED: all rows read one mask row (a mask broadcast over heads and query
    tokens), loaded once as a [BLOCK_N] vector.
    """
    pid = tl.program_id(0)
    rb = pid % N_RB
    tile = pid // N_RB
    b = tl.program_id(1).to(tl.int64)

    end = _visible_end(
        LENS, QPOS, b, T, S, cp_world, cp_rank, lens_sb, lens_c, lens_r, sqp_b, sqp_s, BLOCK_S, HAS_LENS, CAUSAL
    )
    n0 = tile * BLOCK_N
    if n0 >= end:  # never read by the values kernel
        return

    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < SH
    s_idx = rows // H
    h_idx = rows % H
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if KV_FP8 and FP8_FOLD:
        offs_w = tl.arange(0, SCALE_W)
        q_row = Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h
        k_col = K + b * sk_b + offs_n[None, :].to(tl.int64) * sk_t  # keys along the columns: k^T tiles
        ks_row = KS + b * sks_b + offs_n.to(tl.int64) * sks_t
        qf_row = QF + b * sqf_b + rows[:, None] * sqf_r
        f_row = F + b * sf_b + rows * sf_r
        for c0 in range(0, D_MAIN, SCALE_W):
            cols = c0 + offs_w
            d_ok = cols < D_MAIN
            kT = tl.load(k_col + cols[:, None] * sk_d, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            sc = tl.load(ks_row + (c0 // SCALE_BLOCK) * sks_d, mask=n_ok, other=0.0)
            if Q_FOLDED:
                qx = tl.load(qf_row + cols[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                f = tl.load(f_row + c0 // SCALE_W, mask=row_ok, other=1.0)
            else:
                q = tl.load(q_row + cols[None, :] * sq_d, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                qx, f = fold_operand(q, FOLD_DTYPE)
            if IEEE:
                part = tl.dot(qx, kT.to(FOLD_DTYPE), input_precision="ieee")
            else:
                part = tl.dot(qx, kT.to(FOLD_DTYPE))
            acc += part * (f[:, None] * sc[None, :])
    else:
        q_ptrs = Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h + offs_k[None, :] * sq_d
        k_ptrs = K + b * sk_b + offs_n[:, None].to(tl.int64) * sk_t + offs_k[None, :] * sk_d
        for d0 in range(0, D_MAIN, BLOCK_K):
            if D_MAIN % BLOCK_K == 0:
                q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
                k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                d_ok = (d0 + offs_k) < D_MAIN
                q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if KV_FP8:
                k_scale = tl.load(
                    KS + b * sks_b + offs_n.to(tl.int64) * sks_t + (d0 // SCALE_BLOCK) * sks_d, mask=n_ok, other=0.0
                )
                k = (k.to(tl.float32) * k_scale[:, None]).to(Q.dtype.element_ty)
            if IEEE:
                acc = tl.dot(q, tl.trans(k), acc, input_precision="ieee")
            else:
                acc = tl.dot(q, tl.trans(k), acc)
            q_ptrs += BLOCK_K * sq_d
            k_ptrs += BLOCK_K * sk_d
    if HAS_TAIL:  # a rope part stored apart from the latent part
        offs_kt = tl.arange(0, BLOCK_KT)
        qt_ptrs = QT + b * sqt_b + s_idx[:, None] * sqt_s + h_idx[:, None] * sqt_h + offs_kt[None, :] * sqt_d
        kt_rows = tl.multiple_of(offs_n.to(tl.int64) * skt_t, KT_ALIGN)
        kt_ptrs = KT + b * skt_b + kt_rows[:, None] + offs_kt[None, :] * skt_d
        for d0 in range(0, D_TAIL, BLOCK_KT):
            d_ok = (d0 + offs_kt) < D_TAIL
            qt = tl.load(qt_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            kt = tl.load(kt_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(qt, tl.trans(kt), acc, input_precision="ieee")
            else:
                acc = tl.dot(qt, tl.trans(kt), acc)
            qt_ptrs += BLOCK_KT * sqt_d
            kt_ptrs += BLOCK_KT * skt_d

    s = acc * sm_scale_log2
    if HAS_MASK and MASK_SHARED:
        mk = tl.load(MASK + b * sm_b + offs_n * sm_t, mask=n_ok, other=0.0)
        s = s + mk[None, :] * 1.4426950408889634
    elif HAS_MASK:
        mk = tl.load(
            MASK + b * sm_b + s_idx[:, None] * sm_s + h_idx[:, None] * sm_h + offs_n[None, :] * sm_t,
            mask=row_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        s = s + mk * 1.4426950408889634
    valid = n_ok[None, :]
    if CAUSAL:
        qpos = positions_i32(tl.load(QPOS + b * sqp_b + s_idx * sqp_s, mask=row_ok, other=-1))
        valid = valid & ((offs_n[None, :] * cp_world + cp_rank) <= qpos[:, None])
    s = tl.where(valid, s, float("-inf"))
    m = tl.max(s, axis=1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_use[:, None])
    l = tl.sum(p, axis=1)
    offs_c = tl.arange(0, BLOCK_N)
    tl.store(P + b * sp_b + tile * sp_t + rows[:, None] * sp_r + offs_c[None, :], p.to(P.dtype.element_ty))
    tl.store(MT + b * sml_b + tile * sml_t + rows, m)
    tl.store(LT + b * sml_b + tile * sml_t + rows, l)


def _values_kernel_src(
    P,
    MT,
    LT,
    V,
    LENS,
    QPOS,
    O,
    L,
    KS,
    T,
    H,
    SH,
    S,
    cp_world,
    cp_rank,
    lse_scale,
    lens_sb,
    lens_c,
    lens_r,
    sp_b,
    sp_t,
    sp_r,
    sml_b,
    sml_t,
    sv_b,
    sv_t,
    sv_d,
    sks_b,
    sks_t,
    sks_d,
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
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_MT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    N_RB: tl.constexpr,
    N_VC: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_LENS: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    SCALE_BLOCK: tl.constexpr = 128,
    FP8_FOLD: tl.constexpr = False,
):
    """One (row block, value chunk, split, batch row): sum_t (P_t * exp2(m_t - m)) @ V_t.

    KV_FP8: V is an fp8 latent whose BLOCK_V value chunk lies inside one block of SCALE_BLOCK
    columns: each token's scale multiplies its column of P instead of its row of V
    (``(P * s) @ V8 = P @ (s * V8)``), and the fp8 values enter the dot exactly in P's dtype.
    With FP8_FOLD and fp16 P the scales are divided by the split's largest scale of the block
    ``c`` first (the output is multiplied back), so that the weights stay in [0, 1], fp16's
    range whatever the scales."""
    pid = tl.program_id(0)
    rb = pid % N_RB
    vc = (pid // N_RB) % N_VC
    sp = pid // (N_RB * N_VC)
    b = tl.program_id(1).to(tl.int64)

    end = _visible_end(
        LENS, QPOS, b, T, S, cp_world, cp_rank, lens_sb, lens_c, lens_r, sqp_b, sqp_s, BLOCK_S, HAS_LENS, CAUSAL
    )
    n_tiles = tl.cdiv(end, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_lo = sp * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)

    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < SH
    s_idx = rows // H
    h_idx = rows % H

    # the split's max and sum from the per-tile (m, l): [BLOCK_MT tiles, BLOCK_M rows] at a time
    ml_base = b * sml_b + rows[None, :]
    offs_t = tl.arange(0, BLOCK_MT)
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_MT):
        tt = t0 + offs_t
        mm = tl.load(MT + ml_base + tt[:, None] * sml_t, mask=(tt < t_hi)[:, None], other=float("-inf"))
        m_run = tl.maximum(m_run, tl.max(mm, axis=0))
    m_use = tl.where(m_run == float("-inf"), 0.0, m_run)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_MT):
        tt = t0 + offs_t
        t_ok = (tt < t_hi)[:, None]
        mm = tl.load(MT + ml_base + tt[:, None] * sml_t, mask=t_ok, other=float("-inf"))
        ll = tl.load(LT + ml_base + tt[:, None] * sml_t, mask=t_ok, other=0.0)
        l_run += tl.sum(ll * tl.exp2(mm - m_use[None, :]), axis=0)

    offs_v = vc * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < D_V
    offs_c = tl.arange(0, BLOCK_N)
    ks_blk = KS + b * sks_b + ((vc * BLOCK_V) // SCALE_BLOCK) * sks_d
    c = 1.0
    if KV_FP8 and FP8_FOLD and P.dtype.element_ty == tl.float16:
        c_run = tl.zeros([BLOCK_N], dtype=tl.float32)
        for t in range(t_lo, t_hi):
            offs_n = t * BLOCK_N + offs_c
            c_run = tl.maximum(c_run, tl.load(ks_blk + offs_n.to(tl.int64) * sks_t, mask=offs_n < end, other=0.0))
        c = tl.max(c_run, axis=0)
        c = tl.where(c > 0.0, c, 1.0)
    inv_c = 1.0 / c
    p_ptrs = P + b * sp_b + rows[:, None] * sp_r + offs_c[None, :]
    m_ptrs = MT + b * sml_b + rows
    v_row = V + b * sv_b + offs_v[None, :] * sv_d
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        f = tl.exp2(tl.load(m_ptrs + t * sml_t) - m_use)
        p = tl.load(p_ptrs + t * sp_t).to(tl.float32) * f[:, None]
        offs_n = t * BLOCK_N + offs_c
        v = tl.load(
            v_row + offs_n[:, None].to(tl.int64) * sv_t, mask=(offs_n < end)[:, None] & v_ok[None, :], other=0.0
        )
        if KV_FP8:
            v_scale = tl.load(ks_blk + offs_n.to(tl.int64) * sks_t, mask=offs_n < end, other=0.0)
            p = p * (v_scale * inv_c)[None, :]
            v = v.to(P.dtype.element_ty)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)

    empty = l_run == 0.0
    l_safe = tl.where(empty, 1.0, l_run)
    o = acc * (c / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), m_use + tl.log2(l_safe)) * lse_scale
    o_ptrs = O + b * so_b + sp * so_sp + s_idx[:, None] * so_s + h_idx[:, None] * so_h + offs_v[None, :] * so_d
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
    tl.store(L + b * sl_b + sp * sl_sp + s_idx * sl_s + h_idx * sl_h, lse, mask=row_ok & ((rows * 0 + vc) == 0))


if HAS_TRITON:
    _TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
    _visible_end = triton.jit(_visible_end_src)  # called by both kernels (a global looked up when they compile)
    _fold_queries_jit = triton.jit(_fold_queries_kernel_src)
    _scores_jit = triton.jit(_scores_kernel_src)
    _values_jit = triton.jit(_values_kernel_src)


# --------------------------------------------------------------------------------------
# configuration (shape-derived only)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WideConfig:
    """Launch parameters of the two kernels; ``num_splits`` None = from shapes (``waves``)."""

    block_m: int = 128  # rows per program (both kernels)
    block_n: int = 128  # tokens per key tile (both kernels: one P tile)
    block_k: int = 64  # key-column chunk of kernel A's GEMM loop
    warps_a: int = 8
    stages_a: int = 3
    block_v: int = 256  # value columns per kernel-B program
    warps_b: int = 8
    stages_b: int = 2
    num_splits: Optional[int] = None
    waves: float = 1.0

    # the registry's kernels this configures (registry.KERNELS names)
    kernels = ("wide",)

    def tag(self) -> str:
        return (
            f"A{self.block_m}x{self.block_n}x{self.block_k}/{self.warps_a}w/{self.stages_a}s "
            f"B{self.block_m}x{self.block_n}x{self.block_v}/{self.warps_b}w/{self.stages_b}s x{self.waves:g}"
        )


# Default for the compute-bound case (16-bit caches). Resource use checked offline for sm_90
# (benchmarks/offline_wide.py).
WIDE_DEFAULT = WideConfig()
# Fewest (query token, head) rows for which the dispatcher prefers this path. At 64 rows
# (64 heads, between the two regimes) the wide path measured 0.95x the fused kernel on an
# H200; at 128 rows 1.32-1.35x (benchmarks/results/kernel_v4_wide_h200.json).
WIDE_MIN_ROWS = 128


def pick_wide_config(
    rows: int,
    d_main: int,
    d_tail: int,
    d_v: int,
    batch: int,
    t_cap: int,
    device: torch.device,
    num_splits: Optional[int] = None,
    *,
    elem_bytes: int = 2,
    base: Optional[WideConfig] = None,
    fp8: bool = False,
    fp8_fold: bool = False,
) -> WideConfig:
    """From shapes only. The interpreter gets small tiles and a few splits (tests). ``fp8``:
    value chunks of at most one scale block (the values kernel scales P per chunk);
    ``fp8_fold``: the fp8 latent is read by folding its scales (key tiles of at most 64)."""
    if device.type != "cuda":
        block_m = max(16, min(pow2(rows), 32))
        block_v = max(16, pow2(d_v) // 2)
        if fp8:
            block_v = min(block_v, SCALE_BLOCK)
        ns = num_splits if num_splits is not None else max(1, min(3, triton.cdiv(max(t_cap, 1), 16)))
        return WideConfig(block_m, 16, 16, 4, 1, block_v, 4, 1, ns)
    cfg = base or WIDE_DEFAULT
    block_m = max(16, min(cfg.block_m, pow2(rows)))
    warps_a, warps_b = cfg.warps_a, cfg.warps_b
    if block_m <= 64:  # one warpgroup covers 64 rows of scores
        warps_a = 4
    block_v = max(16, min(cfg.block_v, pow2(d_v)))
    if fp8:
        block_v = min(block_v, SCALE_BLOCK)
    stages_a, stages_b = cfg.stages_a, cfg.stages_b
    block_n = cfg.block_n
    if fp8_fold and base is None:
        # kernel A holds a block's partial scores beside the accumulator: [128, 128] fp32
        # twice spills on sm_90, 64-key tiles fit (offline, benchmarks/offline_fp8.py), with
        # the stages of the fastest 64-key bf16 tiles (benchmarks/results/kernel_v4_wide_h200.json)
        block_n, stages_a, stages_b = min(block_n, 64), 4, 3
    if elem_bytes == 4:  # fp32 caches: halve what is pipelined
        block_v, block_n = min(block_v, 128), min(block_n, 64)
        stages_a, stages_b = min(stages_a, 2), min(stages_b, 2)
    ns = num_splits if num_splits is not None else cfg.num_splits
    if ns is None:
        n_prog = triton.cdiv(rows, block_m) * triton.cdiv(d_v, block_v)
        ns = split_count(batch, n_prog, t_cap, device, cfg.waves, min_tokens=max(256, 4 * block_n))
    return WideConfig(
        block_m, block_n, cfg.block_k, warps_a, stages_a, block_v, warps_b, stages_b, max(1, int(ns)), cfg.waves
    )


def supports(shape) -> Optional[str]:
    """Why the two-GEMM kernels cannot run a call of this shape (None: they can): the Triton
    layouts (common.triton_reason), contiguous caches only."""
    if shape.paged:
        return "it reads contiguous caches, not page pools"
    return triton_reason(shape, fp8=True)


def offered(shape) -> Optional[str]:
    """Why the chooser does not offer it for a call it could run: it is measured on CUDA with
    16-bit caches whose main part is a power of two of at least 256 columns."""
    dtype = shape.query_dtype if shape.kv_quant else shape.dtype  # fp8 latent: read into the queries' dtype
    if shape.device != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "it is offered for 16-bit caches on CUDA only (an fp8 latent with 16-bit queries counts as one)"
    if not (pow2(shape.d_main) == shape.d_main and shape.d_main >= 256):
        return f"it is offered for main parts of 2^k >= 256 columns, not {shape.d_main}"
    return None


def unmeasured(shape) -> bool:
    """Where no timed shape is near: from WIDE_MIN_ROWS rows (the compute-bound side)."""
    return shape.rows >= WIDE_MIN_ROWS


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------
def _adjacent(a: torch.Tensor, b: torch.Tensor, width: int) -> bool:
    """b's columns directly follow a's ``width`` columns in the same storage, same strides."""
    return (
        a.stride() == b.stride()
        and a.dtype == b.dtype
        and b.data_ptr() == a.data_ptr() + width * a.stride(-1) * a.element_size()
    )


@dataclass
class _Launch:
    """One kernel launch: ``kernel[grid](*args, **consts, num_warps=, num_stages=)``."""

    kernel: object
    grid: tuple
    args: list  # the kernel's leading (non-constexpr) parameters, in order
    consts: dict
    num_warps: int
    num_stages: int

    def __call__(self):
        launch(self.kernel, self.grid, self.args, self.consts, self.num_warps, self.num_stages)


def plan(a: ShardView, out, lse_out, cfg: WideConfig, read: Optional[str] = None):
    """The launches of one call (the fold-queries kernel for an fp8 fold read of bf16 queries,
    kernel A, kernel B, and the split merge when splits > 1); ``read``: how an fp8 latent is
    read (common.FP8_READS; None: DCP_FP8_READ)."""
    base = check_base(a.lse_base)
    q_lat, kv, v_dim, scale, mask, kv_lens, causal = a.q_lat, a.kv, a.v_dim, a.scale, a.mask, a.kv_lens, a.causal
    parts = a.parts()
    B, S, H, _ = q_lat.shape
    T = kv.shape[1]
    device = q_lat.device
    SH = S * H
    d_main = parts.q_main.shape[-1]
    d_tail = parts.q_tail.shape[-1] if parts.q_tail is not None else 0
    BM, BN = cfg.block_m, cfg.block_n
    ns = cfg.num_splits

    # one GEMM over latent + rope when the rope columns directly follow the latent ones
    q_a, k_a, qt, kt, d_a, d_t = parts.q_main, parts.k_main, parts.q_tail, parts.k_tail, d_main, d_tail
    if qt is not None and _adjacent(q_a, qt, d_main) and _adjacent(k_a, kt, d_main):
        qt = kt = None
        d_a, d_t = d_main + d_tail, 0
    dummy = kv  # pointer for absent optional operands (never dereferenced)
    has_tail = qt is not None
    qts = qt.stride() if has_tail else (0, 0, 0, 0)
    kts = kt.stride() if has_tail else (0, 0, 0)

    n_rb = triton.cdiv(SH, BM)
    n_vc = triton.cdiv(v_dim, cfg.block_v)
    NT = triton.cdiv(T, BN)
    rows_pad = n_rb * BM
    fp8 = a.kv_scale is not None
    if fp8 and (SCALE_BLOCK % cfg.block_k or SCALE_BLOCK % cfg.block_v):
        raise ValueError(
            f"the wide kernel reads an fp8 latent in column chunks inside one scale block of "
            f"{SCALE_BLOCK}: block_k={cfg.block_k} and block_v={cfg.block_v} must divide it"
        )
    read = (read or fp8_read("wide")) if fp8 else ""
    fold = read.startswith("fold")
    # P in the dtype of the values dot: for an fp8 latent the queries' (fp16 for a fold read of
    # 16-bit queries: P lies in [0, 1], where fp16 resolves more than bf16)
    p_dtype = (fold_dtype(read, q_lat.dtype) if fold else q_lat.dtype) if fp8 else kv.dtype
    p_buf = torch.empty(B, NT, rows_pad, BN, dtype=p_dtype, device=device)
    m_buf = torch.empty(B, NT, rows_pad, dtype=torch.float32, device=device)
    l_buf = torch.empty(B, NT, rows_pad, dtype=torch.float32, device=device)

    mask_b, ms, mask_shared = mask_operand(mask, B, S, H, T, device)
    q_pos, qps, cp_world, cp_rank = causal_operand(causal, B, S, dummy)
    lens, lens_sb, lens_c, lens_r = lens_operand(kv_lens, a.lens_stripe, B, dummy)
    is_f32 = (q_lat.dtype if fp8 else kv.dtype) == torch.float32
    block_s = pow2(S, 2)
    ks, kss = (a.kv_scale, a.kv_scale.stride()) if fp8 else (dummy, (0, 0, 0))

    launches = []
    # bf16 queries read into fp16 dots: their operand and factors once per call (every key
    # tile's program reads them)
    q_folded = fold and p_dtype == torch.float16 and q_a.dtype == torch.bfloat16
    qf_buf, f_buf = dummy, dummy
    if q_folded:
        scale_w = min(SCALE_BLOCK, pow2(d_a))
        n_blk = triton.cdiv(d_a, scale_w)
        qf_buf = torch.empty(B, SH, d_a, dtype=torch.float16, device=device)
        f_buf = torch.empty(B, SH, n_blk, dtype=torch.float32, device=device)
        block_r = 32
        launches.append(
            _Launch(
                _fold_queries_jit,
                (triton.cdiv(SH, block_r), n_blk, B),
                [
                    q_a,
                    qf_buf,
                    f_buf,
                    SH,
                    H,
                    *q_a.stride(),
                    qf_buf.stride(0),
                    qf_buf.stride(1),
                    f_buf.stride(0),
                    f_buf.stride(1),
                ],
                dict(D_MAIN=d_a, BLOCK_R=block_r, SCALE_W=scale_w),
                4,
                1,
            )
        )
    qfs = (qf_buf.stride(0), qf_buf.stride(1), f_buf.stride(0), f_buf.stride(1)) if q_folded else (0, 0, 0, 0)

    launches.append(
        _Launch(
            _scores_jit,
            (n_rb * NT, B),
            [
                q_a,
                qt if has_tail else dummy,
                k_a,
                kt if has_tail else dummy,
                lens,
                mask_b if mask_b is not None else dummy,
                q_pos,
                p_buf,
                m_buf,
                l_buf,
                ks,
                qf_buf,
                f_buf,
                T,
                H,
                SH,
                S,
                cp_world,
                cp_rank,
                float(scale) * LOG2E,
                lens_sb,
                lens_c,
                lens_r,
                *q_a.stride(),
                *qts,
                *k_a.stride(),
                *kts,
                *kss,
                *ms,
                *qps,
                p_buf.stride(0),
                p_buf.stride(1),
                p_buf.stride(2),
                m_buf.stride(0),
                m_buf.stride(1),
                *qfs,
            ],
            dict(
                D_MAIN=d_a,
                D_TAIL=d_t,
                BLOCK_M=BM,
                BLOCK_N=BN,
                BLOCK_K=cfg.block_k,
                BLOCK_KT=max(16, min(cfg.block_k, pow2(max(d_t, 1)))),
                BLOCK_S=block_s,
                N_RB=n_rb,
                HAS_TAIL=has_tail,
                HAS_LENS=kv_lens is not None,
                HAS_MASK=mask_b is not None,
                CAUSAL=causal is not None,
                IEEE=is_f32,
                MASK_SHARED=mask_shared,
                KV_FP8=fp8,
                FP8_FOLD=fold,
                FOLD_DTYPE=_TL_DTYPES[p_dtype],
                SCALE_W=min(SCALE_BLOCK, pow2(d_a)),
                KT_ALIGN=row_alignment(kt, False) if has_tail else 1,
                Q_FOLDED=q_folded,
            ),
            cfg.warps_a,
            cfg.stages_a,
        )
    )

    o_part, l_part, ops, lps, l_scale = partial_outputs(out, lse_out, ns, H, base)
    v = kv  # values: the first v_dim columns of the cache
    launches.append(
        _Launch(
            _values_jit,
            (n_rb * n_vc * ns, B),
            [
                p_buf,
                m_buf,
                l_buf,
                v,
                lens,
                q_pos,
                o_part,
                l_part,
                ks,
                T,
                H,
                SH,
                S,
                cp_world,
                cp_rank,
                l_scale,
                lens_sb,
                lens_c,
                lens_r,
                p_buf.stride(0),
                p_buf.stride(1),
                p_buf.stride(2),
                m_buf.stride(0),
                m_buf.stride(1),
                *v.stride(),
                *kss,
                *qps,
                *ops,
                *lps,
            ],
            dict(
                D_V=v_dim,
                BLOCK_M=BM,
                BLOCK_N=BN,
                BLOCK_V=cfg.block_v,
                BLOCK_MT=32,
                BLOCK_S=block_s,
                N_RB=n_rb,
                N_VC=n_vc,
                NUM_SPLITS=ns,
                HAS_LENS=kv_lens is not None,
                CAUSAL=causal is not None,
                IEEE=is_f32,
                KV_FP8=fp8,
                FP8_FOLD=fold,
            ),
            cfg.warps_b,
            cfg.stages_b,
        )
    )
    if ns > 1:
        kernel, grid, args, consts, warps = reduce_launch(o_part, l_part, out, lse_out, H, base, v_dim, ns)
        launches.append(_Launch(kernel, grid, list(args), consts, warps, 3))
    return launches


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[WideConfig] = None,
):
    """The registry's entry: :func:`plan` and its launches."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable")
    return launch_wide(call.shard(), out, lse_out, num_splits, config)


def launch_wide(a: ShardView, out, lse_out, num_splits, config: Optional[WideConfig]):
    """The wide kernels' launches over a call's rank view; ``config`` replaces the default tiles
    (on CUDA still fitted to the shape: block_m to the rows, block_v to the value width),
    ``num_splits`` the split count."""
    check_base(a.lse_base)
    q_lat, kv, v_dim, kv_lens = a.q_lat, a.kv, a.v_dim, a.kv_lens
    parts = a.parts()
    B, S, H, _ = q_lat.shape
    T = kv.shape[1]
    device = q_lat.device
    out, lse_out, done = outputs(q_lat, v_dim, out, lse_out, T == 0)
    if done:
        return out, lse_out
    SH = S * H
    fp8 = a.kv_scale is not None
    read = fp8_read("wide") if fp8 else ""
    d_main = parts.q_main.shape[-1]
    d_tail = parts.q_tail.shape[-1] if parts.q_tail is not None else 0
    check_launchable(
        device, kv_lens, "the wide kernel", fp8_dots_dtype(read, q_lat.dtype, d_tail > 0) if fp8 else kv.dtype
    )
    if config is not None and device.type != "cuda":  # interpreter: the given tiles as they are
        ns = num_splits or config.num_splits or pick_wide_config(SH, d_main, d_tail, v_dim, B, T, device).num_splits
        cfg = replace(config, num_splits=ns)
    else:
        cfg = pick_wide_config(
            SH,
            d_main,
            d_tail,
            v_dim,
            B,
            T,
            device,
            num_splits,
            elem_bytes=kv.element_size(),
            base=config,
            fp8=fp8,
            fp8_fold=read.startswith("fold"),
        )
    for step in plan(a, out, lse_out, cfg, read):
        step()
    return out, lse_out
