"""Seesaw one-read MLA decode kernel in Gluon (Hopper): two warpgroups, each a scorer for
every other tile and the owner of half the output.

The role-split kernel (``roles.py``) gives one warpgroup every tile's scores (the
576-deep GEMM) and the softmax, the other only half the value GEMM: the tensor cores wait
whenever the scorer is in its softmax, and the scorer issues 3/4 of the matrix work. Here the
tiles go in pairs and the warpgroups take turns, the schedule DeepSeek's FlashMLA calls
"seesaw" (written here from its published description): warpgroup 0 holds output columns
0-255 and scores the even tile of a pair, warpgroup 1 holds columns 256-511 and scores the
odd tile, and one running row max is handed between them through shared memory:

* WG0: ``s0 = q k0``; ``m0 = max(m, rowmax s0)``; ``p0 = exp2(s0 - m0)``; hands ``m0`` over;
  ``o_L = o_L * 2^(m - m0) + p0 v0_L`` (P from registers);
* WG1: ``s1 = q k1``; takes ``m0``; ``m1 = max(m0, rowmax s1)``; ``p1 = exp2(s1 - m1)``; puts
  ``p1`` into tile 1's rope columns (dead once scored) and hands ``m1`` over;
  ``o_R = o_R * 2^(m - m1) + p1 v1_R`` (P from registers);
* WG0: takes ``m1``; puts ``p0 * 2^(m0 - m1)`` into tile 0's rope columns;
  ``o_L = o_L * 2^(m0 - m1) + p1 v1_L`` (P from shared memory);
* WG1: ``o_R += (p0 2^(m0 - m1)) v0_R`` (P from shared memory).

Each warpgroup issues as much matrix work as the other (one 576-deep score GEMM and two
256-wide value GEMMs a pair), and one's softmax runs under the other's GEMMs. Every product
equals the online softmax's up to rounding: each P is rounded to bf16 once, the row sums are
kept in fp32 per warpgroup and added once at the end.

Tiles arrive by ``cp.async`` into two buffers (even tiles in buffer 0, odd in buffer 1),
copied by the warpgroups themselves in two column regions a buffer, each refilled by the
warpgroup that reads it last, as soon as its last GEMM on it is done: buffer 0's columns
0-255 by WG0 after ``p0 v0_L``, its columns 256-575 by WG1 after ``p0 v0_R`` (which reads P
from the rope columns); buffer 1's columns 0-255 and rope by WG0 after ``p1 v1_L``, its
columns 256-511 by WG1 after ``p1 v1_R``. A score GEMM waits for its regions one at a time,
the early-refilled one first. Shared memory is the role-split kernel's: q (72 KiB) and two
64 x 576 tiles (144 KiB).

A decode step's mask row travels with the tile its scorer waits for first (the even tile's in
the low region WG0 refills, the odd tile's in the high region WG1 refills) and that scorer
adds it; a causal cap ends the split at the last key any row of the block can see and each
scorer hides the keys after its rows' query positions (the role-split kernel's helpers).

Scope: as the role-split kernel (512 latent (= values) + 64 rope columns in bf16, one fused
cache or two, kv_lens with ``lens_stripe``, a mask row per request, any causal cap, row
strides of multiples of 16 elements), the split kernel's partials and stage-2 merge. The
registry's "gluon_seesaw" kernel.
"""

from __future__ import annotations

from typing import Optional

from ..common import AttentionCall
from .common import HAS_GLUON, GluonConfig, gluon_offered, roles_preferred
from .roles import launch_role_args
from .roles import supports as roles_supports

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .common import (  # noqa: F401
        BUILD_ERRORS,
        async_load,
        barrier,
        causal_end,
        copy_mask,
        opaque,
        row_positions,
        scores_log2,
        split_keys,
        store_half,
    )

__all__ = ["supports", "offered", "unmeasured", "run"]
if HAS_GLUON:  # (the kernels read them as globals, which Triton allows only as constexprs)
    DL, DR, DH = gl.constexpr(512), gl.constexpr(64), gl.constexpr(256)
    # the full barriers' slots: (buffer, region)
    F0A, F0B, F1A, F1B = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)


def _copy_lat_src(dst, kv_row, t0, end, c0: gl.constexpr, SKV_T: gl.constexpr, BLOCK_N: gl.constexpr):
    """The partition's 128 threads copy latent columns [c0, c0 + 256) of the tile at key t0 into
    `dst` (16-byte copies, 16 a thread); keys past `end` zero-filled, so nothing from past the
    end reaches P @ V."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, DH, layout=gl.SliceLayout(0, ld))
    async_load(dst, kv_row + (t0 + n).to(gl.int64)[:, None] * SKV_T + (c0 + c)[None, :], mask=((t0 + n) < end)[:, None])


def _copy_rope_src(dst, kt_row, t0, end, SKT_T: gl.constexpr, BLOCK_N: gl.constexpr):
    """The tile's 64 rope columns into `dst`, as _copy_lat."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, DR, layout=gl.SliceLayout(0, ld))
    async_load(dst, kt_row + (t0 + n).to(gl.int64)[:, None] * SKT_T + c[None, :], mask=((t0 + n) < end)[:, None])


def _copy_q_src(q_lat_s, q_rope_s, q_row, qt_row, sq_s, sq_h, sqt_s, sqt_h, row0, H, SH, BLOCK_H: gl.constexpr):
    """The block's q rows (row = token * H + head) into shared memory by cp.async, one commit
    group; rows past SH zero-filled (the role-split kernel's q load, as it stands there)."""
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rq = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_q))
    cq = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_q))
    async_load(
        q_lat_s, q_row + (rq // H)[:, None] * sq_s + (rq % H)[:, None] * sq_h + cq[None, :], mask=(rq < SH)[:, None]
    )
    ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_qr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
    async_load(
        q_rope_s, qt_row + (rr // H)[:, None] * sqt_s + (rr % H)[:, None] * sqt_h + cr[None, :], mask=(rr < SH)[:, None]
    )
    cp.commit_group()


def _fill_low_src(
    full,
    slot: gl.constexpr,
    lat,
    rope,
    with_rope: gl.constexpr,
    kv_row,
    kt_row,
    t0,
    end,
    SKV_T: gl.constexpr,
    SKT_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    mk_row,
    sm_t,
    with_mask: gl.constexpr,
):
    """Region "low" of a buffer: latent columns 0-255 (and the rope columns when `with_rope`, the
    tile's mask entries into `mk` when `with_mask`); each thread arrives on the region's full
    barrier once its copies land."""
    _copy_lat(lat.slice(0, DH, dim=1), kv_row, t0, end, 0, SKV_T, BLOCK_N)
    if with_rope:
        _copy_rope(rope, kt_row, t0, end, SKT_T, BLOCK_N)
    if with_mask:
        copy_mask(mk, mk_row, t0, end, sm_t, BLOCK_N)
    cp.mbarrier_arrive(full.index(slot), increment_count=False)


def _fill_high_src(
    full,
    slot: gl.constexpr,
    lat,
    rope,
    with_rope: gl.constexpr,
    kv_row,
    kt_row,
    t0,
    end,
    SKV_T: gl.constexpr,
    SKT_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    mk_row,
    sm_t,
    with_mask: gl.constexpr,
):
    """Region "high" of a buffer: latent columns 256-511 (and the rope columns when `with_rope`,
    the mask entries when `with_mask`)."""
    _copy_lat(lat.slice(DH, DH, dim=1), kv_row, t0, end, DH, SKV_T, BLOCK_N)
    if with_rope:
        _copy_rope(rope, kt_row, t0, end, SKT_T, BLOCK_N)
    if with_mask:
        copy_mask(mk, mk_row, t0, end, sm_t, BLOCK_N)
    cp.mbarrier_arrive(full.index(slot), increment_count=False)


def _tile_scores_src(
    s, mk, t0, end, sm_scale_log2, qpos, cp_world, cp_rank, HAS_MASK: gl.constexpr, CAUSAL: gl.constexpr
):
    """A tile's scores in base-2 units: its mask entries (`mk`, landed with the region its
    scorer waits for first) added, keys a row may not see at -inf."""
    if HAS_MASK or CAUSAL:
        if HAS_MASK:
            mk_t = mk.load(gl.SliceLayout(0, s.type.layout))
        else:
            mk_t = 0  # unused
        return scores_log2(s, t0, end, sm_scale_log2, mk_t, qpos, cp_world, cp_rank, HAS_MASK, CAUSAL)
    else:
        cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        return gl.where(((t0 + cols) < end)[None, :], s * sm_scale_log2, float("-inf"))


def _finite_src(m):
    """A row max usable as an exponent's offset: 0 where no key was seen yet (-inf)."""
    return gl.where(m == float("-inf"), 0.0, m)


def _wg0_src(
    salt,
    q_lat_s,
    q_rope_s,
    k_lat,
    k_rope,
    m0_s,
    m1_s,
    l_s,
    full,
    bar,
    kv_row,
    kt_row,
    start,
    end,
    n_pairs,
    sm_scale_log2,
    o_base,
    so_s,
    so_h,
    row0,
    H,
    SH,
    SKV_T: gl.constexpr,
    SKT_T: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    mk_row,
    sm_t,
    qpos_row,
    sqp_s,
    cp_world,
    cp_rank,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """Warpgroup 0 (the default partition): even tiles' scores and softmax (their mask entries,
    in `mk` slot 0, are copied with the even buffer's low region), output columns 0-255.
    `bar`: [even scores issued, m0 ready, m1 + P1 ready, P0 ready, WG0's row sums ready, the
    total ready]."""
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_mma)
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, layout=o_mma)
    qpos = row_positions(qpos_row, sqp_s, row0, H, SH, row_s, BLOCK_H, CAUSAL)
    for i in range(n_pairs):
        ph = i & 1
        b0 = opaque(2 * i + salt) % 2  # 0 and 1, which LLVM cannot see: the descriptors stay in the loop
        b1 = opaque(2 * i + 1 + salt) % 2
        t0 = start + (2 * i) * BLOCK_N
        lat0 = k_lat.index(b0)
        lat1 = k_lat.index(b1)
        qz = opaque(salt + 2 * i) // 2 - i  # 0
        q_lat = q_lat_s.index(qz)
        q_rope = q_rope_s.index(qz)
        # ---- scores of the even tile: its low region (refilled early) first
        mbarrier.wait(full.index(F0A), ph)
        fence_async_shared()  # the copies' writes before the tensor cores' reads
        s = warpgroup_mma(
            q_lat.slice(0, DH, dim=1),
            lat0.slice(0, DH, dim=1).permute((1, 0)),
            gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma),
            use_acc=False,
            is_async=True,
        )
        # WG1's scores may start now: both score GEMMs in flight keep the tensor cores fuller than
        # one after the other (measured 10 % slower with WG1 waiting for these to finish)
        mbarrier.arrive(bar.index(0))
        mbarrier.wait(full.index(F0B), ph)
        fence_async_shared()
        s = warpgroup_mma(q_lat.slice(DH, DH, dim=1), lat0.slice(DH, DH, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_rope, k_rope.index(b0).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        s = _tile_scores(s, mk.index(0), t0, end, sm_scale_log2, qpos, cp_world, cp_rank, HAS_MASK, CAUSAL)
        m0 = gl.maximum(m_i, gl.max(s, axis=1))
        m0_use = _finite(m0)
        p = gl.exp2(s - m0_use[:, None])
        alpha = gl.exp2(m_i - m0_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m0_s.store(m0)
        mbarrier.arrive(bar.index(1))  # m0 for WG1
        acc = warpgroup_mma(
            gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(0, o_mma, 2)),
            lat0.slice(0, DH, dim=1),
            acc * gl.convert_layout(alpha, row_o)[:, None],
            is_async=True,
        )
        # ---- WG1's max: rescale P0 to it, hand P0 over in the even tile's rope columns
        mbarrier.wait(bar.index(2), ph)
        m1 = m1_s.load(row_s)
        beta = gl.exp2(m0 - _finite(m1))
        k_rope.index(b0).store((p * beta[:, None]).to(gl.bfloat16))  # its scores are done: the columns are free
        fence_async_shared()  # P0's stores before WG1's wgmma reads them
        mbarrier.arrive(bar.index(3))
        l_i = l_i * beta
        acc = warpgroup_mma_wait(0, deps=[acc])
        if i + 1 < n_pairs:  # p0 v0_L was the last read of the even buffer's low columns
            _fill_low(
                full,
                F0A,
                lat0,
                k_rope.index(b0),
                False,
                kv_row,
                kt_row,
                t0 + 2 * BLOCK_N,
                end,
                SKV_T,
                SKT_T,
                BLOCK_N,
                mk.index(0),
                mk_row,
                sm_t,
                HAS_MASK,
            )
        # ---- P1 (in the odd tile's rope columns) times its low value columns
        acc = warpgroup_mma(
            k_rope.index(b1), lat1.slice(0, DH, dim=1), acc * gl.convert_layout(beta, row_o)[:, None], is_async=True
        )
        acc = warpgroup_mma_wait(0, deps=[acc])
        if i + 1 < n_pairs:  # the odd buffer's low columns and P1's rope columns are free
            _fill_low(
                full,
                F1A,
                lat1,
                k_rope.index(b1),
                True,
                kv_row,
                kt_row,
                t0 + 3 * BLOCK_N,
                end,
                SKV_T,
                SKT_T,
                BLOCK_N,
                mk,
                mk_row,
                sm_t,
                False,
            )
        m_i = m1
    l_s.index(0).store(l_i)
    mbarrier.arrive(bar.index(4))
    mbarrier.wait(bar.index(5), 0)
    store_half(o_base, acc, gl.convert_layout(l_s.index(1).load(row_s), row_o), 0, row0, so_s, so_h, H, SH, BLOCK_H)


def _wg1_src(
    salt,
    q_lat_s,
    q_rope_s,
    k_lat,
    k_rope,
    m0_s,
    m1_s,
    l_s,
    full,
    bar,
    kv_row,
    kt_row,
    start,
    end,
    n_pairs,
    sm_scale_log2,
    lse_scale,
    o_base,
    so_s,
    so_h,
    l_base,
    sl_s,
    sl_h,
    row0,
    H,
    SH,
    SKV_T: gl.constexpr,
    SKT_T: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    mk_row,
    sm_t,
    qpos_row,
    sqp_s,
    cp_world,
    cp_rank,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """Warpgroup 1 (a worker): odd tiles' scores and softmax (their mask entries, in `mk` slot 1,
    are copied with the odd buffer's high region), output columns 256-511, the LSE."""
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_mma)
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, layout=o_mma)
    qpos = row_positions(qpos_row, sqp_s, row0, H, SH, row_s, BLOCK_H, CAUSAL)
    for i in range(n_pairs):
        ph = i & 1
        b0 = opaque(2 * i + salt) % 2
        b1 = opaque(2 * i + 1 + salt) % 2
        t1 = start + (2 * i + 1) * BLOCK_N
        lat0 = k_lat.index(b0)
        lat1 = k_lat.index(b1)
        qz = opaque(salt + 2 * i) // 2 - i  # 0
        q_lat = q_lat_s.index(qz)
        q_rope = q_rope_s.index(qz)
        # ---- scores of the odd tile, beside WG0's; its high region (refilled first) first
        mbarrier.wait(bar.index(0), ph)  # WG0's scores are issued
        mbarrier.wait(full.index(F1B), ph)
        fence_async_shared()
        s = warpgroup_mma(
            q_lat.slice(DH, DH, dim=1),
            lat1.slice(DH, DH, dim=1).permute((1, 0)),
            gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma),
            use_acc=False,
            is_async=True,
        )
        mbarrier.wait(full.index(F1A), ph)
        fence_async_shared()
        s = warpgroup_mma(q_lat.slice(0, DH, dim=1), lat1.slice(0, DH, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_rope, k_rope.index(b1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        s = _tile_scores(s, mk.index(1), t1, end, sm_scale_log2, qpos, cp_world, cp_rank, HAS_MASK, CAUSAL)
        # ---- softmax against WG0's max of the even tile
        mbarrier.wait(bar.index(1), ph)
        m0 = m0_s.load(row_s)
        m1 = gl.maximum(m0, gl.max(s, axis=1))
        m1_use = _finite(m1)
        p = gl.exp2(s - m1_use[:, None])
        gamma = gl.exp2(m_i - m1_use)  # this warpgroup's previous max to m1
        l_i = l_i * gamma + gl.sum(p, axis=1)
        pb = p.to(gl.bfloat16)
        k_rope.index(b1).store(pb)  # P1 for WG0, in the odd tile's rope columns (scored)
        m1_s.store(m1)
        fence_async_shared()
        mbarrier.arrive(bar.index(2))
        acc = warpgroup_mma(
            gl.convert_layout(pb, gl.DotOperandLayout(0, o_mma, 2)),
            lat1.slice(DH, DH, dim=1),
            acc * gl.convert_layout(gamma, row_o)[:, None],
            is_async=True,
        )
        # ---- P0, rescaled to m1 by WG0, times the even tile's high value columns
        mbarrier.wait(bar.index(3), ph)
        acc = warpgroup_mma(k_rope.index(b0), lat0.slice(DH, DH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        if i + 1 < n_pairs:  # p1 v1_R was the last read of the odd buffer's high columns
            _fill_high(
                full,
                F1B,
                lat1,
                k_rope.index(b1),
                False,
                kv_row,
                kt_row,
                t1 + 2 * BLOCK_N,
                end,
                SKV_T,
                SKT_T,
                BLOCK_N,
                mk.index(1),
                mk_row,
                sm_t,
                HAS_MASK,
            )
        acc = warpgroup_mma_wait(0, deps=[acc])
        if i + 1 < n_pairs:  # and p0 v0_R of the even buffer's high and rope columns
            _fill_high(
                full,
                F0B,
                lat0,
                k_rope.index(b0),
                True,
                kv_row,
                kt_row,
                t1 + BLOCK_N,
                end,
                SKV_T,
                SKT_T,
                BLOCK_N,
                mk,
                mk_row,
                sm_t,
                False,
            )
        m_i = m1
    mbarrier.wait(bar.index(4), 0)
    l_i = l_i + l_s.index(0).load(row_s)  # both partial sums are relative to the last m1
    l_s.index(1).store(l_i)
    mbarrier.arrive(bar.index(5))
    store_half(o_base, acc, gl.convert_layout(l_i, row_o), 256, row0, so_s, so_h, H, SH, BLOCK_H)
    rows_m = row0 + gl.arange(0, BLOCK_H, layout=row_s)
    lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * lse_scale
    gl.store(l_base + (rows_m // H) * sl_s + (rows_m % H) * sl_h, lse, mask=rows_m < SH)


def _seesaw_kernel_src(
    Q,
    QT,
    KV,
    KT,
    LENS,
    O,
    L,
    T,
    H,
    SH,
    sm_scale_log2,
    lse_scale,
    lens_sb,
    lens_c,
    lens_r,
    sq_b,
    sq_s,
    sq_h,
    sqt_b,
    sqt_s,
    sqt_h,
    skv_b,
    skt_b,
    so_b,
    so_sp,
    so_s,
    so_h,
    sl_b,
    sl_sp,
    sl_s,
    sl_h,
    MASK,
    QPOS,
    sm_b,
    sm_t,
    sqp_b,
    sqp_s,
    cp_world,
    cp_rank,
    SKV_T: gl.constexpr,
    SKT_T: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    HAS_LENS: gl.constexpr,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """One (64-row block, split, batch row): the parent region (WG0's warps) loads q, finds
    the split's keys and issues the first two tiles, then the two warpgroups run the pairs.
    MASK and CAUSAL as in the role-split kernel (roles.py)."""
    dt: gl.constexpr = KV.dtype.element_ty
    pid_h = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    row0 = pid_h * BLOCK_H
    salt = pid_sp // NUM_SPLITS  # 0, which LLVM cannot prove
    # q with a unit leading dimension: the partitions index it with an opaque zero in every
    # iteration, so its wgmma descriptors are formed there, not hoisted and spilled
    q_lat_s = gl.allocate_shared_memory(
        dt, [1, BLOCK_H, DL], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DL], gl.bfloat16)
    )
    q_rope_s = gl.allocate_shared_memory(
        dt, [1, BLOCK_H, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DR], gl.bfloat16)
    )
    _copy_q(
        q_lat_s.index(0),
        q_rope_s.index(0),
        Q + b * sq_b,
        QT + b * sqt_b,
        sq_s,
        sq_h,
        sqt_s,
        sqt_h,
        row0,
        H,
        SH,
        BLOCK_H,
    )

    k_lat = gl.allocate_shared_memory(
        dt, [2, BLOCK_N, DL], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.bfloat16)
    )
    k_rope = gl.allocate_shared_memory(
        dt, [2, BLOCK_N, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16)
    )
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m0_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)  # WG0's max after the even tile
    m1_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)  # WG1's after the odd tile
    l_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_sl)  # WG0's row sums, then the total
    full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    bar = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(4):
        mbarrier.init(full.index(k), count=128)  # every thread of the filling warpgroup, once per fill
    for k in gl.static_range(6):
        mbarrier.init(bar.index(k), count=1)  # Gluon's arrive: a partition barrier, then one arrival
    if HAS_MASK:
        mk = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], vec_sl)  # the even and the odd tile's mask entries
    else:
        mk = l_s  # unused

    start, end = split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    qpos_row = QPOS + b * sqp_b
    if CAUSAL:
        end = causal_end(end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_H)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    n_pairs = gl.cdiv(n_tiles, 2)  # an odd count's last pair has a tile past the end: all masked
    cp.wait_group(0)
    fence_async_shared()
    barrier()

    kv_row = KV + b * skv_b
    kt_row = KT + b * skt_b
    mk_row = MASK + b * sm_b
    if n_pairs > 0:  # the first pair, all four regions, by the parent's warps (WG0's 128 threads)
        _fill_low(
            full,
            F0A,
            k_lat.index(0),
            k_rope.index(0),
            False,
            kv_row,
            kt_row,
            start,
            end,
            SKV_T,
            SKT_T,
            BLOCK_N,
            mk.index(0),
            mk_row,
            sm_t,
            HAS_MASK,
        )
        _fill_high(
            full,
            F0B,
            k_lat.index(0),
            k_rope.index(0),
            True,
            kv_row,
            kt_row,
            start,
            end,
            SKV_T,
            SKT_T,
            BLOCK_N,
            mk,
            mk_row,
            sm_t,
            False,
        )
        _fill_high(
            full,
            F1B,
            k_lat.index(1),
            k_rope.index(1),
            False,
            kv_row,
            kt_row,
            start + BLOCK_N,
            end,
            SKV_T,
            SKT_T,
            BLOCK_N,
            mk.index(1),
            mk_row,
            sm_t,
            HAS_MASK,
        )
        _fill_low(
            full,
            F1A,
            k_lat.index(1),
            k_rope.index(1),
            True,
            kv_row,
            kt_row,
            start + BLOCK_N,
            end,
            SKV_T,
            SKT_T,
            BLOCK_N,
            mk,
            mk_row,
            sm_t,
            False,
        )

    o_base = O + b * so_b + pid_sp * so_sp
    l_base = L + b * sl_b + pid_sp * sl_sp
    gl.warp_specialize(
        [
            (
                _wg0,
                (
                    salt,
                    q_lat_s,
                    q_rope_s,
                    k_lat,
                    k_rope,
                    m0_s,
                    m1_s,
                    l_s,
                    full,
                    bar,
                    kv_row,
                    kt_row,
                    start,
                    end,
                    n_pairs,
                    sm_scale_log2,
                    o_base,
                    so_s,
                    so_h,
                    row0,
                    H,
                    SH,
                    SKV_T,
                    SKT_T,
                    BLOCK_H,
                    BLOCK_N,
                    mk,
                    mk_row,
                    sm_t,
                    qpos_row,
                    sqp_s,
                    cp_world,
                    cp_rank,
                    HAS_MASK,
                    CAUSAL,
                ),
            ),
            (
                _wg1,
                (
                    salt,
                    q_lat_s,
                    q_rope_s,
                    k_lat,
                    k_rope,
                    m0_s,
                    m1_s,
                    l_s,
                    full,
                    bar,
                    kv_row,
                    kt_row,
                    start,
                    end,
                    n_pairs,
                    sm_scale_log2,
                    lse_scale,
                    o_base,
                    so_s,
                    so_h,
                    l_base,
                    sl_s,
                    sl_h,
                    row0,
                    H,
                    SH,
                    SKV_T,
                    SKT_T,
                    BLOCK_H,
                    BLOCK_N,
                    mk,
                    mk_row,
                    sm_t,
                    qpos_row,
                    sqp_s,
                    cp_world,
                    cp_rank,
                    HAS_MASK,
                    CAUSAL,
                ),
            ),
        ],
        [4],
        [256],
    )


if HAS_GLUON:
    _copy_lat = gluon.jit(_copy_lat_src)
    _copy_rope = gluon.jit(_copy_rope_src)
    _copy_q = gluon.jit(_copy_q_src)
    _fill_low = gluon.jit(_fill_low_src)
    _fill_high = gluon.jit(_fill_high_src)
    _tile_scores = gluon.jit(_tile_scores_src)
    _finite = gluon.jit(_finite_src)
    _wg0 = gluon.jit(_wg0_src)
    _wg1 = gluon.jit(_wg1_src)
    _seesaw_jit = gluon.jit(_seesaw_kernel_src)


# --------------------------------------------------------------------------------------
# the registry's entry (kernel "gluon_seesaw")
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the seesaw kernel cannot run a call of this shape (None: it can): the role-split
    kernel's calls (the Gluon calls, row strides of multiples of 16 elements: q and the cache
    rows are copied 16 bytes at a time)."""
    return roles_supports(shape)


def offered(shape) -> Optional[str]:
    """The Gluon kernels' offer, on the Triton it was timed with (3.6)."""
    if not roles_preferred(shape.triton):
        return "the seesaw kernel is offered on Triton 3.6 only, where it was timed"
    return gluon_offered(shape)


def unmeasured(shape) -> bool:
    """False: the chooser takes it where the path table's timings say it is fastest, nowhere else."""
    return False


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[GluonConfig] = None,
):
    """Run the seesaw kernel (plus the stage-2 merge when split); returns (out, lse_out)."""
    return launch_role_args(_seesaw_jit, "seesaw", call, out, lse_out, num_splits, config)
