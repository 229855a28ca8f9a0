"""One-read MLA decode kernel in Gluon (Triton's explicit-layout dialect), for Hopper: the
lock-step form, the registry's "gluon_lock_step" kernel. On Triton 3.6 the warp-specialised
forms (``roles.py``, ``seesaw.py``; 2-16 % faster on the H200 plain, 6-13 %
with a mask row or a causal cap, docs/kernels.md) take every call whose row strides are
multiples of 16 elements; this one takes the others (and all calls on other Tritons).

Each latent KV tile is loaded into shared memory once and serves both GEMMs: as the keys
of ``q . k`` (read transposed) and as the values of ``p @ v``. One program holds a block
of 64 rows (query token x head) and all 512 value columns over two warpgroups:

* both GEMMs use the wgmma layout ``warps_per_cta = [4, 2]``: the warpgroups split the
  columns, so each computes half of a score tile and holds [64, 256] of the fp32
  accumulator (the whole [64, 512] would not fit one warpgroup's registers);
* the probabilities go to shared memory (``p_s``), which both warpgroups read as the
  value GEMM's left operand; each tile's row max crosses the two warpgroups once, through a
  small shared buffer and one barrier (``_row_max_src``; the row sums are kept per thread
  and reduced once after the loop);
* tiles arrive by ``cp.async`` ``STAGES - 1`` tiles ahead of use (a ring of ``STAGES``
  buffers), so loading overlaps the GEMMs of the tile before; a mask row travels with its
  tile (copied into a small buffer beside it, in the same commit group): read from global
  memory after the score GEMM it waited behind the cache stream for about a tile's time.

Plain Triton cannot express this: it gives a dot whose
result reaches another dot all warps along the rows (both warpgroups compute the same
scores), and a hand-off through memory needs a barrier that turns off its pipelining.

Scope: DeepSeek's 512 latent (= values) + 64 rope columns, bf16, in one fused cache
(``kv [B, T, 576]``) or two (``kv [B, T, 512]`` and ``pe [B, T, 64]``, as the reference
model keeps them); kv_lens with ``lens_stripe``; an additive mask only when one row per
request serves every head and query token (a decode step's causal mask); any causal cap
``(q_pos, c, r)``. Other calls take the Triton paths. Partial outputs use the split
kernel's format and its stage-2 merge (``splits.reduce_launch``); split counts come from
shapes only, so the call is CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

from ..common import LOG2E, AttentionCall, causal_operand, mask_operand
from ..splits import reduce_launch
from .common import (  # noqa: F401
    D_LAT,
    D_ROPE,
    GLUON_DEFAULT,
    HAS_GLUON,
    ROLES_TILES,
    GluonConfig,
    Schedule,
    default_q_reg,
    gluon_offered,
    gluon_reason,
    launch_plan,
    split_frame,
)

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .common import BUILD_ERRORS, async_load, barrier, split_keys  # noqa: F401

__all__ = ["GluonConfig", "HAS_GLUON", "Schedule", "lock_step_schedule", "supports", "offered", "run"]


def _issue_copies_src(lat_buf, rope_buf, t0, end, kv_row, kt_row, skv_t, skt_t, n_lat, c_lat, n_rope, c_rope):
    """The cp.async copies of the tile at key t0 into one ring buffer, as one commit group (a
    copy past the split's end is masked off: zero-filled, so no value from past the end
    reaches p @ v)."""
    async_load(
        lat_buf,
        kv_row + (t0 + n_lat).to(gl.int64)[:, None] * skv_t + c_lat[None, :],
        mask=((t0 + n_lat) < end)[:, None],
    )
    async_load(
        rope_buf,
        kt_row + (t0 + n_rope).to(gl.int64)[:, None] * skt_t + c_rope[None, :],
        mask=((t0 + n_rope) < end)[:, None],
    )
    cp.commit_group()


def _issue_mask_copy_src(buf, mk_row, t0, end, sm_t, n_mk):
    """The mask row's entries for the tile at key t0 into `buf` (fp32 [BLOCK_N]), 4 bytes a
    copy (any key stride); past `end` zero-filled. Issued before the tile's own copies so
    that their commit closes the same group."""
    async_load(buf, mk_row + (t0 + n_mk) * sm_t, mask=(t0 + n_mk) < end)


def _issue_ring_copies_src(
    slot,
    k_lat_s,
    k_rope_s,
    mk_s,
    t0,
    end,
    kv_row,
    kt_row,
    mk_row,
    skv_t,
    skt_t,
    sm_t,
    n_lat,
    c_lat,
    n_rope,
    c_rope,
    n_mk,
    HAS_MASK: gl.constexpr,
):
    """Schedules 1-3: the tile at key t0 into ring slot `slot`, with its mask row (when there
    is one) in the same commit group, so it lands with the tile: a mask read straight from
    global memory after the score GEMM waits in the same queues as the cache stream (about
    a tile's load time at 64 heads; 20-25 % of the call on the H200)."""
    if HAS_MASK:
        _issue_mask_copy(mk_s.index(slot), mk_row, t0, end, sm_t, n_mk)
    _issue_copies(
        k_lat_s.index(slot), k_rope_s.index(slot), t0, end, kv_row, kt_row, skv_t, skt_t, n_lat, c_lat, n_rope, c_rope
    )


def _tile_landed_src(OUTSTANDING: gl.constexpr):
    """Wait until this thread's copies but the newest OUTSTANDING commit groups have landed,
    order them before the tensor cores' (async proxy) reads, and every thread's too."""
    cp.wait_group(OUTSTANDING)
    fence_async_shared()
    barrier()


def _score_tile_src(
    cur_lat,
    cur_rope,
    q_lat_s,
    q_rope_s,
    q_reg,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    Q_REG: gl.constexpr,
    DL: gl.constexpr,
    s_mma: gl.constexpr,
):
    """q . k of one tile, issued async (rope part, then the latent part: its first Q_REG
    columns from registers, the rest from shared memory)."""
    s = warpgroup_mma(
        q_rope_s,
        cur_rope.permute((1, 0)),
        gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma),
        use_acc=False,
        is_async=True,
    )
    if Q_REG > 0:
        s = warpgroup_mma(q_reg, cur_lat.slice(0, Q_REG, dim=1).permute((1, 0)), s, is_async=True)
        if Q_REG < DL // 2:  # shared-memory slices must be powers of two wide
            s = warpgroup_mma(
                q_lat_s.slice(Q_REG, DL // 2 - Q_REG, dim=1),
                cur_lat.slice(Q_REG, DL // 2 - Q_REG, dim=1).permute((1, 0)),
                s,
                is_async=True,
            )
        s = warpgroup_mma(
            q_lat_s.slice(DL // 2, DL // 2, dim=1),
            cur_lat.slice(DL // 2, DL // 2, dim=1).permute((1, 0)),
            s,
            is_async=True,
        )
    else:
        s = warpgroup_mma(q_lat_s, cur_lat.permute((1, 0)), s, is_async=True)
    return s


def _row_max_src(s, red_s):
    """Each row's max over a [BLOCK_H, BLOCK_N] score tile whose columns the two warpgroups
    split in halves: each warpgroup reduces its half inside its warps, the two halves meet
    in shared memory across one barrier. (Triton's own cross-warp reduction takes two: the
    second guards its scratch for reuse. Here the buffer is written again only in the next
    tile, after the probabilities' barrier that every thread passes after reading it.)"""
    BLOCK_H: gl.constexpr = s.shape[0]
    BLOCK_N: gl.constexpr = s.shape[1]
    halves = gl.max(gl.reshape(s, [BLOCK_H, 2, BLOCK_N // 2]), axis=2)  # [rows, warpgroup]: no cross-warp step
    red_s.store(gl.reshape(gl.permute(halves, (1, 0)), [2 * BLOCK_H]))
    barrier()
    row: gl.constexpr = gl.SliceLayout(1, s.type.layout)
    return gl.maximum(red_s.slice(0, BLOCK_H).load(row), red_s.slice(BLOCK_H, BLOCK_H).load(row))


def _row_sum_halves_src(p):
    """Each row's sum over each warpgroup's half of a score tile's columns, [BLOCK_H, 2]:
    reduced inside the warps only (the halves are added once, after the loop)."""
    BLOCK_H: gl.constexpr = p.shape[0]
    BLOCK_N: gl.constexpr = p.shape[1]
    return gl.sum(gl.reshape(p, [BLOCK_H, 2, BLOCK_N // 2]), axis=2)


def _probs_src(s, m_i, t0, end, cols_s, sm_scale_log2, red_s):
    """Online softmax of one unmasked score tile (keys from t0, those past `end` off):
    p = 2^(s * scale - m) with the running row max m, alpha = the old sums' rescale."""
    s = gl.where(((t0 + cols_s) < end)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, _row_max(s, red_s) * sm_scale_log2)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * sm_scale_log2 - m_use[:, None])  # one FMA per score
    return p, gl.exp2(m_i - m_use), m_new


def _probs_masked_src(
    s,
    m_i,
    t0,
    end,
    cols_s,
    sm_scale_log2,
    red_s,
    mk,
    qpos,
    cp_world,
    cp_rank,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """Online softmax of one score tile with the mask row `mk` added (HAS_MASK) and/or the
    causal cap applied (CAUSAL: key k, at global position k * cp_world + cp_rank, visible to
    a row whose query position qpos is not before it); keys past `end` off."""
    s = s * sm_scale_log2
    valid = ((t0 + cols_s) < end)[None, :]
    if HAS_MASK:
        s = s + mk[None, :] * 1.4426950408889634
    if CAUSAL:
        valid = valid & (((t0 + cols_s) * cp_world + cp_rank)[None, :] <= qpos[:, None])
    s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, _row_max(s, red_s))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    return gl.exp2(s - m_use[:, None]), gl.exp2(m_i - m_use), m_new


def _pair_tile_src(
    it,
    cur_lat,
    cur_rope,
    cur_mk,
    nxt_lat,
    nxt_rope,
    nxt_mk,
    q_lat_s,
    q_rope_s,
    q_reg,
    p_s,
    red_s,
    acc,
    m_i,
    l_2d,
    start,
    end,
    kv_row,
    kt_row,
    mk_row,
    skv_t,
    skt_t,
    sm_t,
    n_lat,
    c_lat,
    n_rope,
    c_rope,
    n_mk,
    cols_s,
    sm_scale_log2,
    qpos,
    cp_world,
    cp_rank,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    Q_REG: gl.constexpr,
    DL: gl.constexpr,
    s_mma: gl.constexpr,
    o_mma: gl.constexpr,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """SCHEDULE 6: one tile of schedule 3 with the two ring buffers as separate allocations
    (the caller alternates them), so the compiler sees that the next tile's copies write a
    buffer no GEMM of this tile reads and needs no barrier before them. A mask row travels
    with its tile (`cur_mk` / `nxt_mk`, as in _issue_ring_copies_src)."""
    _tile_landed(0)
    s = _score_tile(cur_lat, cur_rope, q_lat_s, q_rope_s, q_reg, BLOCK_H, BLOCK_N, Q_REG, DL, s_mma)
    t1 = start + (it + 1) * BLOCK_N
    if HAS_MASK:
        _issue_mask_copy(nxt_mk, mk_row, t1, end, sm_t, n_mk)
    _issue_copies(nxt_lat, nxt_rope, t1, end, kv_row, kt_row, skv_t, skt_t, n_lat, c_lat, n_rope, c_rope)
    s = warpgroup_mma_wait(0, deps=[s])
    if HAS_MASK or CAUSAL:
        if HAS_MASK:
            mk = cur_mk.load(gl.SliceLayout(0, s_mma))
        else:
            mk = 0  # unused
        p, alpha, m_new = _probs_masked(
            s,
            m_i,
            start + it * BLOCK_N,
            end,
            cols_s,
            sm_scale_log2,
            red_s,
            mk,
            qpos,
            cp_world,
            cp_rank,
            HAS_MASK,
            CAUSAL,
        )
    else:
        p, alpha, m_new = _probs(s, m_i, start + it * BLOCK_N, end, cols_s, sm_scale_log2, red_s)
    part = _row_sum_halves(p)
    l_2d = l_2d * gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout))[:, None] + part
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    barrier()
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
    acc = warpgroup_mma(p_s, cur_lat, acc)
    return acc, m_new, l_2d


def _mla_gluon_kernel_src(
    Q,
    QT,
    KV,
    KT,
    LENS,
    MASK,
    QPOS,
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
    cp_world,
    cp_rank,
    sq_b,
    sq_s,
    sq_h,
    sqt_b,
    sqt_s,
    sqt_h,
    skv_b,
    skv_t,
    skt_b,
    skt_t,
    sm_b,
    sm_t,
    sqp_b,
    sqp_s,
    so_b,
    so_sp,
    so_s,
    so_h,
    sl_b,
    sl_sp,
    sl_s,
    sl_h,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    HAS_LENS: gl.constexpr,
    SCHEDULE: gl.constexpr,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
    Q_REG: gl.constexpr,
):
    """One (64-row block, split, batch row). MASK: one additive row per request, shared by
    every head and query token ([B, T] with strides (sm_b, sm_t)); CAUSAL: local key k
    (global position k * cp_world + cp_rank) is visible to a row whose query position
    QPOS[b, s] is not before it."""
    DL: gl.constexpr = 512
    DR: gl.constexpr = 64
    # register layouts: 16-byte vectors along the feature axis for the copies
    ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    ld_rope: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DL // 2, 16])
    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    dt: gl.constexpr = KV.dtype.element_ty

    pid_h = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)

    # ---- queries: loaded once into shared memory (latent and rope parts)
    rows_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_lat))
    q_lat = gl.load(
        Q
        + b * sq_b
        + (rows_l // H)[:, None] * sq_s
        + (rows_l % H)[:, None] * sq_h
        + gl.arange(0, DL, layout=gl.SliceLayout(0, ld_lat))[None, :],
        mask=(rows_l < SH)[:, None],
        other=0.0,
    )
    rows_r = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_rope))
    q_rope = gl.load(
        QT
        + b * sqt_b
        + (rows_r // H)[:, None] * sqt_s
        + (rows_r % H)[:, None] * sqt_h
        + gl.arange(0, DR, layout=gl.SliceLayout(0, ld_rope))[None, :],
        mask=(rows_r < SH)[:, None],
        other=0.0,
    )
    q_lat_s = gl.allocate_shared_memory(
        dt, [BLOCK_H, DL], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DL], gl.bfloat16), q_lat
    )
    if Q_REG > 0:
        # the first Q_REG latent columns of q held in registers as the score GEMM's left
        # operand: each warpgroup would otherwise re-read them from shared memory per tile
        q_reg = q_lat_s.slice(0, Q_REG, dim=1).load(gl.DotOperandLayout(operand_index=0, parent=s_mma, k_width=2))
    else:
        q_reg = 0  # unused
    q_rope_s = gl.allocate_shared_memory(
        dt, [BLOCK_H, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DR], gl.bfloat16), q_rope
    )
    if SCHEDULE == 6:
        k_lat_a = gl.allocate_shared_memory(dt, [BLOCK_N, DL], lat_sl)
        k_rope_a = gl.allocate_shared_memory(dt, [BLOCK_N, DR], rope_sl)
        k_lat_b = gl.allocate_shared_memory(dt, [BLOCK_N, DL], lat_sl)
        k_rope_b = gl.allocate_shared_memory(dt, [BLOCK_N, DR], rope_sl)
        # each buffer's mask row (fp32), copied with its tile
        mk_a = gl.allocate_shared_memory(gl.float32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        mk_b = gl.allocate_shared_memory(gl.float32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        k_lat_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DL], lat_sl)
        k_rope_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], rope_sl)
        # each ring slot's mask row (fp32), copied with its tile (_issue_ring_copies_src)
        mk_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_s = gl.allocate_shared_memory(dt, [BLOCK_H, BLOCK_N], p_sl)
    # the two warpgroups' halves of each row max (_row_max_src)
    red_s = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    # ---- this split's keys
    start, end = split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    rows_m = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_mma))
    qpos = 0  # unused unless CAUSAL
    if CAUSAL:
        qpos = gl.minimum(
            gl.maximum(gl.load(QPOS + b * sqp_b + (rows_m // H) * sqp_s, mask=rows_m < SH, other=-1), -1), 2147483646
        ).to(gl.int32)  # int32 comparisons (mla_attention.py)
        qmax = gl.max(qpos, axis=0)
        # keys k with k * c + r <= qmax are the only ones any row of the block can see
        end = gl.minimum(end, gl.where(qmax >= cp_rank, (qmax - cp_rank) // cp_world + 1, 0).to(gl.int32))
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)

    kv_row = KV + b * skv_b
    kt_row = KT + b * skt_b
    n_lat = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_lat))
    c_lat = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_lat))
    n_rope = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_rope))
    c_rope = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_rope))
    n_mk = gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([1], [32], [8], [0]))
    mk_row = MASK + b * sm_b

    # prologue: the first STAGES - 1 tiles in flight
    if SCHEDULE == 6:
        if HAS_MASK:
            _issue_mask_copy(mk_a, mk_row, start, end, sm_t, n_mk)
        _issue_copies(k_lat_a, k_rope_a, start, end, kv_row, kt_row, skv_t, skt_t, n_lat, c_lat, n_rope, c_rope)
    else:
        for i in gl.static_range(STAGES - 1):
            _issue_ring_copies(
                i,
                k_lat_s,
                k_rope_s,
                mk_s,
                start + i * BLOCK_N,
                end,
                kv_row,
                kt_row,
                mk_row,
                skv_t,
                skt_t,
                sm_t,
                n_lat,
                c_lat,
                n_rope,
                c_rope,
                n_mk,
                HAS_MASK,
            )

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_mma))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_mma))
    l_2d = _row_sum_halves(gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma))
    acc = gl.zeros([BLOCK_H, DL], gl.float32, layout=o_mma)
    cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_mma))

    if SCHEDULE == 6:
        # two tiles per iteration, one per buffer; an odd count runs one masked tile more
        # (zero-filled copies, p = 0)
        for it in range(0, n_tiles, 2):
            acc, m_i, l_2d = _pair_tile(
                it,
                k_lat_a,
                k_rope_a,
                mk_a,
                k_lat_b,
                k_rope_b,
                mk_b,
                q_lat_s,
                q_rope_s,
                q_reg,
                p_s,
                red_s,
                acc,
                m_i,
                l_2d,
                start,
                end,
                kv_row,
                kt_row,
                mk_row,
                skv_t,
                skt_t,
                sm_t,
                n_lat,
                c_lat,
                n_rope,
                c_rope,
                n_mk,
                cols_s,
                sm_scale_log2,
                qpos,
                cp_world,
                cp_rank,
                BLOCK_H,
                BLOCK_N,
                Q_REG,
                DL,
                s_mma,
                o_mma,
                HAS_MASK,
                CAUSAL,
            )
            acc, m_i, l_2d = _pair_tile(
                it + 1,
                k_lat_b,
                k_rope_b,
                mk_b,
                k_lat_a,
                k_rope_a,
                mk_a,
                q_lat_s,
                q_rope_s,
                q_reg,
                p_s,
                red_s,
                acc,
                m_i,
                l_2d,
                start,
                end,
                kv_row,
                kt_row,
                mk_row,
                skv_t,
                skt_t,
                sm_t,
                n_lat,
                c_lat,
                n_rope,
                c_rope,
                n_mk,
                cols_s,
                sm_scale_log2,
                qpos,
                cp_world,
                cp_rank,
                BLOCK_H,
                BLOCK_N,
                Q_REG,
                DL,
                s_mma,
                o_mma,
                HAS_MASK,
                CAUSAL,
            )
    else:
        for it in range(n_tiles):
            nxt = it + STAGES - 1
            tn = start + nxt * BLOCK_N
            slot = nxt % STAGES
            if SCHEDULE == 1:
                # issue tile it + STAGES - 1 into the buffer tile it - 1 used (its GEMMs are done:
                # every warp passed the barrier at the end of the previous iteration)
                _issue_ring_copies(
                    slot,
                    k_lat_s,
                    k_rope_s,
                    mk_s,
                    tn,
                    end,
                    kv_row,
                    kt_row,
                    mk_row,
                    skv_t,
                    skt_t,
                    sm_t,
                    n_lat,
                    c_lat,
                    n_rope,
                    c_rope,
                    n_mk,
                    HAS_MASK,
                )
                _tile_landed(STAGES - 1)
            else:
                _tile_landed(STAGES - 2)
            if SCHEDULE == 2:
                # after that barrier every warp is past the previous tile's value GEMM, so its
                # buffer (and p_s) may be rewritten: one barrier fewer per tile than SCHEDULE 1
                _issue_ring_copies(
                    slot,
                    k_lat_s,
                    k_rope_s,
                    mk_s,
                    tn,
                    end,
                    kv_row,
                    kt_row,
                    mk_row,
                    skv_t,
                    skt_t,
                    sm_t,
                    n_lat,
                    c_lat,
                    n_rope,
                    c_rope,
                    n_mk,
                    HAS_MASK,
                )

            cur = it % STAGES
            k_lat = k_lat_s.index(cur)
            s = _score_tile(k_lat, k_rope_s.index(cur), q_lat_s, q_rope_s, q_reg, BLOCK_H, BLOCK_N, Q_REG, DL, s_mma)
            if SCHEDULE == 3:
                # as 2, but the next tile's copies are issued while the tensor cores compute these
                # scores (the slot they fill is not this tile's)
                _issue_ring_copies(
                    slot,
                    k_lat_s,
                    k_rope_s,
                    mk_s,
                    tn,
                    end,
                    kv_row,
                    kt_row,
                    mk_row,
                    skv_t,
                    skt_t,
                    sm_t,
                    n_lat,
                    c_lat,
                    n_rope,
                    c_rope,
                    n_mk,
                    HAS_MASK,
                )
            s = warpgroup_mma_wait(0, deps=[s])
            t0 = start + it * BLOCK_N
            if HAS_MASK or CAUSAL:
                if HAS_MASK:
                    mk = mk_s.index(cur).load(gl.SliceLayout(0, s_mma))  # zero past `end` (masked copy)
                else:
                    mk = 0  # unused
                p, alpha, m_new = _probs_masked(
                    s, m_i, t0, end, cols_s, sm_scale_log2, red_s, mk, qpos, cp_world, cp_rank, HAS_MASK, CAUSAL
                )
            else:
                p, alpha, m_new = _probs(s, m_i, t0, end, cols_s, sm_scale_log2, red_s)
            if SCHEDULE == 1:
                l_i = l_i * alpha + gl.sum(p, axis=1)
            else:  # row sums kept per thread and reduced once after the loop: no cross-warpgroup sum per tile
                part = _row_sum_halves(p)
                l_2d = l_2d * gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout))[:, None] + part
            m_i = m_new

            p_s.store(p.to(dt))
            fence_async_shared()
            barrier()  # p complete (both warpgroups' halves) before either reads it
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
            acc = warpgroup_mma(p_s, k_lat, acc)
            if SCHEDULE == 1:
                barrier()  # p_s and this tile's buffer are free for the next iteration's writes

    if SCHEDULE != 1:
        l_i = gl.convert_layout(gl.sum(l_2d, axis=1), gl.SliceLayout(1, s_mma))
    cp.wait_group(0)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_mma))
    empty = l_o == 0.0
    o = acc / gl.where(empty, 1.0, l_o)[:, None]
    rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_mma))
    cols_o = gl.arange(0, DL, layout=gl.SliceLayout(0, o_mma))
    gl.store(
        O + b * so_b + pid_sp * so_sp + (rows_o // H)[:, None] * so_s + (rows_o % H)[:, None] * so_h + cols_o[None, :],
        o.to(O.dtype.element_ty),
        mask=(rows_o < SH)[:, None],
    )
    lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * lse_scale
    gl.store(L + b * sl_b + pid_sp * sl_sp + (rows_m // H) * sl_s + (rows_m % H) * sl_h, lse, mask=rows_m < SH)


if HAS_GLUON:
    _tile_landed = gluon.jit(_tile_landed_src)
    _issue_copies = gluon.jit(_issue_copies_src)
    _issue_mask_copy = gluon.jit(_issue_mask_copy_src)
    _issue_ring_copies = gluon.jit(_issue_ring_copies_src)
    _score_tile = gluon.jit(_score_tile_src)
    _row_max = gluon.jit(_row_max_src)
    _probs = gluon.jit(_probs_src)
    _probs_masked = gluon.jit(_probs_masked_src)
    _row_sum_halves = gluon.jit(_row_sum_halves_src)
    _pair_tile = gluon.jit(_pair_tile_src)
    _mla_gluon_jit = gluon.jit(_mla_gluon_kernel_src)


# --------------------------------------------------------------------------------------
# the registry's entry (kernel "gluon_lock_step")
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the lock-step kernel cannot run a call of this shape (None: it can): see gluon_reason."""
    return gluon_reason(shape)


def offered(shape) -> Optional[str]:
    return gluon_offered(shape)


def lock_step_schedule(cfg: GluonConfig, masked: bool = False) -> int:
    """The schedule this kernel runs under ``cfg`` (the role-split schedule: its default)."""
    return cfg.lock_step_schedule()


def _q_reg_for(cfg: GluonConfig, masked: bool) -> int:
    return cfg.q_reg_for(masked)


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[GluonConfig] = None,
):
    """Run the lock-step kernel (plus the stage-2 merge when split); returns (out, lse_out)."""
    cfg = config or GLUON_DEFAULT
    view = call.shard()
    out, lse_out, done, frame = split_frame(view, out, lse_out, num_splits, cfg)
    if done:
        return out, lse_out
    parts, n_hb, ns, (lens, lens_sb, lens_c, lens_r), (o_part, l_part, ops, lps, l_scale) = frame
    q, kv = view.q_lat, view.kv
    B, S, H, _ = q.shape
    T = kv.shape[1]
    mask_b, ms, _ = mask_operand(view.mask, B, S, H, T, kv.device)  # one row per request (gluon_reason)
    q_pos, qps, cp_world, cp_rank = causal_operand(view.causal, B, S, kv)
    masked = mask_b is not None or view.causal is not None
    args = (
        parts.q_main,
        parts.q_tail,
        parts.k_main,
        parts.k_tail,
        lens,
        mask_b if mask_b is not None else kv,
        q_pos,
        o_part,
        l_part,
        T,
        H,
        S * H,
        float(view.scale) * LOG2E,
        l_scale,
        lens_sb,
        lens_c,
        lens_r,
        cp_world,
        cp_rank,
        *parts.q_main.stride()[:3],
        *parts.q_tail.stride()[:3],
        *parts.k_main.stride()[:2],
        *parts.k_tail.stride()[:2],
        ms[0],
        ms[3],
        *qps,
        ops[0],
        ops[1],
        ops[2],
        ops[3],
        lps[0],
        lps[1],
        lps[2],
        lps[3],
    )
    consts = dict(
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        NUM_SPLITS=ns,
        HAS_LENS=view.kv_lens is not None,
        SCHEDULE=cfg.lock_step_schedule(),
        Q_REG=cfg.q_reg_for(masked),
        HAS_MASK=mask_b is not None,
        CAUSAL=view.causal is not None,
    )
    stage2 = reduce_launch(o_part, l_part, out, lse_out, H, view.lse_base, view.v_dim, ns) if ns > 1 else None
    return launch_plan(_mla_gluon_jit, out, lse_out, ((n_hb, ns, B), args, consts, stage2), num_warps=8)
