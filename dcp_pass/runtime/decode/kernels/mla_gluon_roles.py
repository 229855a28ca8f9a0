"""Role-split one-read MLA decode kernel in Gluon (Hopper): a scorer and a loader warpgroup.

The lock-step kernel (``mla_gluon.py``) splits each tile's columns between its two
warpgroups; both then wait for the softmax at once and the tensor cores idle through it
(docs/kernels.md, "role-split form"). Here the two warpgroups are partitions with roles
(``gl.warp_specialize``), the arrangement FlashInfer's Hopper MLA kernel uses (written here
from a description of it):

* the *scorer* (the default partition) computes each 64-key tile's whole score block over
  all 576 columns (m64n64 wgmmas, q read once per tile) and its online softmax, with no
  cross-warpgroup step; it writes P into the tile's rope columns (dead once scored) and the
  rows' rescale factor, signals ``p_ready``, adds P @ V for value columns 256-511 (P from
  registers) and signals ``empty``;
* the *loader* (a 4-warp worker) issues the tiles' ``cp.async`` copies into two buffers
  (each thread arrives on the buffer's ``full`` mbarrier when its copies land) and, per
  tile, once P is ready, rescales its half of the accumulator and adds P @ V for value
  columns 0-255 (P from shared memory); a buffer is refilled with the tile two ahead once
  both value GEMMs of its tile are done.

So the loader's value GEMM of tile j runs under the scorer's scores of tile j + 1. A decode
step's mask row travels with its tile (the loader copies its 64 entries into a small buffer
beside the tile, arriving on the same barrier) and the scorer adds it; a causal cap ends the
split at the last key any row of the block can see and the scorer hides the keys after each
row's query position. Scope as ``mla_gluon.py``: 512 latent (= values) + 64 rope columns in
bf16, one fused cache or two, kv_lens with ``lens_stripe``, a mask row per request, any
causal cap, the split kernel's partials and stage-2 merge. The registry's "gluon_roles"
kernel; it copies q by cp.async as well as the cache, so its operands' row strides must be
multiples of 16 elements (Triton then marks them divisible).
"""
from __future__ import annotations

from typing import Optional

from .common import LOG2E, AttentionCall, causal_operand, mask_operand
from .gluon_common import (
    GLUON_DEFAULT,
    HAS_GLUON,
    ROLES_TILES,
    GluonConfig,
    gluon_offered,
    gluon_reason,
    launch_plan,
    roles_preferred,
    split_frame,
)
from .splits import reduce_launch

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

    from .gluon_common import BUILD_ERRORS, _async_load, _barrier, _split_keys  # noqa: F401

__all__ = ["supports", "offered", "run"]
if HAS_GLUON:  # (the kernels read them as globals, which Triton allows only as constexprs)
    DL, DR = gl.constexpr(512), gl.constexpr(64)


def _opaque_src(x):
    """x through an opaque mov: a buffer index LLVM cannot prove constant per partition (else it
    hoists the score GEMM's per-step descriptors out of the loop and ptxas spills them)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


def _copy_tile_src(lat_buf, rope_buf, t0, end, kv_row, kt_row, SKV_T: gl.constexpr, SKT_T: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """The loader's 128 threads copy the tile at key t0 (its latent and rope rows, from one
    fused cache or two); keys past `end` zero-filled, so nothing from past the end reaches
    P @ V. (Row strides are constexpr: each copy's address is then a base and an immediate.)"""
    ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_lat))
    c = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_lat))
    _async_load(lat_buf, kv_row + (t0 + n).to(gl.int64)[:, None] * SKV_T + c[None, :], mask=((t0 + n) < end)[:, None])
    ld_rope: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_rope))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_rope))
    _async_load(rope_buf, kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :],
                mask=((t0 + nr) < end)[:, None])


def _copy_mask_src(dst, mk_row, t0, end, sm_t, BLOCK_N: gl.constexpr):
    """The mask row's entries for the tile at key t0 into `dst` (fp32 [BLOCK_N]), 4 bytes a copy
    (any key stride; 128 threads, two a key); past `end` zero-filled. Copied with the tile and
    covered by the same barrier arrival: read from global memory after the score GEMM, a mask
    row waits in the same queues as the cache stream (mla_gluon.py)."""
    n = gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([1], [32], [4], [0]))
    _async_load(dst, mk_row + (t0 + n) * sm_t, mask=(t0 + n) < end)


def _query_positions_src(qpos_row, sqp_s, rows, H, SH):
    """The query positions of block rows `rows` (row = token * H + head) as int32, clamped into
    [-1, 2^31 - 2] so that the comparisons with key positions cannot wrap; -1 (sees nothing)
    for rows past SH."""
    q = gl.load(qpos_row + (rows // H) * sqp_s, mask=rows < SH, other=-1)
    return gl.minimum(gl.maximum(q, -1), 2147483646).to(gl.int32)


def _row_positions_src(qpos_row, sqp_s, row0, H, SH, row_l: gl.constexpr, BLOCK_H: gl.constexpr,
                       CAUSAL: gl.constexpr):
    """A scorer's query positions of the block's rows, in layout `row_l`, for a causal cap (0,
    unused, without one)."""
    if CAUSAL:
        qpos = _query_positions(qpos_row, sqp_s, row0 + gl.arange(0, BLOCK_H, layout=row_l), H, SH)
    else:
        qpos = 0
    return qpos


def _causal_end_src(end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_H: gl.constexpr,
                    ROWS_PER_THREAD: gl.constexpr = 1):
    """`end` cut at the last local key any row of the block may see: key k is at global position
    k * cp_world + cp_rank, visible to a row whose query position is not before it.
    ROWS_PER_THREAD = BLOCK_H: every thread reads all the rows' positions, so the maximum needs
    no reduction across warps (shared memory and a barrier; before the narrow fp8 kernel's
    partitions that cost its scorers 336 spilled bytes on Triton 3.6)."""
    rows = row0 + gl.arange(0, BLOCK_H, layout=gl.BlockedLayout([ROWS_PER_THREAD], [32], [4], [0]))
    qmax = gl.max(_query_positions(qpos_row, sqp_s, rows, H, SH), axis=0)
    return gl.minimum(end, gl.where(qmax >= cp_rank, (qmax - cp_rank) // cp_world + 1, 0).to(gl.int32))


def _scores_log2_src(s, t0, end, sm_scale_log2, mk, qpos, cp_world, cp_rank, HAS_MASK: gl.constexpr,
                     CAUSAL: gl.constexpr):
    """A score tile (keys from t0) in base-2 units with the mask row `mk` added (HAS_MASK), -inf
    where a row may not see a key: at or past `end`, or (CAUSAL) after the row's query position."""
    cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    k = t0 + cols
    s = s * sm_scale_log2
    if HAS_MASK:
        s = s + mk[None, :] * 1.4426950408889634
    valid = (k < end)[None, :]
    if CAUSAL:
        valid = valid & ((k * cp_world + cp_rank)[None, :] <= qpos[:, None])
    return gl.where(valid, s, float("-inf"))


def _fill_src(j, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T: gl.constexpr,
              SKT_T: gl.constexpr, BLOCK_N: gl.constexpr, mk, mk_row, sm_t, HAS_MASK: gl.constexpr):
    """Tile j (if the split has it) into buffer j % 2, with its mask entries (HAS_MASK); each
    loader thread arrives on the buffer's `full` barrier once its copies have landed."""
    if j < n_tiles:
        buf = _opaque(j + salt) % 2
        _copy_tile(k_lat.index(buf), k_rope.index(buf), start + j * BLOCK_N, end, kv_row, kt_row, SKV_T, SKT_T,
                   BLOCK_N)
        if HAS_MASK:
            _copy_mask(mk.index(buf), mk_row, start + j * BLOCK_N, end, sm_t, BLOCK_N)
        cp.mbarrier_arrive(full.index(buf), increment_count=False)


def _store_half_src(o_base, acc, l_i, c0: gl.constexpr, row0, so_s, so_h, H, SH, BLOCK_H: gl.constexpr):
    """A partition's 256 output columns from c0, its accumulator over the rows' sums (0 where a
    row saw no key)."""
    o_mma: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_mma))
    o = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    rows_o = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_mma))
    cols_o = c0 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_mma))
    gl.store(o_base + (rows_o // H)[:, None] * so_s + (rows_o % H)[:, None] * so_h + cols_o[None, :],
             o.to(o_base.dtype.element_ty), mask=(rows_o < SH)[:, None])


def _scorer_src(salt, q_lat_s, q_rope_s, k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, start, end, n_tiles,
                sm_scale_log2, lse_scale, o_base, so_s, so_h, l_base, sl_s, sl_h, row0, H, SH,
                BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, mk, qpos_row, sqp_s, cp_world, cp_rank,
                HAS_MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """The scorer: every tile's whole score block and online softmax (it alone holds the
    running max and row sums; the tile's mask entries added, a causal cap applied), P into
    the tile's rope columns for the loader, and value columns 256-511 with P from registers;
    writes its half of the output and the LSE."""
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_mma)
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, layout=o_mma)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_mma))
    qpos = _row_positions(qpos_row, sqp_s, row0, H, SH, row_s, BLOCK_H, CAUSAL)
    for j in range(n_tiles):
        buf = _opaque(j + salt) % 2
        mbarrier.wait(full.index(buf), (j // 2) & 1)
        fence_async_shared()  # the copies' writes before the tensor cores' reads
        s = warpgroup_mma(q_rope_s, k_rope.index(buf).permute((1, 0)),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma), use_acc=False, is_async=True)
        s = warpgroup_mma(q_lat_s, k_lat.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        if HAS_MASK or CAUSAL:
            if HAS_MASK:
                mk_t = mk.index(buf).load(gl.SliceLayout(0, s_mma))  # landed with the tile
            else:
                mk_t = 0  # unused
            s = _scores_log2(s, start + j * BLOCK_N, end, sm_scale_log2, mk_t, qpos, cp_world, cp_rank, HAS_MASK,
                             CAUSAL)
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_use[:, None])
        else:  # (the plain call's code as GPU-tested: the scale folded into the exponent's FMA)
            s = gl.where(((start + j * BLOCK_N + cols) < end)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * sm_scale_log2)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * sm_scale_log2 - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        pb = p.to(gl.bfloat16)
        k_rope.index(buf).store(pb)  # P in the tile's rope columns: its scores are done
        a_s.index(buf).store(alpha)
        fence_async_shared()  # P's stores before the loader's wgmma reads them
        mbarrier.arrive(p_ready.index(buf))
        acc = warpgroup_mma(gl.convert_layout(pb, gl.DotOperandLayout(0, o_mma, 2)),
                            k_lat.index(buf).slice(256, 256, dim=1),
                            acc * gl.convert_layout(alpha, row_o)[:, None], is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(buf))
    l_s.store(l_i)
    mbarrier.arrive(done)
    _store_half(o_base, acc, l_i, 256, row0, so_s, so_h, H, SH, BLOCK_H)
    rows_m = row0 + gl.arange(0, BLOCK_H, layout=row_s)
    lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * lse_scale
    gl.store(l_base + (rows_m // H) * sl_s + (rows_m % H) * sl_h, lse, mask=rows_m < SH)


def _loader_src(salt, k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, kv_row, kt_row, start, end, n_tiles,
                o_base, so_s, so_h, row0, H, SH, SKV_T: gl.constexpr, SKT_T: gl.constexpr, BLOCK_H: gl.constexpr,
                BLOCK_N: gl.constexpr, mk, mk_row, sm_t, HAS_MASK: gl.constexpr):
    """The loader: the tiles' copies, and value columns 0-255 of every tile with P from shared
    memory; a buffer is refilled (tile j + 2) once both value GEMMs of tile j are done."""
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    _fill(0, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T, SKT_T, BLOCK_N, mk, mk_row, sm_t,
          HAS_MASK)
    _fill(1, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T, SKT_T, BLOCK_N, mk, mk_row, sm_t,
          HAS_MASK)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, layout=o_mma)
    for j in range(n_tiles):
        buf = _opaque(j + salt) % 2
        mbarrier.wait(p_ready.index(buf), (j // 2) & 1)
        alpha = a_s.index(buf).load(row_o)
        acc = warpgroup_mma(k_rope.index(buf), k_lat.index(buf).slice(0, 256, dim=1), acc * alpha[:, None],
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.wait(empty.index(buf), (j // 2) & 1)  # the scorer's value GEMM of this buffer is done too
        _fill(j + 2, salt, full, k_lat, k_rope, start, end, n_tiles, kv_row, kt_row, SKV_T, SKT_T, BLOCK_N, mk, mk_row,
              sm_t, HAS_MASK)
    mbarrier.wait(done, 0)
    _store_half(o_base, acc, l_s.load(row_o), 0, row0, so_s, so_h, H, SH, BLOCK_H)


def _role_buffers_src(dt: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, FULL_COUNT: gl.constexpr,
                      HAS_MASK: gl.constexpr):
    """The role-split kernels' shared memory after q, in this order: two tiles of `dt` (latent,
    rope), each buffer's row rescale, the final row sums, the barriers (`full` counting
    FULL_COUNT arrivals a fill; the others one: Gluon's arrive is a partition barrier, then one
    arrival) and, with HAS_MASK, each buffer's mask entries (else `a_s` stands in, unused)."""
    k_lat = gl.allocate_shared_memory(dt, [2, BLOCK_N, DL],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.bfloat16))
    k_rope = gl.allocate_shared_memory(dt, [2, BLOCK_N, DR],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16))
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    a_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_sl)  # each buffer's tile: the rows' rescale
    l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)  # the final row sums, for the loader
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if HAS_MASK:
        mk = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], vec_sl)  # each buffer's tile: its mask entries
    else:
        mk = a_s
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=FULL_COUNT)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(done, count=1)
    return k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, mk


def _roles_kernel_src(Q, QT, KV, KT, LENS, O, L, T, H, SH, sm_scale_log2, lse_scale, lens_sb, lens_c, lens_r,
                      sq_b, sq_s, sq_h, sqt_b, sqt_s, sqt_h, skv_b, skt_b,
                      so_b, so_sp, so_s, so_h, sl_b, sl_sp, sl_s, sl_h,
                      MASK, QPOS, sm_b, sm_t, sqp_b, sqp_s, cp_world, cp_rank,
                      SKV_T: gl.constexpr, SKT_T: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_SPLITS: gl.constexpr, HAS_LENS: gl.constexpr, HAS_MASK: gl.constexpr,
                      CAUSAL: gl.constexpr):
    """One (64-row block, split, batch row): the parent region (the scorer's 4 warps) loads q
    and finds the split's keys, then the two partitions run the tiles. MASK: one additive row
    per request shared by every head and query token ([B, T], strides (sm_b, sm_t)); CAUSAL:
    local key k (global position k * cp_world + cp_rank) is visible to a row whose query
    position QPOS[b, s] is not before it. (Their arguments come after the plain call's, so
    that a plain call's parameters keep their offsets.)"""
    dt: gl.constexpr = KV.dtype.element_ty
    pid_h = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    row0 = pid_h * BLOCK_H
    salt = pid_sp // NUM_SPLITS  # 0, which LLVM cannot prove
    q_lat_s = gl.allocate_shared_memory(dt, [BLOCK_H, DL],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_H, DL], gl.bfloat16))
    q_rope_s = gl.allocate_shared_memory(dt, [BLOCK_H, DR],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_H, DR], gl.bfloat16))
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rq = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_q))
    cq = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_q))
    _async_load(q_lat_s, Q + b * sq_b + (rq // H)[:, None] * sq_s + (rq % H)[:, None] * sq_h + cq[None, :],
                mask=(rq < SH)[:, None])
    ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_qr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
    _async_load(q_rope_s, QT + b * sqt_b + (rr // H)[:, None] * sqt_s + (rr % H)[:, None] * sqt_h + cr[None, :],
                mask=(rr < SH)[:, None])
    cp.commit_group()

    # (full: every loader thread once per fill)
    k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, mk = _role_buffers(dt, BLOCK_H, BLOCK_N, 128, HAS_MASK)

    # ---- this split's keys
    start, end = _split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    qpos_row = QPOS + b * sqp_b
    if CAUSAL:
        end = _causal_end(end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_H)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    cp.wait_group(0)
    fence_async_shared()
    _barrier()

    kv_row = KV + b * skv_b
    kt_row = KT + b * skt_b
    o_base = O + b * so_b + pid_sp * so_sp
    l_base = L + b * sl_b + pid_sp * sl_sp
    gl.warp_specialize([
        (_scorer, (salt, q_lat_s, q_rope_s, k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, start, end, n_tiles,
                   sm_scale_log2, lse_scale, o_base, so_s, so_h, l_base, sl_s, sl_h, row0, H, SH, BLOCK_H, BLOCK_N,
                   mk, qpos_row, sqp_s, cp_world, cp_rank, HAS_MASK, CAUSAL)),
        (_loader, (salt, k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, kv_row, kt_row, start, end, n_tiles,
                   o_base, so_s, so_h, row0, H, SH, SKV_T, SKT_T, BLOCK_H, BLOCK_N, mk, MASK + b * sm_b, sm_t,
                   HAS_MASK)),
    ], [4], [256])


if HAS_GLUON:
    _opaque = gluon.jit(_opaque_src)
    _store_half = gluon.jit(_store_half_src)
    _copy_tile = gluon.jit(_copy_tile_src)
    _copy_mask = gluon.jit(_copy_mask_src)
    _query_positions = gluon.jit(_query_positions_src)
    _row_positions = gluon.jit(_row_positions_src)
    _causal_end = gluon.jit(_causal_end_src)
    _scores_log2 = gluon.jit(_scores_log2_src)
    _fill = gluon.jit(_fill_src)
    _role_buffers = gluon.jit(_role_buffers_src)
    _scorer = gluon.jit(_scorer_src)
    _loader = gluon.jit(_loader_src)
    _roles_jit = gluon.jit(_roles_kernel_src)


# --------------------------------------------------------------------------------------
# the registry's entry (kernel "gluon_roles")
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the role-split kernel cannot run a call of this shape (None: it can): the Gluon
    calls (gluon_reason: a mask only as one row per request, any causal cap), row strides of
    multiples of 16 elements (16-byte cp.async copies of q and of the cache rows)."""
    reason = gluon_reason(shape)
    if reason is not None:
        return reason
    if not shape.rows16:
        return "its operands' row strides must be multiples of 16 elements"
    return None


def offered(shape) -> Optional[str]:
    """The Gluon kernels' offer, and only on the Triton where it was timed (roles_preferred)."""
    if not roles_preferred(shape.triton):
        return "the role-split kernel is the default on Triton 3.6 only, where it was timed"
    return gluon_offered(shape)


def run(call: AttentionCall, out=None, lse_out=None, *, num_splits: Optional[int] = None,
        config: Optional[GluonConfig] = None):
    """Run the role-split kernel (plus the stage-2 merge when split); returns (out, lse_out)."""
    return launch_role_args(_roles_jit, "role-split", call, out, lse_out, num_splits, config)


def launch_role_args(jit, name: str, call: AttentionCall, out, lse_out, num_splits: Optional[int],
                     config: Optional[GluonConfig]):
    """Launch a Gluon kernel that takes the role-split kernel's arguments (this one and the
    seesaw kernel, ``mla_gluon_seesaw.py``), plus the stage-2 merge when split."""
    cfg = config or GLUON_DEFAULT
    if cfg.tiles != ROLES_TILES:
        raise ValueError(f"the {name} Gluon kernel runs {ROLES_TILES[0]} x {ROLES_TILES[1]} tiles in "
                         f"{ROLES_TILES[2]} stages, not {cfg.block_h} x {cfg.block_n} in {cfg.stages}")
    view = call.shard()
    out, lse_out, done, frame = split_frame(view, out, lse_out, num_splits, cfg)
    if done:
        return out, lse_out
    parts, n_hb, ns, (lens, lens_sb, lens_c, lens_r), (o_part, l_part, ops, lps, l_scale) = frame
    B, S, H, _ = view.q_lat.shape
    T = view.kv.shape[1]
    m_args, m_consts = mask_args(view, T, view.kv)
    args = (parts.q_main, parts.q_tail, parts.k_main, parts.k_tail, lens, o_part, l_part,
            T, H, S * H, float(view.scale) * LOG2E, l_scale, lens_sb, lens_c, lens_r,
            *parts.q_main.stride()[:3], *parts.q_tail.stride()[:3], parts.k_main.stride(0), parts.k_tail.stride(0),
            ops[0], ops[1], ops[2], ops[3], lps[0], lps[1], lps[2], lps[3],
            *m_args)
    consts = dict(SKV_T=parts.k_main.stride(1), SKT_T=parts.k_tail.stride(1), BLOCK_H=64, BLOCK_N=64, NUM_SPLITS=ns,
                  HAS_LENS=view.kv_lens is not None, **m_consts)
    stage2 = reduce_launch(o_part, l_part, out, lse_out, H, view.lse_base, view.v_dim, ns) if ns > 1 else None
    return launch_plan(jit, out, lse_out, ((n_hb, ns, B), args, consts, stage2))


def mask_args(call, T: int, dummy) -> tuple:
    """(arguments, constants) of a call's mask row and causal cap, for the warp-specialised Gluon
    kernels (role split, seesaw, both fp8 ones): MASK, QPOS, the mask row's batch and key
    strides, q_pos's, the stripe, after the plain call's arguments (``dummy``, a tensor on the
    call's device, stands in for an absent operand); HAS_MASK and CAUSAL. The mask is one row
    per request (gluon_reason, fp8_gluon_reason); T: the keys the kernel spans."""
    B, S, H, _ = call.q_lat.shape
    mask_b, ms, _ = mask_operand(call.mask, B, S, H, T, dummy.device)
    q_pos, qps, cp_world, cp_rank = causal_operand(call.causal, B, S, dummy)
    return ((mask_b if mask_b is not None else dummy, q_pos, ms[0], ms[3], *qps, cp_world, cp_rank),
            dict(HAS_MASK=mask_b is not None, CAUSAL=call.causal is not None))
