"""Shard-local absorbed-MLA decode attention: the split-KV Triton kernel (the registry's "split").

Every DCP rank runs attention for all query heads of its DCP group over its own
stripe of the latent KV cache and returns a partial output plus its log-sum-exp
(LSE); `dcp_pass.runtime.decode.merge` combines the partials exactly. The operands
come as one :class:`~dcp_pass.runtime.decode.call.AttentionCall`; the kernels read its
rank view (``call.shard()``).

Shapes (canonical layout, any strides):

* ``q_lat``  [B, S, H, Dl]  absorbed query (latent part; the whole query when the
  cache is fused and ``pe`` is None)
* ``q_rope`` [B, S, H, Dr] or None
* ``kv``     [B, T, Dk]     latent cache (``kv[..., :Dl]`` are the keys); fused when
  ``pe`` is None: then ``Dl`` = latent + rope columns and ``q_lat`` carries both parts
* ``pe``     [B, T, Dr] or None  rotary keys
* values are ``kv[..., :v_dim]``

``scores = (q_lat . kv[..., :Dl] + q_rope . pe) * scale (+ mask)``; keys past the rank's
share ``(n + c - 1 - r) // c`` of the global count ``n`` (taken inside the kernels) and,
with a causal cap, keys whose global position ``k * c + r`` is after the query's are
invisible. A row with no visible key returns output 0 and LSE -inf (never NaN). The LSE
is returned in base e (``lse_base="e"``) or base 2 (``"2"``); the merge must use the same
base.

Two-stage flash-decoding: stage 1 gives each program a block of (query token, head) rows
and one split of the row's keys, so each KV tile is read once for all rows of the block
(the latent tile serves as keys and values); stage 2 merges the splits
(``splits.reduce_launch``, shared with the two-GEMM kernel). Split sizes are derived on the
device from the key counts, the number of splits from shapes only (``splits.split_count``):
no host syncs, CUDA-graph capturable. Nothing is registered with ``torch.library`` here:
the compile pass wraps the registry in its own custom op (runtime/decode/ops.py).

Module layering: ``call`` holds the operands, ``common`` and ``splits`` what the kernels
share; every kernel module (this one, ``mla_wide``, ``per_head_attention``, the Gluon forms
in ``gluon/`` with their own ``gluon/common``, ``flashinfer_mla``, ``reference``) imports only
those and says, from a call's shape, whether it can run it (``supports``); ``registry`` lists
them and chooses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

try:  # triton is optional at import time (CPU-only installs still get the reference)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

from ..call import KV_SCALE_BLOCK as SCALE_BLOCK
from .common import (
    FOLD_F16_READS,
    INTERPRETED,
    LOG2E,
    AttentionCall,
    ShardView,
    causal_operand,
    check_base,
    check_launchable,
    cuda_properties,
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

__all__ = [
    "MLAKernelConfig",
    "pick_config",
    "supports",
    "run",
]


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------
def _fp8_tile_src(
    k,
    KS,
    ks_off,
    sks_d,
    col0,
    n_ok,
    N_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,
    SCALE_W: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """An fp8 tile [BLOCK_N, WIDTH] (columns col0, col0 + 1, ...) times its scales, in fp32.

    The scales are loaded once per (row, block of SCALE_BLOCK columns), [BLOCK_N, WIDTH /
    SCALE_W], and broadcast over their columns by a reshape (SCALE_W = min(SCALE_BLOCK, WIDTH);
    a tile narrower than a block lies inside one): one load per block rather than per value."""
    N_W: tl.constexpr = WIDTH // SCALE_W
    block = (col0 + tl.arange(0, N_W) * SCALE_W) // SCALE_BLOCK
    scale = tl.load(
        KS + ks_off[:, None] + block[None, :] * sks_d, mask=n_ok[:, None] & (block[None, :] < N_SCALES), other=0.0
    )
    x = tl.reshape(k.to(tl.float32), (BLOCK_N, N_W, SCALE_W)) * scale[:, :, None]
    return tl.reshape(x, (BLOCK_N, WIDTH))


def _fold_block_col_src(j: tl.constexpr, vc, N_OWN: tl.constexpr, BLOCK_DV: tl.constexpr, SCALE_W: tl.constexpr):
    """First column of the program's column block j: its own value blocks first (j < N_OWN),
    then, with a value split, the other program's (scores only)."""
    if j < N_OWN:
        col = vc * BLOCK_DV + j * SCALE_W
    else:
        col = (1 - vc) * BLOCK_DV + (j - N_OWN) * SCALE_W
    return col


def _fold_q_src(
    Q,
    b,
    s_idx,
    h_idx,
    row_ok,
    vc,
    sq_b,
    sq_s,
    sq_h,
    sq_d,
    DOT_DTYPE: tl.constexpr,
    D_MAIN: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    N_OWN: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SCALE_W: tl.constexpr,
):
    """The query rows as N_BLOCKS column blocks of SCALE_W columns in DOT_DTYPE with their rows'
    factors (common.fold_operand): two tuples, in _fold_block_col's order."""
    blocks = ()
    factors = ()
    for j in tl.static_range(N_BLOCKS):
        cols = _fold_block_col(j, vc, N_OWN, BLOCK_DV, SCALE_W) + tl.arange(0, SCALE_W)
        ptrs = Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h + cols[None, :] * sq_d
        x, f = fold_operand(tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < D_MAIN), other=0.0), DOT_DTYPE)
        blocks = blocks + (x,)
        factors = factors + (f,)
    return blocks, factors


def _fold_scores_src(
    q_blocks,
    q_factors,
    kv_base,
    k_off,
    skv_d,
    ks_base,
    ks_off,
    sks_d,
    n_ok,
    vc,
    DOT_DTYPE: tl.constexpr,
    D_MAIN: tl.constexpr,
    N_SCALES: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    N_OWN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SCALE_W: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Scores of an fp8 latent tile with the scales folded in: the sum over the column blocks
    of ``dot(q_j, k8_j^T) * f_j s_j``, s_j the keys' scale of block j ([BLOCK_N], one per key),
    f_j the query rows' factor of the block ([BLOCK_H]).

    The fp8 values enter the dots as DOT_DTYPE directly (exact: every e4m3 value is an fp16
    and a bf16 value), so no tile is multiplied or reshaped; the scales multiply the
    [rows, keys] partial scores instead. Each block is loaded as [columns, keys], the dot's
    operand layout: transposing a converted tile instead is a register shuffle that also keeps
    the compiler from pipelining the load. Returns (scores, the own blocks' scales)."""
    qk = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    s_own = ()
    for j in tl.static_range(N_BLOCKS):
        col0 = _fold_block_col(j, vc, N_OWN, BLOCK_DV, SCALE_W)
        cols = col0 + tl.arange(0, SCALE_W)
        kT = tl.load(
            kv_base + k_off[None, :] + cols[:, None] * skv_d, mask=n_ok[None, :] & (cols[:, None] < D_MAIN), other=0.0
        ).to(DOT_DTYPE)
        block = col0 // SCALE_BLOCK
        # (where, not &: Triton's interpreter gives a bool vector & a bool scalar as int32)
        sc = tl.load(ks_base + ks_off + block * sks_d, mask=tl.where(block < N_SCALES, n_ok, False), other=0.0)
        if IEEE:
            part = tl.dot(q_blocks[j], kT, input_precision="ieee")
        else:
            part = tl.dot(q_blocks[j], kT)
        qk += part * (q_factors[j][:, None] * sc[None, :])
        if j < N_OWN:
            s_own = s_own + (sc,)
    return qk, s_own


def _e4m3_to_f16_src(x, ASM: tl.constexpr):
    """float8 e4m3 -> fp16 (exact: every e4m3 value is an fp16), two packed conversions per four
    values. ASM: as inline PTX marked impure, which the compiler neither copies into each use's
    layout nor moves past a layout conversion, so the converted tile is stored to shared memory
    once and both dots load it from there (a cast, or pure PTX, it moves below the conversions
    into the dot operands' layouts: the values operand is then gathered from shared memory byte
    by byte, 8-bit tiles having no transposing shared-memory load, and converted a second time)."""
    if ASM:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [x.to(tl.uint8, bitcast=True)],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    else:
        y = x.to(tl.float16)
    return y


def _fold_scores_once_src(
    q_blocks,
    q_factors,
    kv_base,
    k_off,
    skv_d,
    ks_base,
    ks_off,
    sks_d,
    n_ok,
    vc,
    DOT_DTYPE: tl.constexpr,
    D_MAIN: tl.constexpr,
    N_SCALES: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    N_OWN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SCALE_W: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
    ASM: tl.constexpr,
):
    """_fold_scores with each block loaded once, as [keys, columns], and converted once: the
    converted own blocks are returned for the values dot (keys and values are one latent)."""
    qk = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    s_own = ()
    k_own = ()
    for j in tl.static_range(N_BLOCKS):
        col0 = _fold_block_col(j, vc, N_OWN, BLOCK_DV, SCALE_W)
        cols = col0 + tl.arange(0, SCALE_W)
        k = tl.load(
            kv_base + k_off[:, None] + cols[None, :] * skv_d, mask=n_ok[:, None] & (cols[None, :] < D_MAIN), other=0.0
        )
        if DOT_DTYPE == tl.float16:
            k = _e4m3_to_f16(k, ASM)
        else:
            k = k.to(DOT_DTYPE)
        block = col0 // SCALE_BLOCK
        sc = tl.load(ks_base + ks_off + block * sks_d, mask=tl.where(block < N_SCALES, n_ok, False), other=0.0)
        if IEEE:
            part = tl.dot(q_blocks[j], tl.trans(k), input_precision="ieee")
        else:
            part = tl.dot(q_blocks[j], tl.trans(k))
        qk += part * (q_factors[j][:, None] * sc[None, :])
        if j < N_OWN:
            s_own = s_own + (sc,)
            k_own = k_own + (k,)
    return qk, s_own, k_own


def _fold_values_once_src(
    accs, p, factor, s_own, k_own, DOT_DTYPE: tl.constexpr, N_OWN: tl.constexpr, IEEE: tl.constexpr
):
    """_fold_values over the tiles _fold_scores_once converted."""
    new = ()
    for j in tl.static_range(N_OWN):
        pj = (p * s_own[j][None, :]).to(DOT_DTYPE)
        acc = accs[j] * factor[:, None]
        if IEEE:
            new = new + (tl.dot(pj, k_own[j], acc, input_precision="ieee"),)
        else:
            new = new + (tl.dot(pj, k_own[j], acc),)
    return new


def _max_pair_src(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


def _fold_values_src(
    accs,
    p,
    factor,
    s_own,
    kv_base,
    k_off,
    skv_d,
    n_ok,
    vc,
    DOT_DTYPE: tl.constexpr,
    D_MAIN: tl.constexpr,
    N_OWN: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SCALE_W: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One tile's values per own column block j: ``acc_j * factor + dot(p * s_j, k8_j)``, the
    keys' scales on the columns of P (``(P s) V8 = P (s V8)``), the fp8 tile entering the dot
    as it came. It is loaded here as [keys, columns], the values dot's layout (the scores read
    the same bytes as [columns, keys]; this read hits L2)."""
    new = ()
    for j in tl.static_range(N_OWN):
        cols = vc * BLOCK_DV + j * SCALE_W + tl.arange(0, SCALE_W)
        k = tl.load(
            kv_base + k_off[:, None] + cols[None, :] * skv_d, mask=n_ok[:, None] & (cols[None, :] < D_MAIN), other=0.0
        ).to(DOT_DTYPE)
        pj = (p * s_own[j][None, :]).to(DOT_DTYPE)
        acc = accs[j] * factor[:, None]
        if IEEE:
            new = new + (tl.dot(pj, k, acc, input_precision="ieee"),)
        else:
            new = new + (tl.dot(pj, k, acc),)
    return new


def _stage1_kernel_src(
    Q,
    QT,
    KV,
    KT,
    PT,
    LENS,
    MASK,
    QPOS,
    O,
    L,
    KS,
    T,
    H,
    SH,
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
    sqt_b,
    sqt_s,
    sqt_h,
    sqt_d,
    skv_b,
    skv_t,
    skv_d,
    skt_b,
    skt_t,
    skt_d,
    sks_b,
    sks_t,
    sks_d,
    spt_b,
    spt_p,
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
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DM: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    V_SPLIT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    HAS_LENS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    MASK_SHARED: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    SCALE_BLOCK: tl.constexpr = 128,
    SCALE_W: tl.constexpr = 128,
    N_SCALES: tl.constexpr = 1,
    FP8_FOLD: tl.constexpr = False,
    FP8_FOLD_F16: tl.constexpr = True,
    KT_ALIGN: tl.constexpr = 1,
    FOLD_ONCE: tl.constexpr = False,
    CVT_ASM: tl.constexpr = False,
):
    """One (row block, value chunk, split, batch row): online softmax over the split's keys.

    MASK_SHARED: every row of the block reads the same mask row (one query token and a
    mask broadcast over heads, as a decode step's causal mask is), so one [BLOCK_N]
    vector is loaded per tile instead of a [BLOCK_H, BLOCK_N] tile.

    KV_FP8: the latent is float8 with one fp32 scale per SCALE_BLOCK columns (KS). FP8_FOLD
    reads it in column blocks of SCALE_W, the scales folded into scores and probabilities
    (_fold_scores, _fold_values), the dots in fp16 (FP8_FOLD_F16: e4m3 -> fp16 is one packed
    conversion on sm_90, e4m3 -> bf16 two, the second a slow one per value) or the queries'
    dtype; without it each tile is dequantised in fp32 (_fp8_tile). FOLD_ONCE: each block is
    loaded once, as [keys, columns], and converted once (_fold_scores_once); the converted tile,
    which the compiler keeps in shared memory, is both dots' operand (CVT_ASM: the conversion as
    inline PTX, compiled kernels only; the interpreter casts).
    KT_ALIGN: a power of two dividing every rope row's element offset (the packed fp8 rows'
    rope stride is not a multiple of 16, which the JIT's specialisation would need to see
    that the rows are 16-byte aligned).

    Writes the normalised partial output and its base-2 LSE times ``lse_scale``
    (the final output directly when NUM_SPLITS == 1). With V_SPLIT == 2 two programs
    share a row block: both compute the full scores, each accumulates one half of the
    value columns (its accumulator then fits the registers of one warpgroup).
    """
    pid0 = tl.program_id(0)
    pid_h = pid0 // V_SPLIT
    vc = pid0 % V_SPLIT
    pid_sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    BLOCK_DV: tl.constexpr = BLOCK_DM // V_SPLIT

    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < SH
    s_idx = rows // H
    h_idx = rows % H
    offs_dm = vc * BLOCK_DV + tl.arange(0, BLOCK_DV)  # this program's value columns
    dm_ok = offs_dm < D_MAIN

    FOLD: tl.constexpr = KV_FP8 and FP8_FOLD
    N_OWN: tl.constexpr = BLOCK_DV // SCALE_W  # the program's value blocks (FOLD)
    if FOLD:
        if IEEE:
            FOLD_DTYPE: tl.constexpr = tl.float32
        elif FP8_FOLD_F16:
            FOLD_DTYPE: tl.constexpr = tl.float16  # type: ignore[no-redef]  # one branch survives compilation
        else:
            FOLD_DTYPE: tl.constexpr = Q.dtype.element_ty  # type: ignore[no-redef]
        q_blocks, q_factors = _fold_q(
            Q,
            b,
            s_idx,
            h_idx,
            row_ok,
            vc,
            sq_b,
            sq_s,
            sq_h,
            sq_d,
            FOLD_DTYPE,
            D_MAIN,
            N_OWN * V_SPLIT,
            N_OWN,
            BLOCK_DV,
            SCALE_W,
        )
        # fp16 weights p * s need a unit: the accumulators count in units of c_run, the largest
        # key scale of the own blocks so far, so that p * s / c_run lies in [0, 1] (fp16's
        # range whatever the scales); a larger scale rescales them by c_old / c_new together
        # with the softmax's alpha. fp32 and bf16 have the range of any p * s.
        FOLD_UNITS: tl.constexpr = FOLD_DTYPE == tl.float16
        c_run = tl.full([BLOCK_H], 0.0 if FOLD_UNITS else 1.0, dtype=tl.float32)
        accs = ()
        for j in tl.static_range(N_OWN):
            accs = accs + (tl.zeros([BLOCK_H, SCALE_W], dtype=tl.float32),)
    else:
        q_ptrs = Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h + offs_dm[None, :] * sq_d
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dm_ok[None, :], other=0.0)
    if V_SPLIT == 2 and not FOLD:  # the other half of the main columns: scores only
        offs_do = (1 - vc) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        do_ok = offs_do < D_MAIN
        qo_ptrs = Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h + offs_do[None, :] * sq_d
        qo = tl.load(qo_ptrs, mask=row_ok[:, None] & do_ok[None, :], other=0.0)
    if HAS_TAIL:
        offs_dt = tl.arange(0, BLOCK_DT)
        dt_ok = offs_dt < D_TAIL
        qt_ptrs = QT + b * sqt_b + s_idx[:, None] * sqt_s + h_idx[:, None] * sqt_h + offs_dt[None, :] * sqt_d
        qt = tl.load(qt_ptrs, mask=row_ok[:, None] & dt_ok[None, :], other=0.0)

    if HAS_LENS:
        kv_len = shard_keys(LENS, b, lens_sb, T, lens_c, lens_r)
    else:
        kv_len = T
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_sp * split_len
    end = tl.minimum(start + split_len, kv_len)
    if CAUSAL:
        qpos = positions_i32(tl.load(QPOS + b * sqp_b + s_idx * sqp_s, mask=row_ok, other=-1))
        # keys k with k * c + r <= qmax are the only ones any row of the block can see
        end = tl.minimum(end, keys_up_to(tl.max(qpos, axis=0), cp_world, cp_rank))

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if not FOLD:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    kv_row = KV + b * skv_b
    kt_row = KT + b * skt_b
    ks_row = KS + b * sks_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if PAGED:
            page = tl.load(PT + b * spt_b + (offs_n // PAGE) * spt_p, mask=n_ok, other=0).to(tl.int64)
            in_page = (offs_n % PAGE).to(tl.int64)
            k_off = page * skv_b + in_page * skv_t
            kv_base = KV
            if KV_FP8:
                ks_off = page * sks_b + in_page * sks_t
                ks_base = KS
            if HAS_TAIL:
                kt_off = page * skt_b + in_page * skt_t
                kt_off = tl.multiple_of(kt_off, KT_ALIGN)
                kt_base = KT
        else:
            k_off = offs_n.to(tl.int64) * skv_t
            kv_base = kv_row
            if KV_FP8:
                ks_off = offs_n.to(tl.int64) * sks_t
                ks_base = ks_row
            if HAS_TAIL:
                kt_off = offs_n.to(tl.int64) * skt_t
                kt_off = tl.multiple_of(kt_off, KT_ALIGN)
                kt_base = kt_row
        if FOLD and FOLD_ONCE:
            qk, s_own, k_own = _fold_scores_once(
                q_blocks,
                q_factors,
                kv_base,
                k_off,
                skv_d,
                ks_base,
                ks_off,
                sks_d,
                n_ok,
                vc,
                FOLD_DTYPE,
                D_MAIN,
                N_SCALES,
                N_OWN * V_SPLIT,
                N_OWN,
                BLOCK_H,
                BLOCK_N,
                BLOCK_DV,
                SCALE_W,
                SCALE_BLOCK,
                IEEE,
                CVT_ASM,
            )
        elif FOLD:
            qk, s_own = _fold_scores(
                q_blocks,
                q_factors,
                kv_base,
                k_off,
                skv_d,
                ks_base,
                ks_off,
                sks_d,
                n_ok,
                vc,
                FOLD_DTYPE,
                D_MAIN,
                N_SCALES,
                N_OWN * V_SPLIT,
                N_OWN,
                BLOCK_H,
                BLOCK_N,
                BLOCK_DV,
                SCALE_W,
                SCALE_BLOCK,
                IEEE,
            )
        else:
            k = tl.load(
                kv_base + k_off[:, None] + offs_dm[None, :] * skv_d,
                mask=n_ok[:, None] & dm_ok[None, :],
                other=0.0,
            )
            if KV_FP8:  # the latent tile in the queries' dtype: fp8 * its block's fp32 scale
                k = _fp8_tile(
                    k, ks_base, ks_off, sks_d, vc * BLOCK_DV, n_ok, N_SCALES, BLOCK_N, BLOCK_DV, SCALE_W, SCALE_BLOCK
                ).to(Q.dtype.element_ty)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
        if V_SPLIT == 2 and not FOLD:
            ko = tl.load(
                kv_base + k_off[:, None] + offs_do[None, :] * skv_d,
                mask=n_ok[:, None] & do_ok[None, :],
                other=0.0,
            )
            if KV_FP8:
                ko = _fp8_tile(
                    ko,
                    ks_base,
                    ks_off,
                    sks_d,
                    (1 - vc) * BLOCK_DV,
                    n_ok,
                    N_SCALES,
                    BLOCK_N,
                    BLOCK_DV,
                    SCALE_W,
                    SCALE_BLOCK,
                ).to(Q.dtype.element_ty)
            if IEEE:
                qk = tl.dot(qo, tl.trans(ko), qk, input_precision="ieee")
            else:
                qk = tl.dot(qo, tl.trans(ko), qk)
        if HAS_TAIL:
            kt = tl.load(
                kt_base + kt_off[:, None] + offs_dt[None, :] * skt_d,
                mask=n_ok[:, None] & dt_ok[None, :],
                other=0.0,
            )
            if IEEE:
                qk = tl.dot(qt, tl.trans(kt), qk, input_precision="ieee")
            else:
                qk = tl.dot(qt, tl.trans(kt), qk)
        qk = qk * sm_scale_log2
        valid = n_ok[None, :]
        if HAS_MASK and MASK_SHARED:
            mk = tl.load(MASK + b * sm_b + offs_n * sm_t, mask=n_ok, other=0.0)
            qk = qk + mk[None, :] * 1.4426950408889634
        elif HAS_MASK:
            mk = tl.load(
                MASK + b * sm_b + s_idx[:, None] * sm_s + h_idx[:, None] * sm_h + offs_n[None, :] * sm_t,
                mask=row_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            qk = qk + mk * 1.4426950408889634
        if CAUSAL:
            valid = valid & ((offs_n[None, :] * cp_world + cp_rank) <= qpos[:, None])
        qk = tl.where(valid, qk, float("-inf"))
        if FOLD and FOLD_UNITS:
            # the largest key scale of the tile's own blocks comes out of the softmax's own
            # reduction over the keys (one cross-warp reduction, not one more per block)
            s_big = s_own[0]
            for j in tl.static_range(1, N_OWN):
                s_big = tl.maximum(s_big, s_own[j])
            m_tile, c_tile = tl.reduce((qk, tl.broadcast_to(s_big[None, :], qk.shape)), 1, _max_pair)
            m_new = tl.maximum(m_i, m_tile)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FOLD:
            if FOLD_UNITS:
                c_new = tl.maximum(c_run, c_tile)
                inv = 1.0 / tl.where(c_new > 0.0, c_new, 1.0)
                if FOLD_ONCE:
                    accs = _fold_values_once(
                        accs, p * inv[:, None], alpha * (c_run * inv), s_own, k_own, FOLD_DTYPE, N_OWN, IEEE
                    )
                else:
                    accs = _fold_values(
                        accs,
                        p * inv[:, None],
                        alpha * (c_run * inv),
                        s_own,
                        kv_base,
                        k_off,
                        skv_d,
                        n_ok,
                        vc,
                        FOLD_DTYPE,
                        D_MAIN,
                        N_OWN,
                        BLOCK_DV,
                        SCALE_W,
                        IEEE,
                    )
                c_run = c_new
            elif FOLD_ONCE:
                accs = _fold_values_once(accs, p, alpha, s_own, k_own, FOLD_DTYPE, N_OWN, IEEE)
            else:
                accs = _fold_values(
                    accs,
                    p,
                    alpha,
                    s_own,
                    kv_base,
                    k_off,
                    skv_d,
                    n_ok,
                    vc,
                    FOLD_DTYPE,
                    D_MAIN,
                    N_OWN,
                    BLOCK_DV,
                    SCALE_W,
                    IEEE,
                )
        else:
            acc = acc * alpha[:, None]
            if IEEE:
                acc = tl.dot(p.to(k.dtype), k, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(k.dtype), k, acc)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)) * lse_scale
    o_row = O + b * so_b + pid_sp * so_sp + s_idx[:, None] * so_s + h_idx[:, None] * so_h
    if FOLD:
        for j in tl.static_range(N_OWN):
            cols = vc * BLOCK_DV + j * SCALE_W + tl.arange(0, SCALE_W)
            o = accs[j] * (c_run / l_safe)[:, None]
            tl.store(
                o_row + cols[None, :] * so_d, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < D_V)
            )
    else:
        o = acc / l_safe[:, None]
        tl.store(
            o_row + offs_dm[None, :] * so_d, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dm[None, :] < D_V)
        )
    tl.store(L + b * sl_b + pid_sp * sl_sp + s_idx * sl_s + h_idx * sl_h, lse, mask=row_ok & ((rows * 0 + vc) == 0))


if HAS_TRITON:
    _fp8_tile = triton.jit(_fp8_tile_src)
    _fold_block_col = triton.jit(_fold_block_col_src)
    _fold_q = triton.jit(_fold_q_src)
    _fold_scores = triton.jit(_fold_scores_src)
    _fold_values = triton.jit(_fold_values_src)
    _e4m3_to_f16 = triton.jit(_e4m3_to_f16_src)
    _fold_scores_once = triton.jit(_fold_scores_once_src)
    _fold_values_once = triton.jit(_fold_values_once_src)
    _max_pair = triton.jit(_max_pair_src)
    _stage1_jit = triton.jit(_stage1_kernel_src)


# --------------------------------------------------------------------------------------
# launch configuration (shape-derived only)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLAKernelConfig:
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    v_split: int = 1
    max_regs: Optional[int] = None  # registers per thread at most (None: the compiler's choice)

    # the registry's kernels this configures (registry.KERNELS names)
    kernels = ("split",)


# Per head-rows bucket: (block_h, block_n, warps, stages, v_split, waves). Resource use
# is checked offline for sm_90 (docs/kernels.md, "Checking a kernel offline").
# rows <= 16 is memory-bound (mma.sync tile, no spills); wider blocks are compute-bound:
# a 64-row wgmma tile, its [64, 512] fp32 accumulator split over two programs
# (v_split=2) so that one warpgroup holds it without spilling.
_TUNED = {  # winners of bench_kernel.py --sweep on an H200 (benchmarks/results/tuned_h200.json)
    16: (16, 64, 4, 2, 1, 2.0),
    32: (32, 32, 4, 2, 1, 2.0),
    64: (64, 64, 4, 2, 2, 1.0),
}


# An fp8 latent read by folding its scales (FP8_FOLD) holds per column block an accumulator
# and the block's partial scores: at 64 rows the tile above then spills on sm_90 (offline,
# benchmarks/offline_fp8.py: 1184 bytes of stack), this one fits (none); the 16- and 32-row
# tiles fit as they are (255 registers, no stack: two programs per SM, as for bf16).
_TUNED_FP8_FOLD = {
    64: (64, 32, 8, 2, 2, 1.0),
}

# The fold_once read keeps each tile's converted fp16 blocks in shared memory until the values
# dot ([block_n, 512] fp16 beside the pipelined fp8 stages): at 16 rows a 64-key tile takes
# 125 KiB (one program per SM), a 32-key tile 71 KiB, and capped at 168 registers (no spills,
# offline sm_90) three programs share an SM, as many warps as bf16's two. The seventh field is
# that cap (None: the compiler's choice).
_TUNED_FP8_ONCE = {
    16: (16, 32, 4, 2, 1, 3.0, 168),
    32: (32, 32, 8, 2, 1, 2.0),
}


def _bucket(rows: int) -> int:
    """The tuned tables' row bucket of a call with `rows` (query token, head) rows."""
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


def _load_tuning_override() -> None:
    """DCP_MLA_TUNED=path.json replaces entries of _TUNED (used by the benchmarks)."""
    import json
    import os

    from dcp_pass import env

    path = env.mla_tuned()
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        for k, v in json.load(f).items():
            _TUNED[int(k)] = tuple(v)


_load_tuning_override()


def _smem_limit(device: torch.device) -> int:
    """Opt-in shared memory per block (227 KiB on H100/H200), less a margin for Triton's scratch."""
    return int(getattr(cuda_properties(device), "shared_memory_per_block_optin", 232448)) - 8192


def smem_estimate(
    block_h: int,
    block_n: int,
    stages: int,
    bdm: int,
    bdt: int,
    elem: int,
    has_mask: bool = False,
    paged: bool = False,
    mask_shared: bool = False,
) -> int:
    """Upper estimate of stage 1's shared memory: pipelined KV (+mask, +page ids) tiles and Q.

    Matches the compiler's figure for the 512 + 64 bf16 configs checked offline
    and errs high when a mask is pipelined too.
    """
    kv = stages * block_n * (bdm + bdt) * elem
    q = block_h * (bdm + bdt) * elem
    mask_tile = block_n * 4 * (1 if mask_shared else block_h)
    extra = (stages * mask_tile if has_mask else 0) + (stages * block_n * 8 if paged else 0)
    return kv + q + extra


def pick_config(
    rows: int,
    d_main: int,
    d_tail: int,
    batch: int,
    t_cap: int,
    device: torch.device,
    num_splits: Optional[int] = None,
    *,
    has_mask: bool = False,
    mask_shared: bool = False,
    paged: bool = False,
    elem_bytes: int = 2,
    fp8_fold: bool = False,
    fp8_once: bool = False,
) -> MLAKernelConfig:
    """Launch parameters from shapes only (no host sync, safe under CUDA-graph capture).

    The tuned tile (``fp8_fold``: an fp8 latent read by folding its scales, ``fp8_once``: by
    the fold_once read, their own tiles where they differ) is shrunk (block_n, then stages,
    then block_h) until its shared memory fits the device: a mask's tiles are pipelined too,
    and fp32 caches double every tile. A shrunk tile drops the tuned register cap (it was
    checked for the tuned tile only).
    """
    if device.type != "cuda":  # interpreter: small blocks, a few splits to exercise stage 2
        block_h = min(pow2(rows), 32)
        block_n = 16
        ns = num_splits if num_splits is not None else max(1, min(3, triton.cdiv(max(t_cap, 1), block_n)))
        return MLAKernelConfig(block_h, block_n, 4, 1, ns)
    bucket = _bucket(rows)
    tuned = (
        (_TUNED_FP8_ONCE.get(bucket) if fp8_once else None)
        or (_TUNED_FP8_FOLD.get(bucket) if fp8_fold else None)
        or _TUNED[bucket]
    )
    block_h, block_n, warps, stages, v_split, waves = tuned[:6]
    max_regs = tuned[6] if len(tuned) > 6 else None
    bdm, bdt = pow2(d_main), pow2(max(d_tail, 1)) if d_tail else 0
    limit = _smem_limit(device)
    fits = lambda bh, bn, st: smem_estimate(bh, bn, st, bdm, bdt, elem_bytes, has_mask, paged, mask_shared) <= limit  # noqa: E731
    if not fits(block_h, block_n, stages):
        cands = [
            (block_h, 32, 3),
            (block_h, 32, 2),
            (block_h, 16, 3),
            (block_h, 16, 2),
            (16, 32, 2),
            (16, 16, 2),
            (16, 16, 1),
        ]
        block_h, block_n, stages = next((c for c in cands if c[0] <= block_h and fits(*c)), cands[-1])
        if block_h == 16:
            v_split, warps = 1, 4
        max_regs = None
    n_hb = triton.cdiv(rows, block_h) * v_split
    ns = num_splits if num_splits is not None else split_count(batch, n_hb, t_cap, device, waves)
    return MLAKernelConfig(block_h, block_n, warps, stages, max(1, int(ns)), v_split, max_regs)


# --------------------------------------------------------------------------------------
# Triton entry points
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the split kernel cannot run a call of this shape (None: it can): any dense or
    paged call of the Triton layouts (common.triton_reason), fp8 latent caches too."""
    return triton_reason(shape, fp8=True)


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[MLAKernelConfig] = None,
):
    """The registry's entry: the fused split-KV path; ``config`` replaces the shape-derived
    launch parameters, ``num_splits`` the split count."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable")
    view = call.shard()
    if view.paged:
        if view.kv.dim() != 3:
            raise ValueError(f"kv_pool must be [num_pages, P, Dk], got {tuple(view.kv.shape)}")
        if view.page_table.dim() != 2 or view.page_table.shape[0] != view.q_lat.shape[0]:
            raise ValueError(f"page_table must be [B, max_pages], got {tuple(view.page_table.shape)}")
    return _launch(view, out, lse_out, num_splits, config)


def _launch(a: ShardView, out, lse_out, num_splits, config):
    """The fused split-KV path (contiguous or paged cache): stage 1, then stage 2 when split."""
    base = check_base(a.lse_base)
    q_lat, kv, page_table, page_size, v_dim = a.q_lat, a.kv, a.page_table, a.page_size, a.v_dim
    scale, mask, kv_lens, causal = a.scale, a.mask, a.kv_lens, a.causal
    parts = a.parts()
    B, S, H, _ = q_lat.shape
    paged = page_table is not None
    T = page_table.shape[1] * page_size if paged else kv.shape[1]
    device = q_lat.device
    out, lse_out, done = outputs(q_lat, v_dim, out, lse_out, T == 0 or (paged and kv.shape[0] == 0))
    if done:
        return out, lse_out
    SH = S * H

    d_main = parts.q_main.shape[-1]
    d_tail = parts.q_tail.shape[-1] if parts.q_tail is not None else 0
    mask_b, ms, mask_shared = mask_operand(mask, B, S, H, T, device)
    read = fp8_read("split") if a.kv_scale is not None else ""
    # fold_once where its tiles are checked (rows <= 32: at 64 rows its converted blocks spill
    # on sm_90, offline); other calls read as fold
    once = read == "fold_once" and _bucket(SH) in _TUNED_FP8_ONCE
    if config is None:
        # an fp8 tile enters the dots in a 16-bit (or the queries') dtype: size the tiles as
        # for a cache of that dtype
        elem = q_lat.element_size() if a.kv_scale is not None else kv.element_size()
        cfg = pick_config(
            SH,
            d_main,
            d_tail,
            B,
            T,
            device,
            num_splits,
            has_mask=mask is not None,
            mask_shared=mask_shared,
            paged=paged,
            elem_bytes=elem,
            fp8_fold=read.startswith("fold"),
            fp8_once=once,
        )
    else:
        cfg = config if num_splits is None else replace(config, num_splits=num_splits)
    ns = cfg.num_splits
    check_launchable(
        device,
        kv_lens,
        "the split kernel",
        fp8_dots_dtype(read, q_lat.dtype, d_tail > 0) if a.kv_scale is not None else kv.dtype,
    )

    dummy = kv  # any tensor: pointer for absent optional operands (never dereferenced)
    has_tail = parts.q_tail is not None
    qt = parts.q_tail if has_tail else dummy
    kt = parts.k_tail if has_tail else dummy
    qts = parts.q_tail.stride() if has_tail else (0, 0, 0, 0)
    kts = parts.k_tail.stride() if has_tail else (0, 0, 0)
    pt, pts = (page_table, page_table.stride()) if paged else (dummy, (0, 0))
    lens, lens_sb, lens_c, lens_r = lens_operand(kv_lens, a.lens_stripe, B, dummy)
    q_pos, qps, cp_world, cp_rank = causal_operand(causal, B, S, dummy)

    o_part, l_part, ops, lps, l_scale = partial_outputs(out, lse_out, ns, H, base)
    fp8 = a.kv_scale is not None
    # an fp8 latent is dequantised into the queries' dtype: the dots run in that dtype
    is_f32 = (q_lat.dtype if fp8 else kv.dtype) == torch.float32
    ks, kss = (a.kv_scale, a.kv_scale.stride()) if fp8 else (dummy, (0, 0, 0))

    v_split = cfg.v_split if (pow2(d_main) == d_main and d_main >= 32) else 1
    grid = (triton.cdiv(SH, cfg.block_h) * v_split, ns, B)
    launch(
        _stage1_jit,
        grid,
        (
            parts.q_main,
            qt,
            parts.k_main,
            kt,
            pt,
            lens,
            mask_b if mask_b is not None else dummy,
            q_pos,
            o_part,
            l_part,
            ks,
            T,
            H,
            SH,
            cp_world,
            cp_rank,
            float(scale) * LOG2E,
            l_scale,
            lens_sb,
            lens_c,
            lens_r,
            *parts.q_main.stride(),
            *qts,
            *parts.k_main.stride(),
            *kts,
            *kss,
            *pts,
            *ms,
            *qps,
            *ops,
            *lps,
        ),
        dict(
            D_MAIN=d_main,
            D_TAIL=d_tail,
            D_V=v_dim,
            BLOCK_H=cfg.block_h,
            BLOCK_N=cfg.block_n,
            BLOCK_DM=pow2(d_main),
            BLOCK_DT=pow2(max(d_tail, 1)),
            V_SPLIT=v_split,
            NUM_SPLITS=ns,
            PAGE=page_size if paged else 1,
            PAGED=paged,
            HAS_TAIL=has_tail,
            HAS_LENS=kv_lens is not None,
            HAS_MASK=mask_b is not None,
            CAUSAL=causal is not None,
            IEEE=is_f32,
            MASK_SHARED=mask_shared,
            KV_FP8=fp8,
            SCALE_W=min(SCALE_BLOCK, pow2(d_main) // v_split),
            N_SCALES=-(-d_main // SCALE_BLOCK),
            FP8_FOLD=read.startswith("fold"),
            FP8_FOLD_F16=read in FOLD_F16_READS,
            KT_ALIGN=row_alignment(kt, paged) if has_tail else 1,
            FOLD_ONCE=once,
            CVT_ASM=not INTERPRETED,
        ),
        cfg.num_warps,
        cfg.num_stages,
        cfg.max_regs,
    )
    if ns > 1:
        kernel, grid, args, consts, warps = reduce_launch(o_part, l_part, out, lse_out, H, base, v_dim, ns)
        launch(kernel, grid, args, consts, warps)
    return out, lse_out
