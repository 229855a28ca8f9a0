"""Warp-specialised one-read MLA decode kernel in Gluon (Hopper): two warpgroups in ping-pong.

The lock-step kernel (``mla_gluon.py``) splits every tile's scores between its two
warpgroups, so they wait on each other several times a tile and nothing overlaps the
softmax (a third of its warp cycles are barrier stalls, docs/kernel_notes.md v8). Here the
two warpgroups are separate partitions (``gl.warp_specialize``) that take tiles in turn:

* warpgroup ``j % 2`` owns tile ``j``: it computes the tile's whole score block
  (``[64 rows, BLOCK_N keys]`` over all 576 columns) and its online softmax, then hands the
  probabilities, the new row max and the rescale factor to the other warpgroup through
  shared memory and one mbarrier (``hand``);
* each warpgroup holds half of the ``[64, 512]`` fp32 output accumulator (value columns
  ``[256 w, 256 w + 256)``) and adds every tile to it: its own tiles with P from registers,
  the other's with P from shared memory, that P @ V running under its own softmax;
* so one warpgroup's softmax runs while the other's GEMMs keep the tensor cores busy; the
  only serial chain is the row max passed from tile to tile.

Loads: tile ``j`` sits in buffer ``j % NBUF`` (``cp.async``, zero-filled past the split's
end, so no value from past the end reaches P @ V). Each warpgroup refills the part of a
buffer it alone read last, as soon as it is done with it: its value half after its P @ V
of that tile, the owner also the rope columns. A buffer's ``full`` mbarrier completes when
both warpgroups' copies of the next tile have landed (``cp.async.mbarrier.arrive``, 256
arrivals), so no warpgroup waits for the other to release a buffer.

The exchange buffers (``p_s``, the row max ``m_s``, the rescale ``a_s``) are single: the
owners alternate, and a warpgroup overwrites them only after its own P @ V of the other's
probabilities has completed, which is the last read of what it overwrites. Row sums are
kept per warpgroup (its own tiles, rescaled at every tile) and added once at the end.

Scope: the lock-step kernel's unmasked calls (512 latent (= values) + 64 rope columns,
bf16, fused or separate caches, kv_lens with ``lens_stripe``), the same split partials and
stage-2 merge; calls with a mask or a causal cap take ``mla_gluon.py``.
"""
from __future__ import annotations

from .gluon_api import HAS_GLUON

if HAS_GLUON:
    from .gluon_api import (async_load as _async_load, barrier as _barrier, cp, fence_async_shared, gl, gluon,
                            mbarrier, warpgroup_mma, warpgroup_mma_wait)

__all__ = ["WS_SCHEDULE"]

WS_SCHEDULE = 9  # the GluonConfig.schedule that selects this kernel


def _copy_tile_part_src(lat_buf, rope_buf, t0, end, kv_row, kt_row, SKV_T: gl.constexpr, SKT_T: gl.constexpr,
                        W: gl.constexpr, WITH_ROPE: gl.constexpr, BLOCK_N: gl.constexpr):
    """This warpgroup's share of the tile at key t0: latent columns [256 W, 256 W + 256) (its
    value half) and, for the tile's owner, the 64 rope columns; keys past `end` zero-filled.
    (Row strides are constexpr: the copies' addresses are then one base and immediates, not
    16 hoisted 64-bit registers per thread.)"""
    ld_half: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # a warp per 512-byte row segment
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_half))
    c = 256 * W + gl.arange(0, 256, layout=gl.SliceLayout(0, ld_half))
    _async_load(lat_buf.slice(256 * W, 256, dim=1), kv_row + (t0 + n).to(gl.int64)[:, None] * SKV_T + c[None, :],
                mask=((t0 + n) < end)[:, None])
    if WITH_ROPE:
        ld_rope: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_rope))
        cr = gl.arange(0, 64, layout=gl.SliceLayout(0, ld_rope))
        _async_load(rope_buf, kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :],
                    mask=((t0 + nr) < end)[:, None])


def _refill_src(j, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T: gl.constexpr,
                SKT_T: gl.constexpr, W: gl.constexpr, WITH_ROPE: gl.constexpr, BLOCK_N: gl.constexpr,
                NBUF: gl.constexpr):
    """Copy this warpgroup's part of tile j (if the split has it) into its buffer; one arrival
    per thread on the buffer's `full` barrier when the thread's copies have landed."""
    if j < n_tiles:
        buf = _opaque(j + salt) % NBUF
        _copy_tile_part(k_lat.index(buf), k_rope.index(buf), start + j * BLOCK_N, end, kv_row, kt_row, SKV_T, SKT_T,
                        W, WITH_ROPE, BLOCK_N)
        cp.mbarrier_arrive(full.index(buf), increment_count=False)


def _stamp_src(tr, j, event: gl.constexpr, TRACE: gl.constexpr):
    """TRACE (a measurement hook, off in the product): the SM's cycle counter at `event` of
    tile j into this warpgroup's row of the trace (benchmarks/probe_gluon_ws_trace.py)."""
    if TRACE:
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [j], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(tr + gl.minimum(j // 2, 63) * 8 + event, t)


def _opaque_src(x):
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


def _issue_scores_src(j, salt, full, q_lat_s, q_rope_r, k_lat, k_rope, tr, valid, BLOCK_H: gl.constexpr,
                      BLOCK_N: gl.constexpr, NBUF: gl.constexpr, s_mma: gl.constexpr, TRACE: gl.constexpr):
    """Wait for tile j and issue its whole score block (async; the caller waits): the rope part
    with q's rope columns from registers, the latent part with q from shared memory.

    Buffer indices go through `_opaque`: with a warpgroup's own tiles in the same buffers
    every second tile, LLVM otherwise hoists the score GEMM's 36 per-k-step descriptors out
    of the loop into 72 registers, which spill (Triton 3.6, offline: 664 B of stack)."""
    buf = _opaque(j + salt) % NBUF
    mbarrier.wait(full.index(buf), (j // NBUF) & 1, pred=valid)
    fence_async_shared()  # the copies' generic-proxy writes before the tensor cores' reads
    _stamp(tr, j, 1, TRACE)
    s = warpgroup_mma(q_rope_r, k_rope.index(buf).permute((1, 0)),
                      gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma), use_acc=False, is_async=True)
    return warpgroup_mma(q_lat_s, k_lat.index(buf).permute((1, 0)), s, is_async=True)


def _add_remote_tile_src(j, salt, acc, p_s, a_s, p_ready, k_lat, W: gl.constexpr, NBUF: gl.constexpr,
                         NSLOT: gl.constexpr, PBUF: gl.constexpr, row_s: gl.constexpr, o_mma: gl.constexpr):
    """The other warpgroup's tile j, once published (P in slot j % NSLOT, its rescale in
    j % PBUF): acc * alpha_j + P_j @ (value half W), waited."""
    slot = _opaque(j + salt) % NSLOT
    mbarrier.wait(p_ready.index(slot), (j // NSLOT) & 1)
    alpha = a_s.index(_opaque(j + salt) % PBUF).load(row_s)
    acc = warpgroup_mma(p_s.index(slot), k_lat.index(_opaque(j + salt) % NBUF).slice(256 * W, 256, dim=1),
                        acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None], is_async=True)
    return warpgroup_mma_wait(0, deps=[acc])


def _ws_consumer_src(W: gl.constexpr, salt, q_lat_s, q_rope_s, QT, sqt_b, sqt_s, sqt_h, b, k_lat, k_rope, p_s, m_s,
                     a_s, l_s, full, hand, p_ready, done, kv_row, kt_row, start, end, n_tiles, sm_scale_log2,
                     lse_scale, o_base, so_s, so_h, l_base, sl_s, sl_h, row0, H, SH, SKV_T: gl.constexpr,
                     SKT_T: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                     PBUF: gl.constexpr, P_IN_ROPE: gl.constexpr, TR, TRACE: gl.constexpr):
    """Warpgroup W: owns tiles W, W + 2, ...; accumulates value columns [256 W, 256 W + 256).

    Per own tile j: its scores and their row max; the other's max after tile j - 1 (`hand`),
    this tile's max handed on at once (the only serial chain between the warpgroups is
    these few instructions); then the probabilities, published with their rescale factor
    (`p_ready`); then the value GEMMs in tile order: the other's tile j - 1 (P from shared
    memory), tile j (P from registers).

    Where P goes: P_IN_ROPE (64-key tiles, two buffers): into the tile's own rope columns,
    dead once its scores are done; the other warpgroup, their last reader, refills them
    (with its value half) after its P @ V. Else (32-key tiles, four buffers, q's rope columns
    in registers to make room): slot j % PBUF, whose previous content (tile j - PBUF,
    PBUF >= 3) was read by a value GEMM that completed before the other warpgroup handed on
    the max of tile j - 1, and each tile's scores are issued one iteration ahead."""
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_mma)
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    NSLOT: gl.constexpr = NBUF if P_IN_ROPE else PBUF  # probability slots
    EARLY_S: gl.constexpr = not P_IN_ROPE  # (with two buffers the next own tile is not loaded yet)

    # the first NBUF tiles: this warpgroup's value half of each, and the rope part of its own
    # (P_IN_ROPE: of the other's)
    for i in gl.static_range(NBUF):
        _refill(i, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T, SKT_T, W,
                (i % 2 == W) != P_IN_ROPE, BLOCK_N, NBUF)
    if P_IN_ROPE:
        q_rope = q_rope_s
    else:  # q's rope columns in registers (the score GEMM's left operand)
        q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_mma, k_width=2)
        rq = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_op))
        cq = gl.arange(0, 64, layout=gl.SliceLayout(0, q_op))
        q_rope = gl.load(QT + b * sqt_b + (rq // H)[:, None] * sqt_s + (rq % H)[:, None] * sqt_h + cq[None, :],
                         mask=(rq < SH)[:, None], other=0.0)

    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    m_own = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, layout=o_mma)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_mma))
    tr = TR + W * 512  # this warpgroup's trace row (TRACE)
    if EARLY_S:  # a warpgroup without a tile issues nothing
        s = _issue_scores(W, salt, full, q_lat_s, q_rope, k_lat, k_rope, tr, W < n_tiles, BLOCK_H, BLOCK_N, NBUF,
                          s_mma, TRACE)
    for j in range(W, n_tiles, 2):
        _stamp(tr, j, 0, TRACE)
        if not EARLY_S:
            s = _issue_scores(j, salt, full, q_lat_s, q_rope, k_lat, k_rope, tr, True, BLOCK_H, BLOCK_N, NBUF, s_mma,
                              TRACE)
        s = warpgroup_mma_wait(0, deps=[s])
        s = gl.where(((start + j * BLOCK_N + cols) < end)[None, :], s, float("-inf"))  # keys past the split's end
        tile_max = gl.max(s, axis=1) * sm_scale_log2
        _stamp(tr, j, 2, TRACE)

        # the running max: the other's after tile j - 1 (m_s starts at -inf), handed on at once
        mbarrier.wait(hand, (j - 1) & 1, pred=j > 0)
        m_prev = m_s.load(row_s)
        m_new = gl.maximum(m_prev, tile_max)
        m_s.store(m_new)
        mbarrier.arrive(hand)  # lowered as a partition barrier, then one elected arrival
        _stamp(tr, j, 3, TRACE)

        # probabilities (a row with no key yet keeps max -inf: p = 0) and their publication
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * sm_scale_log2 - m_use[:, None]).to(gl.bfloat16)
        alpha = gl.exp2(m_prev - m_use)
        # this warpgroup's row sums (its own tiles), carried from the max of its previous tile
        l_i = l_i * gl.exp2(m_own - m_use) + gl.sum(p.to(gl.float32), axis=1)
        m_own = m_new
        slot = _opaque(j + salt) % NSLOT
        p_s.index(slot).store(p)
        a_s.index(_opaque(j + salt) % PBUF).store(alpha)
        fence_async_shared()  # P's generic-proxy stores before the other's wgmma reads it
        mbarrier.arrive(p_ready.index(slot))
        _stamp(tr, j, 4, TRACE)

        if j > 0:  # the other's tile j - 1 (its row sums are the other warpgroup's)
            acc = _add_remote_tile(j - 1, salt, acc, p_s, a_s, p_ready, k_lat, W, NBUF, NSLOT, PBUF, row_s, o_mma)
            _stamp(tr, j, 5, TRACE)
        # tile j's value half (with the next own tile's scores behind it, EARLY_S), the
        # refills (which touch no wgmma register) under it
        acc = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(0, o_mma, 2)),
                            k_lat.index(_opaque(j + salt) % NBUF).slice(256 * W, 256, dim=1),
                            acc * gl.convert_layout(alpha, row_o)[:, None], is_async=True)
        if j > 0:  # this warpgroup was the last reader of tile j - 1's value half W (and of P there)
            _refill(j - 1 + NBUF, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T, SKT_T, W,
                    P_IN_ROPE, BLOCK_N, NBUF)
        if EARLY_S:
            s = _issue_scores(j + 2, salt, full, q_lat_s, q_rope, k_lat, k_rope, tr, j + 2 < n_tiles, BLOCK_H,
                              BLOCK_N, NBUF, s_mma, TRACE)
            acc = warpgroup_mma_wait(1, deps=[acc])
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
        _stamp(tr, j, 6, TRACE)
        _refill(j + NBUF, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T, SKT_T, W,
                not P_IN_ROPE, BLOCK_N, NBUF)
        _stamp(tr, j, 7, TRACE)
    if EARLY_S:
        s = warpgroup_mma_wait(0, deps=[s])  # (nothing was issued past the last tile)

    last = n_tiles - 1
    if last >= 0 and last % 2 != W:  # the other warpgroup owns the last tile
        acc = _add_remote_tile(last, salt, acc, p_s, a_s, p_ready, k_lat, W, NBUF, NSLOT, PBUF, row_s, o_mma)

    # both halves' row sums in the final max's frame (m_s holds it: every max was handed on
    # before the last tile was published), then this warpgroup's half of the output
    m_fin = m_s.load(row_s)
    l_i = l_i * gl.exp2(m_own - gl.where(m_fin == float("-inf"), 0.0, m_fin))
    l_s.slice(W * BLOCK_H, BLOCK_H).store(l_i)
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    l_tot = l_s.slice(0, BLOCK_H).load(row_s) + l_s.slice(BLOCK_H, BLOCK_H).load(row_s)
    l_o = gl.convert_layout(l_tot, row_o)
    o = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    rows_o = row0 + gl.arange(0, BLOCK_H, layout=row_o)
    cols_o = 256 * W + gl.arange(0, 256, layout=gl.SliceLayout(0, o_mma))
    gl.store(o_base + (rows_o // H)[:, None] * so_s + (rows_o % H)[:, None] * so_h + cols_o[None, :],
             o.to(o_base.dtype.element_ty), mask=(rows_o < SH)[:, None])
    if W == 0:
        rows_m = row0 + gl.arange(0, BLOCK_H, layout=row_s)
        lse = gl.where(l_tot == 0.0, float("-inf"), m_fin + gl.log2(gl.where(l_tot == 0.0, 1.0, l_tot))) * lse_scale
        gl.store(l_base + (rows_m // H) * sl_s + (rows_m % H) * sl_h, lse, mask=rows_m < SH)


def _mla_gluon_ws_kernel_src(
    Q, QT, KV, KT, LENS, O, L, TR,
    T, H, SH, sm_scale_log2, lse_scale, lens_sb, lens_c, lens_r,
    sq_b, sq_s, sq_h,
    sqt_b, sqt_s, sqt_h,
    skv_b, skt_b,
    so_b, so_sp, so_s, so_h,
    sl_b, sl_sp, sl_s, sl_h,
    SKV_T: gl.constexpr, SKT_T: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr, PBUF: gl.constexpr, NUM_SPLITS: gl.constexpr,
    HAS_LENS: gl.constexpr, P_IN_ROPE: gl.constexpr, TRACE: gl.constexpr,
):
    """One (64-row block, split, batch row): the parent region (the default partition's 4
    warps) loads q and finds the split's keys, then both warpgroups run the tiles."""
    DL: gl.constexpr = 512
    DR: gl.constexpr = 64
    dt: gl.constexpr = KV.dtype.element_ty
    pid_h = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    row0 = pid_h * BLOCK_H
    salt = pid_sp // NUM_SPLITS  # 0, which LLVM cannot prove (see _issue_scores_src)

    # ---- queries straight into shared memory (cp.async), both parts
    q_lat_s = gl.allocate_shared_memory(dt, [BLOCK_H, DL], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DL], gl.bfloat16))
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rq = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_q))
    cq = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_q))
    _async_load(q_lat_s, Q + b * sq_b + (rq // H)[:, None] * sq_s + (rq % H)[:, None] * sq_h + cq[None, :],
                mask=(rq < SH)[:, None])
    if P_IN_ROPE:  # (else q's rope columns go to registers, _ws_consumer_src)
        q_rope_s = gl.allocate_shared_memory(dt, [BLOCK_H, DR],
                                             gl.NVMMASharedLayout.get_default_for([BLOCK_H, DR], gl.bfloat16))
        ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rr = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_qr))
        cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
        _async_load(q_rope_s, QT + b * sqt_b + (rr // H)[:, None] * sqt_s + (rr % H)[:, None] * sqt_h + cr[None, :],
                    mask=(rr < SH)[:, None])
    else:
        q_rope_s = q_lat_s  # unused
    cp.commit_group()

    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16)
    k_lat = gl.allocate_shared_memory(dt, [NBUF, BLOCK_N, DL], lat_sl)
    k_rope = gl.allocate_shared_memory(dt, [NBUF, BLOCK_N, DR], rope_sl)
    if P_IN_ROPE:  # (BLOCK_N = BLOCK_H = 64: P has the rope tile's shape and layout)
        p_s = k_rope
    else:
        p_s = gl.allocate_shared_memory(dt, [PBUF, BLOCK_H, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16))
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
    a_s = gl.allocate_shared_memory(gl.float32, [PBUF, BLOCK_H], vec_sl)  # each slot's rescale factor
    l_s = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_sl)  # each warpgroup's row sums
    full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [NBUF if P_IN_ROPE else PBUF, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(full.index(i), count=256)  # every thread of both warpgroups, once per fill
    mbarrier.init(hand, count=1)  # Gluon's arrive: a partition barrier, then one elected thread
    for i in gl.static_range(NBUF if P_IN_ROPE else PBUF):
        mbarrier.init(p_ready.index(i), count=1)
    mbarrier.init(done, count=2)
    m_s.store(gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ld_q)))  # before tile 0

    # ---- this split's keys (rank r's share of a global count under lens_stripe)
    if HAS_LENS:
        n_glob = gl.minimum(gl.maximum(gl.load(LENS + b * lens_sb), 0), T * lens_c).to(gl.int32)  # no int32 wrap
        kv_len = gl.minimum((n_glob + (lens_c - 1 - lens_r)) // lens_c, T)
    else:
        kv_len = T
    split_len = gl.cdiv(gl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_sp * split_len
    end = gl.minimum(start + split_len, kv_len)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)

    cp.wait_group(0)
    fence_async_shared()
    _barrier()

    kv_row = KV + b * skv_b
    kt_row = KT + b * skt_b
    o_base = O + b * so_b + pid_sp * so_sp
    l_base = L + b * sl_b + pid_sp * sl_sp
    tr_base = TR + ((b * NUM_SPLITS + pid_sp) * gl.num_programs(0) + pid_h) * 1024  # 2 warpgroups x 64 x 8
    gl.warp_specialize([
        (_ws_consumer, (0, salt, q_lat_s, q_rope_s, QT, sqt_b, sqt_s, sqt_h, b, k_lat, k_rope, p_s, m_s, a_s, l_s, full, hand,
                        p_ready, done, kv_row, kt_row, start, end, n_tiles, sm_scale_log2, lse_scale, o_base, so_s, so_h,
                        l_base, sl_s, sl_h, row0, H, SH, SKV_T, SKT_T, BLOCK_H, BLOCK_N, NBUF, PBUF, P_IN_ROPE, tr_base,
                        TRACE)),
        (_ws_consumer, (1, salt, q_lat_s, q_rope_s, QT, sqt_b, sqt_s, sqt_h, b, k_lat, k_rope, p_s, m_s, a_s, l_s, full, hand,
                        p_ready, done, kv_row, kt_row, start, end, n_tiles, sm_scale_log2, lse_scale, o_base, so_s, so_h,
                        l_base, sl_s, sl_h, row0, H, SH, SKV_T, SKT_T, BLOCK_H, BLOCK_N, NBUF, PBUF, P_IN_ROPE, tr_base,
                        TRACE)),
    ], [4], [256])


if HAS_GLUON:
    _copy_tile_part = gluon.jit(_copy_tile_part_src)
    _refill = gluon.jit(_refill_src)
    _stamp = gluon.jit(_stamp_src)
    _opaque = gluon.jit(_opaque_src)
    _issue_scores = gluon.jit(_issue_scores_src)
    _add_remote_tile = gluon.jit(_add_remote_tile_src)
    _ws_consumer = gluon.jit(_ws_consumer_src)
    _mla_gluon_ws_jit = gluon.jit(_mla_gluon_ws_kernel_src)
