"""One-read MLA decode kernel: each latent KV tile is read once and serves both GEMMs.

For wide head blocks (64 rows of (query token, head) per program, all 512 value columns
in one program, 8 warps = two warpgroups), as FlashMLA does: the latent tile ``kv[n, :512]``
is the keys of ``q . k`` and the values of ``p @ v``, loaded into shared memory once.

Why a scratch hand-off. Triton gives a dot whose result reaches another dot (through
SSA values) the "chained" layout: all warps along the rows. With 64 rows and 8 warps both
warpgroups then compute the same scores, and the [64, 512] fp32 accumulator does not fit
one warpgroup (docs/kernel_notes.md, v1). Without the chain, each dot gets warps
[4, 2]: the two warpgroups split the columns, so each holds [64, 256] of the accumulator
and half of every score tile. So the probabilities ``p`` (in the cache dtype) and the
rescale factor ``alpha`` of each tile go through a per-program scratch in global memory
(L2-resident, 2 x [64, BLOCK_N] x 2 B): stored after the softmax, a barrier, loaded back
(volatile, so the pipeliner does not prefetch them ahead of their store) as the value
GEMM's operand. The scratch is double-buffered by tile parity, so one barrier per tile
suffices: a buffer is rewritten two tiles later, after every warp passed the barrier
that follows its last read.

Same contract and partial-output format as the split-KV kernel (``mla_attention``):
lengths on the device (``kv_lens`` with ``lens_stripe``), additive mask, causal cap, base-2
partials merged by ``splits.reduce_launch``. Split counts from shapes only: capturable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .common import HAS_TRITON, LOG2E, MlaArgs, causal_operand, check_base, check_launchable, launch, lens_operand, \
    mask_operand, outputs, pow2
from .splits import partial_outputs, reduce_launch, split_count

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["OneReadConfig", "oneread_supported", "launch_oneread", "pick_oneread_config"]


def _oneread_kernel_src(
    Q, QT, KV, KT, LENS, MASK, QPOS, O, L, SP, SA,
    T, H, SH, cp_world, cp_rank, sm_scale_log2, lse_scale, lens_sb, lens_c, lens_r,
    sq_b, sq_s, sq_h, sq_d,
    sqt_b, sqt_s, sqt_h, sqt_d,
    skv_b, skv_t, skv_d,
    skt_b, skt_t, skt_d,
    sm_b, sm_s, sm_h, sm_t,
    sqp_b, sqp_s,
    so_b, so_sp, so_s, so_h, so_d,
    sl_b, sl_sp, sl_s, sl_h,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, D_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DT: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_LENS: tl.constexpr,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, MASK_SHARED: tl.constexpr,
):
    """One (row block, split, batch row): online softmax over the split's keys, all value columns."""
    pid_h = tl.program_id(0)
    pid_sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    prog = (b * NUM_SPLITS + pid_sp) * tl.num_programs(0) + pid_h

    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < SH
    s_idx = rows // H
    h_idx = rows % H
    offs_dm = tl.arange(0, D_MAIN)

    q = tl.load(Q + b * sq_b + s_idx[:, None] * sq_s + h_idx[:, None] * sq_h + offs_dm[None, :] * sq_d,
                mask=row_ok[:, None], other=0.0)
    if HAS_TAIL:
        offs_dt = tl.arange(0, BLOCK_DT)
        dt_ok = offs_dt < D_TAIL
        qt = tl.load(QT + b * sqt_b + s_idx[:, None] * sqt_s + h_idx[:, None] * sqt_h + offs_dt[None, :] * sqt_d,
                     mask=row_ok[:, None] & dt_ok[None, :], other=0.0)

    if HAS_LENS:
        kv_len = tl.minimum((tl.maximum(tl.load(LENS + b * lens_sb).to(tl.int32), 0) + (lens_c - 1 - lens_r)) // lens_c, T)
    else:
        kv_len = T
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_sp * split_len
    end = tl.minimum(start + split_len, kv_len)
    if CAUSAL:
        qpos = tl.load(QPOS + b * sqp_b + s_idx * sqp_s, mask=row_ok, other=-1)
        qmax = tl.max(qpos, axis=0)
        kcap = tl.where(qmax >= cp_rank, (qmax - cp_rank) // cp_world + 1, 0)
        end = tl.minimum(end, kcap.to(tl.int32))

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_MAIN], dtype=tl.float32)

    loc_h = tl.arange(0, BLOCK_H)
    loc_n = tl.arange(0, BLOCK_N)
    sp_base = SP + prog * (2 * BLOCK_H * BLOCK_N) + loc_h[:, None] * BLOCK_N + loc_n[None, :]
    sa_base = SA + prog * (2 * BLOCK_H) + loc_h
    kv_row = KV + b * skv_b
    kt_row = KT + b * skt_b
    parity = 0
    # the barrier below stops Triton's software pipelining, so the next tile is loaded into
    # registers one iteration ahead by hand (its latency hides behind this tile's GEMMs)
    nx_ok = (start + loc_n) < end
    k_nx = tl.load(kv_row + (start + loc_n).to(tl.int64)[:, None] * skv_t + offs_dm[None, :] * skv_d,
                   mask=nx_ok[:, None], other=0.0)
    if HAS_TAIL:
        kt_nx = tl.load(kt_row + (start + loc_n).to(tl.int64)[:, None] * skt_t + offs_dt[None, :] * skt_d,
                        mask=nx_ok[:, None] & dt_ok[None, :], other=0.0)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + loc_n
        n_ok = offs_n < end
        k = k_nx
        nx = offs_n + BLOCK_N
        nx_ok = nx < end
        k_nx = tl.load(kv_row + nx.to(tl.int64)[:, None] * skv_t + offs_dm[None, :] * skv_d,
                       mask=nx_ok[:, None], other=0.0)
        if HAS_TAIL:
            kt = kt_nx
            kt_nx = tl.load(kt_row + nx.to(tl.int64)[:, None] * skt_t + offs_dt[None, :] * skt_d,
                            mask=nx_ok[:, None] & dt_ok[None, :], other=0.0)
            qk = tl.dot(qt, tl.trans(kt))
            qk = tl.dot(q, tl.trans(k), qk)
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * sm_scale_log2
        valid = n_ok[None, :]
        if HAS_MASK and MASK_SHARED:
            mk = tl.load(MASK + b * sm_b + offs_n * sm_t, mask=n_ok, other=0.0)
            qk = qk + mk[None, :] * 1.4426950408889634
        elif HAS_MASK:
            mk = tl.load(MASK + b * sm_b + s_idx[:, None] * sm_s + h_idx[:, None] * sm_h + offs_n[None, :] * sm_t,
                         mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            qk = qk + mk * 1.4426950408889634
        if CAUSAL:
            valid = valid & ((offs_n[None, :] * cp_world + cp_rank) <= qpos[:, None])
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # hand p and alpha to the value GEMM through memory (see the module docstring)
        tl.store(sp_base + parity * (BLOCK_H * BLOCK_N), p.to(k.dtype))
        tl.store(sa_base + parity * BLOCK_H, alpha)
        tl.debug_barrier()
        p_v = tl.load(sp_base + parity * (BLOCK_H * BLOCK_N), volatile=True)
        alpha_v = tl.load(sa_base + parity * BLOCK_H, volatile=True)
        acc = acc * alpha_v[:, None]
        acc = tl.dot(p_v, k, acc)
        parity = 1 - parity

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)) * lse_scale
    o_ptrs = O + b * so_b + pid_sp * so_sp + s_idx[:, None] * so_s + h_idx[:, None] * so_h + offs_dm[None, :] * so_d
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dm[None, :] < D_V))
    tl.store(L + b * sl_b + pid_sp * sl_sp + s_idx * sl_s + h_idx * sl_h, lse, mask=row_ok)


if HAS_TRITON:
    _oneread_jit = triton.jit(_oneread_kernel_src)


@dataclass(frozen=True)
class OneReadConfig:
    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    num_splits: Optional[int] = None
    waves: float = 1.0

    def tag(self) -> str:
        return f"{self.block_h}x{self.block_n}/{self.num_warps}w/{self.num_stages}s"


ONEREAD_DEFAULT = OneReadConfig()


def oneread_supported(q_lat, q_rope, kv, pe, v_dim, *, paged: bool = False) -> bool:
    """16-bit tensors, values = the whole latent part (a power of two >= 64), contiguous cache."""
    if paged or kv.dtype not in (torch.float16, torch.bfloat16) or q_lat.dtype != kv.dtype:
        return False
    d_main = v_dim if pe is None else q_lat.shape[-1]
    if d_main != v_dim or pow2(d_main) != d_main or d_main < 64:
        return False
    d_tail = (q_lat.shape[-1] - v_dim) if pe is None else pe.shape[-1]
    return pow2(max(d_tail, 1)) <= 128


def pick_oneread_config(batch: int, rows: int, t_cap: int, device: torch.device, num_splits=None,
                        config: Optional[OneReadConfig] = None) -> OneReadConfig:
    if config is None and device.type != "cuda":  # interpreter: small tiles, a few splits to exercise stage 2
        ns = num_splits if num_splits is not None else max(1, min(3, triton.cdiv(max(t_cap, 1), 16)))
        return OneReadConfig(block_h=min(pow2(rows), 32), block_n=16, num_warps=4, num_stages=1, num_splits=ns)
    cfg = config or ONEREAD_DEFAULT
    ns = num_splits if num_splits is not None else (
        cfg.num_splits or split_count(batch, triton.cdiv(rows, cfg.block_h), t_cap, device, cfg.waves))
    return OneReadConfig(cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, int(ns), cfg.waves)


def launch_oneread(a: MlaArgs, out, lse_out, num_splits=None, config: Optional[OneReadConfig] = None):
    """The one-read path for contiguous caches; returns (out, lse_out)."""
    base = check_base(a.lse_base)
    parts = a.parts()
    q_lat, kv = a.q_lat, a.kv
    B, S, H, _ = q_lat.shape
    T = kv.shape[1]
    device = q_lat.device
    out, lse_out, done = outputs(q_lat, a.v_dim, out, lse_out, T == 0)
    if done:
        return out, lse_out
    SH = S * H
    check_launchable(device, a.kv_lens, "mla_attention_oneread")
    cfg = pick_oneread_config(B, SH, T, device, num_splits, config)
    ns = cfg.num_splits
    d_main = parts.q_main.shape[-1]
    has_tail = parts.q_tail is not None
    d_tail = parts.q_tail.shape[-1] if has_tail else 0
    dummy = kv
    qt = parts.q_tail if has_tail else dummy
    kt = parts.k_tail if has_tail else dummy
    qts = parts.q_tail.stride() if has_tail else (0, 0, 0, 0)
    kts = parts.k_tail.stride() if has_tail else (0, 0, 0)
    mask_b, ms, mask_shared = mask_operand(a.mask, B, S, H, T, device)
    lens, lens_sb, lens_c, lens_r = lens_operand(a.kv_lens, a.lens_stripe, B, dummy)
    q_pos, qps, cp_world, cp_rank = causal_operand(a.causal, B, S, dummy)
    o_part, l_part, ops, lps, l_scale = partial_outputs(out, lse_out, ns, H, base)
    n_hb = triton.cdiv(SH, cfg.block_h)
    grid = (n_hb, ns, B)
    n_prog = n_hb * ns * B
    scratch_p = torch.empty(n_prog * 2 * cfg.block_h * cfg.block_n, dtype=kv.dtype, device=device)
    scratch_a = torch.empty(n_prog * 2 * cfg.block_h, dtype=torch.float32, device=device)
    launch(_oneread_jit, grid, (
        parts.q_main, qt, parts.k_main, kt, lens, mask_b if mask_b is not None else dummy, q_pos,
        o_part, l_part, scratch_p, scratch_a,
        T, H, SH, cp_world, cp_rank, float(a.scale) * LOG2E, l_scale, lens_sb, lens_c, lens_r,
        *parts.q_main.stride(), *qts, *parts.k_main.stride(), *kts, *ms, *qps, *ops, *lps,
    ), dict(
        D_MAIN=d_main, D_TAIL=d_tail, D_V=a.v_dim, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        BLOCK_DT=pow2(max(d_tail, 1)), NUM_SPLITS=ns, HAS_TAIL=has_tail, HAS_LENS=a.kv_lens is not None,
        HAS_MASK=mask_b is not None, CAUSAL=a.causal is not None, MASK_SHARED=mask_shared,
    ), cfg.num_warps, cfg.num_stages)
    if ns > 1:
        kernel, grid2, args, consts, warps = reduce_launch(o_part, l_part, out, lse_out, H, base, a.v_dim, ns)
        launch(kernel, grid2, args, consts, warps)
    return out, lse_out
