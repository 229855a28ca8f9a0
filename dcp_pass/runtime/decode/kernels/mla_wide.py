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

from .common import (HAS_TRITON, LOG2E, AttentionCall, ShardView, causal_operand, check_base, check_launchable,
                     keys_up_to, launch, lens_operand, mask_operand, outputs, positions_i32, pow2, shard_keys,
                     triton_reason)
from .splits import partial_outputs, reduce_launch, split_count
from ..call import KV_SCALE_BLOCK as SCALE_BLOCK

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
def _visible_end_src(LENS, QPOS, b, T, S, cp_world, cp_rank, lens_sb, lens_c, lens_r, sqp_b, sqp_s,
                     BLOCK_S: tl.constexpr, HAS_LENS: tl.constexpr, CAUSAL: tl.constexpr):
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


def _scores_kernel_src(
    Q, QT, K, KT, LENS, MASK, QPOS, P, MT, LT, KS,
    T, H, SH, S, cp_world, cp_rank, sm_scale_log2, lens_sb, lens_c, lens_r,
    sq_b, sq_s, sq_h, sq_d,
    sqt_b, sqt_s, sqt_h, sqt_d,
    sk_b, sk_t, sk_d,
    skt_b, skt_t, skt_d,
    sks_b, sks_t, sks_d,
    sm_b, sm_s, sm_h, sm_t,
    sqp_b, sqp_s,
    sp_b, sp_t, sp_r,
    sml_b, sml_t,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KT: tl.constexpr,
    BLOCK_S: tl.constexpr, N_RB: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_LENS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
    IEEE: tl.constexpr, MASK_SHARED: tl.constexpr,
    KV_FP8: tl.constexpr = False, SCALE_BLOCK: tl.constexpr = 128,
):
    """One (row block, key tile, batch row): P = exp2(s - m_tile), m_tile, l_tile.

    KV_FP8: K is an fp8 latent; each BLOCK_K column chunk lies inside one block of
    SCALE_BLOCK columns, so it is read as k * its rows' scale of that block ([BLOCK_N] per chunk).

    MASK_SHARED: all rows read one mask row (a mask broadcast over heads and query
    tokens), loaded once as a [BLOCK_N] vector.
    """
    pid = tl.program_id(0)
    rb = pid % N_RB
    tile = pid // N_RB
    b = tl.program_id(1).to(tl.int64)

    end = _visible_end(LENS, QPOS, b, T, S, cp_world, cp_rank, lens_sb, lens_c, lens_r, sqp_b, sqp_s,
                       BLOCK_S, HAS_LENS, CAUSAL)
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

    q_ptrs = Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h + offs_k[None, :] * sq_d
    k_ptrs = K + b * sk_b + offs_n[:, None].to(tl.int64) * sk_t + offs_k[None, :] * sk_d
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D_MAIN, BLOCK_K):
        if D_MAIN % BLOCK_K == 0:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            d_ok = (d0 + offs_k) < D_MAIN
            q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_FP8:
            k_scale = tl.load(KS + b * sks_b + offs_n.to(tl.int64) * sks_t + (d0 // SCALE_BLOCK) * sks_d, mask=n_ok,
                              other=0.0)
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
        kt_ptrs = KT + b * skt_b + offs_n[:, None].to(tl.int64) * skt_t + offs_kt[None, :] * skt_d
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
    P, MT, LT, V, LENS, QPOS, O, L, KS,
    T, H, SH, S, cp_world, cp_rank, lse_scale, lens_sb, lens_c, lens_r,
    sp_b, sp_t, sp_r,
    sml_b, sml_t,
    sv_b, sv_t, sv_d,
    sks_b, sks_t, sks_d,
    sqp_b, sqp_s,
    so_b, so_sp, so_s, so_h, so_d,
    sl_b, sl_sp, sl_s, sl_h,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_MT: tl.constexpr,
    BLOCK_S: tl.constexpr, N_RB: tl.constexpr, N_VC: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_LENS: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    KV_FP8: tl.constexpr = False, SCALE_BLOCK: tl.constexpr = 128,
):
    """One (row block, value chunk, split, batch row): sum_t (P_t * exp2(m_t - m)) @ V_t.

    KV_FP8: V is an fp8 latent whose BLOCK_V value chunk lies inside one block of SCALE_BLOCK
    columns: each token's scale multiplies its column of P instead of its row of V
    (``(P * s) @ V8 = P @ (s * V8)``), and the fp8 values enter the dot exactly as 16-bit."""
    pid = tl.program_id(0)
    rb = pid % N_RB
    vc = (pid // N_RB) % N_VC
    sp = pid // (N_RB * N_VC)
    b = tl.program_id(1).to(tl.int64)

    end = _visible_end(LENS, QPOS, b, T, S, cp_world, cp_rank, lens_sb, lens_c, lens_r, sqp_b, sqp_s,
                       BLOCK_S, HAS_LENS, CAUSAL)
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
    p_ptrs = P + b * sp_b + rows[:, None] * sp_r + offs_c[None, :]
    m_ptrs = MT + b * sml_b + rows
    v_row = V + b * sv_b + offs_v[None, :] * sv_d
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        f = tl.exp2(tl.load(m_ptrs + t * sml_t) - m_use)
        p = tl.load(p_ptrs + t * sp_t).to(tl.float32) * f[:, None]
        offs_n = t * BLOCK_N + offs_c
        v = tl.load(v_row + offs_n[:, None].to(tl.int64) * sv_t, mask=(offs_n < end)[:, None] & v_ok[None, :],
                    other=0.0)
        if KV_FP8:
            v_scale = tl.load(KS + b * sks_b + offs_n.to(tl.int64) * sks_t + ((vc * BLOCK_V) // SCALE_BLOCK) * sks_d,
                              mask=offs_n < end, other=0.0)
            p = p * v_scale[None, :]
            v = v.to(O.dtype.element_ty)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)

    empty = l_run == 0.0
    l_safe = tl.where(empty, 1.0, l_run)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_use + tl.log2(l_safe)) * lse_scale
    o_ptrs = O + b * so_b + sp * so_sp + s_idx[:, None] * so_s + h_idx[:, None] * so_h + offs_v[None, :] * so_d
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
    tl.store(L + b * sl_b + sp * sl_sp + s_idx * sl_s + h_idx * sl_h, lse, mask=row_ok & ((rows * 0 + vc) == 0))


if HAS_TRITON:
    _visible_end = triton.jit(_visible_end_src)  # called by both kernels (a global looked up when they compile)
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
        return (f"A{self.block_m}x{self.block_n}x{self.block_k}/{self.warps_a}w/{self.stages_a}s "
                f"B{self.block_m}x{self.block_n}x{self.block_v}/{self.warps_b}w/{self.stages_b}s x{self.waves:g}")


# Default for the compute-bound case (16-bit caches). Resource use checked offline for sm_90
# (benchmarks/offline_wide.py).
WIDE_DEFAULT = WideConfig()
# Fewest (query token, head) rows for which the dispatcher prefers this path. At 64 rows
# (64 heads, between the two regimes) the wide path measured 0.95x the fused kernel on an
# H200; at 128 rows 1.32-1.35x (benchmarks/results/kernel_v4_wide_h200.json).
WIDE_MIN_ROWS = 128


def pick_wide_config(rows: int, d_main: int, d_tail: int, d_v: int, batch: int, t_cap: int,
                     device: torch.device, num_splits: Optional[int] = None, *, elem_bytes: int = 2,
                     base: Optional[WideConfig] = None, fp8: bool = False) -> WideConfig:
    """From shapes only. The interpreter gets small tiles and a few splits (tests). ``fp8``:
    value chunks of at most one scale block (the values kernel scales P per chunk)."""
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
    if elem_bytes == 4:  # fp32 caches: halve what is pipelined
        block_v, block_n = min(block_v, 128), min(block_n, 64)
        stages_a, stages_b = min(stages_a, 2), min(stages_b, 2)
    ns = num_splits if num_splits is not None else cfg.num_splits
    if ns is None:
        n_prog = triton.cdiv(rows, block_m) * triton.cdiv(d_v, block_v)
        ns = split_count(batch, n_prog, t_cap, device, cfg.waves, min_tokens=max(256, 4 * block_n))
    return WideConfig(block_m, block_n, cfg.block_k, warps_a, stages_a, block_v, warps_b, stages_b,
                      max(1, int(ns)), cfg.waves)


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
    return (a.stride() == b.stride() and a.dtype == b.dtype
            and b.data_ptr() == a.data_ptr() + width * a.stride(-1) * a.element_size())


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


def plan(a: ShardView, out, lse_out, cfg: WideConfig):
    """The launches of one call (kernel A, kernel B, and the split merge when splits > 1)."""
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
        raise ValueError(f"the wide kernel reads an fp8 latent in column chunks inside one scale block of "
                         f"{SCALE_BLOCK}: block_k={cfg.block_k} and block_v={cfg.block_v} must divide it")
    # P in the dtype of the dots: the queries' for an fp8 latent
    p_buf = torch.empty(B, NT, rows_pad, BN, dtype=q_lat.dtype if fp8 else kv.dtype, device=device)
    m_buf = torch.empty(B, NT, rows_pad, dtype=torch.float32, device=device)
    l_buf = torch.empty(B, NT, rows_pad, dtype=torch.float32, device=device)

    mask_b, ms, mask_shared = mask_operand(mask, B, S, H, T, device)
    q_pos, qps, cp_world, cp_rank = causal_operand(causal, B, S, dummy)
    lens, lens_sb, lens_c, lens_r = lens_operand(kv_lens, a.lens_stripe, B, dummy)
    is_f32 = (q_lat.dtype if fp8 else kv.dtype) == torch.float32
    block_s = pow2(S, 2)
    ks, kss = (a.kv_scale, a.kv_scale.stride()) if fp8 else (dummy, (0, 0, 0))

    launches = [_Launch(
        _scores_jit, (n_rb * NT, B),
        [q_a, qt if has_tail else dummy, k_a, kt if has_tail else dummy, lens,
         mask_b if mask_b is not None else dummy, q_pos, p_buf, m_buf, l_buf, ks,
         T, H, SH, S, cp_world, cp_rank, float(scale) * LOG2E, lens_sb, lens_c, lens_r,
         *q_a.stride(), *qts, *k_a.stride(), *kts, *kss, *ms, *qps,
         p_buf.stride(0), p_buf.stride(1), p_buf.stride(2),
         m_buf.stride(0), m_buf.stride(1)],
        dict(D_MAIN=d_a, D_TAIL=d_t,
             BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=cfg.block_k, BLOCK_KT=max(16, min(cfg.block_k, pow2(max(d_t, 1)))),
             BLOCK_S=block_s, N_RB=n_rb,
             HAS_TAIL=has_tail, HAS_LENS=kv_lens is not None, HAS_MASK=mask_b is not None,
             CAUSAL=causal is not None, IEEE=is_f32, MASK_SHARED=mask_shared, KV_FP8=fp8),
        cfg.warps_a, cfg.stages_a)]

    o_part, l_part, ops, lps, l_scale = partial_outputs(out, lse_out, ns, H, base)
    v = kv  # values: the first v_dim columns of the cache
    launches.append(_Launch(
        _values_jit, (n_rb * n_vc * ns, B),
        [p_buf, m_buf, l_buf, v, lens, q_pos, o_part, l_part, ks,
         T, H, SH, S, cp_world, cp_rank, l_scale, lens_sb, lens_c, lens_r,
         p_buf.stride(0), p_buf.stride(1), p_buf.stride(2),
         m_buf.stride(0), m_buf.stride(1),
         *v.stride(), *kss, *qps, *ops, *lps],
        dict(D_V=v_dim, BLOCK_M=BM, BLOCK_N=BN, BLOCK_V=cfg.block_v, BLOCK_MT=32,
             BLOCK_S=block_s, N_RB=n_rb, N_VC=n_vc, NUM_SPLITS=ns,
             HAS_LENS=kv_lens is not None, CAUSAL=causal is not None, IEEE=is_f32, KV_FP8=fp8),
        cfg.warps_b, cfg.stages_b))
    if ns > 1:
        kernel, grid, args, consts, warps = reduce_launch(o_part, l_part, out, lse_out, H, base, v_dim, ns)
        launches.append(_Launch(kernel, grid, list(args), consts, warps, 3))
    return launches


def run(call: AttentionCall, out=None, lse_out=None, *, num_splits: Optional[int] = None,
        config: Optional[WideConfig] = None):
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
    check_launchable(device, kv_lens, "the wide kernel", q_lat.dtype if fp8 else kv.dtype)
    d_main = parts.q_main.shape[-1]
    d_tail = parts.q_tail.shape[-1] if parts.q_tail is not None else 0
    if config is not None and device.type != "cuda":  # interpreter: the given tiles as they are
        ns = num_splits or config.num_splits or pick_wide_config(SH, d_main, d_tail, v_dim, B, T, device).num_splits
        cfg = replace(config, num_splits=ns)
    else:
        cfg = pick_wide_config(SH, d_main, d_tail, v_dim, B, T, device, num_splits,
                               elem_bytes=kv.element_size(), base=config, fp8=fp8)
    for step in plan(a, out, lse_out, cfg):
        step()
    return out, lse_out
