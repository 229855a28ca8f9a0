"""Narrow-row fp8 MLA decode kernel in Gluon (Hopper): the keys are the wgmma's M dimension.

A rank of a DCP group with 16 heads runs 16 query rows over its stripe: the call is
memory-bound, and an fp8 cache (656 bytes a token instead of 1152) could make it 1.76x
faster. The fp8 role-split kernel (``mla_gluon_fp8.py``) cannot: its 64-row tile does four
times the matrix work of 16 rows, which at 16 heads costs more than reading the cache. Here
both products are transposed so that the 64 keys of a tile fill the wgmma's 64 rows and the
query rows are its narrow N (16):

* scores ``S^T = K Q^T``: M = 64 keys, N = 16 rows, over the 512 latent columns in four
  128-column blocks (one accumulator each, so each block's per-key scale multiplies its
  partial scores exactly) and the 64 rope columns (bf16, a fifth accumulator);
* values ``O^T = V^T P^T``: M = 512 value columns (four 128-column blocks, the tile read
  transposed), N = 16 rows, K = 64 keys; each block's per-key scale multiplies P instead
  (four [64, 16] copies of P, one per block).

So the fp8 values are never multiplied by their scales: each tile's e4m3 bytes become f16
(exact: every e4m3 value is an f16, one packed conversion per two values) in one shared
tile that both products read, and the scales act on the small [64, 16] tiles. The queries
enter the f16 products scaled per row and block by a power of two that puts their largest
value in [2^13, 2^14) (exact; the partial scores are scaled back), and P's copies are counted
in units of the largest key scale seen so far, so they stay in [0, 1] (the accumulator is
rescaled when that largest scale grows, as for the running max). What is rounded: P, once, to
f16 (11 bits; the bf16 kernels round it to 8); nothing else.

Three warpgroups a program (``gl.warp_specialize``): a *converter* moves each tile's fp8 words
global -> a staging buffer (``cp.async``) -> registers -> an f16 buffer, and issues the next
tile's copies (and an L2 prefetch of the tile after it) as soon as this tile's words are in
registers, so that they fly while it converts, stores and waits for a free buffer; its keys'
scales travel in registers, its bf16 rope rows by ``cp.async`` into a ring of three slots a
tile ahead. Two *scorers* take alternate tiles (scorer k the tiles k, k + 2, ...), each with
its own running max, row sums and output, and write partials of their own that the split
kernel's stage-2 merge combines. Two f16 buffers, the staging buffer, three rope slots: 221
KiB of shared memory. A scorer's row sums are kept per key and row ([64, 16], rescaled with
the running max) and reduced once at the end; its running max crosses its warps once a tile.

Scope: an fp8 e4m3 latent of 512 columns with its fp32 scales (4 a token), 64 bf16 rope
columns (packed rows or a buffer of their own), bf16 queries, kv_lens with ``lens_stripe``, a
decode step's mask row per request (its entries copied with the tile's rope rows, into a ring
of their own) and any causal cap (each row's last visible key compared per tile; the split's
keys cut at the block's last), 16-byte aligned rows; the split kernel's partials and stage-2
merge.
The registry's "gluon_fp8_narrow" kernel, offered for calls of at most 16 query rows.
"""
from __future__ import annotations

from typing import Optional

from .common import LOG2E, AttentionCall
from .gluon_common import HAS_GLUON, GluonConfig, fp8_gluon_reason, launch_plan, roles_preferred, split_frame
from .mla_gluon_roles import mask_args
from .splits import reduce_launch

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .gluon_common import BUILD_ERRORS, _async_load, _barrier, _split_keys  # noqa: F401
    from .mla_gluon_roles import _causal_end, _copy_mask, _opaque, _row_positions

__all__ = ["NARROW", "supports", "offered", "unmeasured", "run", "launch_args"]

NARROW = GluonConfig(block_h=16, block_n=64, stages=2)  # query rows (N), keys (M), buffers
SCORERS = 2  # scorer warpgroups a program, beside the converter
L2_AHEAD = 1  # the tile after the staged one is prefetched into L2 (0: none; 2 measured no better)
MAX_ROWS = 16  # the rows the chooser offers it for (more rows re-read the cache once per 16)

if HAS_GLUON:
    DL, DR, SB = gl.constexpr(512), gl.constexpr(64), gl.constexpr(128)
    # a 128-column block's fp8 words [BLOCK_N, 32] in the converter: 16 bytes a thread, 8 rows x 4
    # threads a warp, so that the f16 stores into the 128-byte-swizzled tile are conflict-free
    # (an 8-lane phase writes two rows' four 16-byte pieces, which the swizzle puts on all 32
    # banks; with 4 rows x 8 threads two lanes of a phase shared banks): 4 % faster on the H200
    _WORDS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
    # the same words as the converter copies them: 4 rows x 8 threads a warp, a row's 128 bytes of
    # the block per 8 lanes. A 656-byte row starts 16 bytes into a 32-byte sector on odd keys, so a
    # 64-byte piece (8 x 4) touched 3 sectors where 2 hold it; a 128-byte piece touches 5 for 4
    # (the copy layout alone: 3 % faster on the H200, 9 % with the early conversion in _take_tile)
    _COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))

# four e4m3 values of one word -> four f16 (exact: e4m3 is a subset of f16), lowest byte first
_E4M3_F16_ASM_TEXT = """{
.reg .b16 lo, hi;
.reg .b32 p01, p23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p01, lo;
cvt.rn.f16x2.e4m3x2 p23, hi;
mov.b32 {$0, $1}, p01;
mov.b32 {$2, $3}, p23;
}"""


def _to_f16_src(x):
    """[BLOCK_N, W] int32 words of e4m3 values -> [BLOCK_N, 4 W] f16; column 4k + i is byte i of word k."""
    v0, v1, v2, v3 = gl.inline_asm_elementwise(_E4M3_F16_ASM, "=h,=h,=h,=h,r", [x],
                                               dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                               is_pure=True, pack=1)
    w = gl.join(gl.join(v0, v1), gl.join(v2, v3))  # [n, k, i, p] = value 2p + i of word k
    w = gl.permute(w, (0, 1, 3, 2))  # [n, k, p, i]: row-major order is then column 4k + 2p + i
    return gl.reshape(w, [x.shape[0], 4 * x.shape[1]])


def _prefetch_l2_src(kv_bytes, t0, end, SKV_T: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key rows [t0, t0 + BLOCK_N) into L2, one bulk prefetch a warp of a warp-uniform range of
    BLOCK_N / 4 whole rows (a per-lane address would make ptxas loop over the lanes); ranges
    reaching past `end` are skipped."""
    wl: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[], lane_bases=[[0], [0], [0], [0], [0]],
                                                  warp_bases=[[1], [2]], block_bases=[], shape=[4])
    row = t0 + gl.arange(0, 4, layout=wl) * (BLOCK_N // 4)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [kv_bytes + row.to(gl.int64) * SKV_T, ((row + BLOCK_N // 4) <= end).to(gl.int32),
                     gl.full([4], SKV_T * (BLOCK_N // 4), gl.int32, layout=wl)],
        dtype=gl.int32, is_pure=False, pack=1)


def _issue_tile_src(j, stage_s, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W: gl.constexpr,
                    BLOCK_N: gl.constexpr, kv_bytes, L2_AHEAD: gl.constexpr):
    """Tile j's fp8 words into the staging buffer by cp.async (one commit group, in _COPY_LAYOUT),
    the rows of tile j + L2_AHEAD into L2 (8-10 % faster on the H200: the next tile's copies find
    their bytes there) and tile j's keys' scales into registers; past the split: all masked (no
    traffic)."""
    ld: gl.constexpr = _COPY_LAYOUT
    k = start + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    w = gl.arange(0, SB // 4, layout=gl.SliceLayout(0, ld))
    rows = kv_words + k.to(gl.int64)[:, None] * SKV_W + w[None, :]
    keep = (k < end)[:, None]
    for blk in gl.static_range(4):
        _async_load(stage_s.index(blk), rows + blk * (SB // 4), mask=keep)
    cp.commit_group()
    if L2_AHEAD > 0:
        _prefetch_l2(kv_bytes, start + (j + L2_AHEAD) * BLOCK_N, end, SKV_W * 4, BLOCK_N)
    ld_s: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ks = start + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=ld_s)
    ts = ks.to(gl.int64) * sks_t
    c0 = gl.load(ks_row + ts, mask=ks < end, other=0.0)
    c1 = gl.load(ks_row + ts + sks_c, mask=ks < end, other=0.0)
    c2 = gl.load(ks_row + ts + 2 * sks_c, mask=ks < end, other=0.0)
    c3 = gl.load(ks_row + ts + 3 * sks_c, mask=ks < end, other=0.0)
    return c0, c1, c2, c3


def _take_tile_src(stage_s, OUTSTANDING: gl.constexpr):
    """The staged tile into registers once every converter thread's copies have landed (all but
    the OUTSTANDING newest commit groups; a thread reads pieces other threads copied): blocks 0
    and 1 already converted to f16, blocks 2 and 3 as words. The two blocks are converted here,
    before the converter waits for a free buffer, so that less of the conversion lies between a
    scorer freeing a buffer and its refill (all four: spills, and slower on the H200)."""
    ld: gl.constexpr = _WORDS_LAYOUT
    cp.wait_group(OUTSTANDING)
    _barrier()  # every thread's copies landed
    x0 = stage_s.index(0).load(ld)
    x1 = stage_s.index(1).load(ld)
    x2 = stage_s.index(2).load(ld)
    x3 = stage_s.index(3).load(ld)
    _barrier()  # every thread's reads done before the next tile's copies overwrite the buffer
    return _to_f16(x0), _to_f16(x1), x2, x3


def _issue_rope_src(j, rope_s, rope_full, kt_row, start, end, n_tiles, SKT_T: gl.constexpr, BLOCK_N: gl.constexpr,
                    mk_s, mk_row, sm_t, HAS_MASK: gl.constexpr):
    """Tile j's bf16 rope rows (if the split has it) into rope slot j % 3 by cp.async, and its
    mask entries (HAS_MASK) into mask slot j % 3; each converter thread arrives on the slot's
    barrier when its copies land."""
    if j < n_tiles:
        slot = j % 3
        t0 = start + j * BLOCK_N
        ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_r))
        cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_r))
        _async_load(rope_s.index(slot), kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :],
                    mask=((t0 + nr) < end)[:, None])
        if HAS_MASK:
            _copy_mask(mk_s.index(slot), mk_row, t0, end, sm_t, BLOCK_N)
        cp.mbarrier_arrive(rope_full.index(slot), increment_count=False)
        cp.commit_group()


def _put_src(j, salt, full, tile_s, sc_s, h0, h1, x2, x3, c0, c1, c2, c3, n_tiles):
    """Tile j (if the split has it) into buffer j % 2: its blocks as f16 (h0, h1 converted by
    _take_tile, x2, x3 words converted here) and its scales from registers, then one arrival once
    every thread's stores are fenced for the tensor cores."""
    if j < n_tiles:
        buf = _opaque(j + salt) % 2
        tile = tile_s.index(buf)
        tile.slice(0, SB, dim=1).store(h0)
        tile.slice(SB, SB, dim=1).store(h1)
        tile.slice(2 * SB, SB, dim=1).store(_to_f16(x2))
        tile.slice(3 * SB, SB, dim=1).store(_to_f16(x3))
        sc_s.index(4 * buf).store(c0)  # (block-major: the scorers read each block's scales as a vector)
        sc_s.index(4 * buf + 1).store(c1)
        sc_s.index(4 * buf + 2).store(c2)
        sc_s.index(4 * buf + 3).store(c3)
        fence_async_shared()  # these stores before the tensor cores' reads
        mbarrier.arrive(full.index(buf))


def _converter_src(salt, tile_s, rope_s, sc_s, stage_s, full, rope_full, empty, kv_words, ks_row, kt_row, sks_t,
                   sks_c, start, end, n_tiles, SKV_W: gl.constexpr, SKT_T: gl.constexpr, BLOCK_N: gl.constexpr,
                   kv_bytes, L2_AHEAD: gl.constexpr, mk_s, mk_row, sm_t, HAS_MASK: gl.constexpr):
    """The converter (a 4-warp worker). A tile's fp8 words travel global -> staging buffer
    (cp.async) -> registers -> f16 buffer: the next tile's copies are issued as soon as this
    tile's words are in registers, so they fly while this tile is converted and stored and
    while the converter waits for a free buffer. Rope rows go to a ring of three slots, issued
    a tile ahead of their latent's f16 store, once the scorers are done with the slot."""
    _issue_rope(0, rope_s, rope_full, kt_row, start, end, n_tiles, SKT_T, BLOCK_N, mk_s, mk_row, sm_t, HAS_MASK)
    _issue_rope(1, rope_s, rope_full, kt_row, start, end, n_tiles, SKT_T, BLOCK_N, mk_s, mk_row, sm_t, HAS_MASK)
    _issue_rope(2, rope_s, rope_full, kt_row, start, end, n_tiles, SKT_T, BLOCK_N, mk_s, mk_row, sm_t, HAS_MASK)
    c0, c1, c2, c3 = _issue_tile(0, stage_s, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N, kv_bytes, L2_AHEAD)
    h0, h1, x2, x3 = _take_tile(stage_s, 0)
    n0, n1, n2, n3 = _issue_tile(1, stage_s, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N, kv_bytes, L2_AHEAD)
    _put(0, salt, full, tile_s, sc_s, h0, h1, x2, x3, c0, c1, c2, c3, n_tiles)
    h0, h1, x2, x3 = _take_tile(stage_s, 0)
    c0, c1, c2, c3 = _issue_tile(2, stage_s, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N, kv_bytes, L2_AHEAD)
    _put(1, salt, full, tile_s, sc_s, h0, h1, x2, x3, n0, n1, n2, n3, n_tiles)
    for j in range(n_tiles):
        # tile j + 2: its words from the staging buffer, then tile j + 3's copies behind them
        h0, h1, x2, x3 = _take_tile(stage_s, 0)
        n0, n1, n2, n3 = _issue_tile(j + 3, stage_s, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N, kv_bytes, L2_AHEAD)
        buf = _opaque(j + salt) % 2
        mbarrier.wait(empty.index(buf), (j // 2) & 1)  # the scorers are done with tile j (and its rope slot)
        _issue_rope(j + 3, rope_s, rope_full, kt_row, start, end, n_tiles, SKT_T, BLOCK_N, mk_s, mk_row, sm_t, HAS_MASK)
        _put(j + 2, salt, full, tile_s, sc_s, h0, h1, x2, x3, c0, c1, c2, c3, n_tiles)
        c0, c1, c2, c3 = n0, n1, n2, n3


def _store_block_src(o_base, acc, scale_r, blk: gl.constexpr, row0, so_s, so_h, H, SH):
    """Output columns [128 blk, 128 blk + 128) of the block's rows from O^T's accumulator."""
    o_l: gl.constexpr = acc.type.layout
    cols = blk * SB + gl.arange(0, SB, layout=gl.SliceLayout(1, o_l))
    rows = row0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_l))
    o = acc * gl.convert_layout(scale_r, gl.SliceLayout(0, o_l))[None, :]
    gl.store(o_base + (rows // H)[None, :] * so_s + (rows % H)[None, :] * so_h + cols[:, None],
             o.to(o_base.dtype.element_ty), mask=(rows < SH)[None, :])


def _scorer_src(k: gl.constexpr, NUM_SCORERS: gl.constexpr, salt, q_s, qr_s, g_s, tile_s, rope_s, sc_s, p_s, full,
                rope_full, empty, sync, start, end, n_tiles, sm_scale_log2, lse_scale, o_base, so_s, so_h, l_base, sl_s, sl_h,
                row0, H, SH, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, mk_s, qpos_row, sqp_s, cp_world, cp_rank,
                HAS_MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """Scorer k (of NUM_SCORERS, each a warpgroup): tiles k, k + NUM_SCORERS, ...: S^T, the
    online softmax over its keys (the mask row added, HAS_MASK; keys after a row's query position
    unseen, CAUSAL), P's four scaled copies, O^T; its own partial output and LSE."""
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_R, 16])
    key_l: gl.constexpr = gl.SliceLayout(1, s_mma)
    row_l: gl.constexpr = gl.SliceLayout(0, s_mma)
    g0 = g_s.index(0).load(row_l)
    g1 = g_s.index(1).load(row_l)
    g2 = g_s.index(2).load(row_l)
    g3 = g_s.index(3).load(row_l)
    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=row_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=s_mma)  # row sums, per key: reduced at the end
    u = gl.max(gl.zeros([BLOCK_N], gl.float32, layout=key_l), axis=0)  # P's unit: the largest key scale so far
    o0 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o1 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o2 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o3 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    keys = gl.arange(0, BLOCK_N, layout=key_l)
    if CAUSAL:  # each row's last visible local key (key k sits at global position k * cp_world + cp_rank)
        qpos = _row_positions(qpos_row, sqp_s, row0, H, SH, row_l, BLOCK_R, CAUSAL)
        last = gl.where(qpos >= cp_rank, (qpos - cp_rank) // cp_world, -1)
    else:
        last = 0
    n_mine = gl.maximum(gl.cdiv(n_tiles - k, NUM_SCORERS), 0)
    for i in range(n_mine):
        j = k + i * NUM_SCORERS
        t0 = start + j * BLOCK_N
        buf = _opaque(j + salt) % 2
        z = _opaque(j + salt) - j  # 0: the descriptors are formed here, not hoisted and spilled
        tile = tile_s.index(buf)
        q_lat = q_s.index(z)
        slot = _opaque(j + salt) % 3
        mbarrier.wait(full.index(buf), (j // 2) & 1)
        mbarrier.wait(rope_full.index(slot), (j // 3) & 1)
        fence_async_shared()  # the rope copies' writes before the tensor cores' reads
        zero = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=s_mma)
        sr = warpgroup_mma(rope_s.index(slot), qr_s.index(z).permute((1, 0)), zero, use_acc=False, is_async=True)
        s0 = warpgroup_mma(tile.slice(0, SB, dim=1), q_lat.slice(0, SB, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        s1 = warpgroup_mma(tile.slice(SB, SB, dim=1), q_lat.slice(SB, SB, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        s2 = warpgroup_mma(tile.slice(2 * SB, SB, dim=1), q_lat.slice(2 * SB, SB, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        s3 = warpgroup_mma(tile.slice(3 * SB, SB, dim=1), q_lat.slice(3 * SB, SB, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        c0 = sc_s.index(4 * buf).load(key_l)
        c1 = sc_s.index(4 * buf + 1).load(key_l)
        c2 = sc_s.index(4 * buf + 2).load(key_l)
        c3 = sc_s.index(4 * buf + 3).load(key_l)
        sr, s0, s1, s2, s3 = warpgroup_mma_wait(0, deps=[sr, s0, s1, s2, s3])
        s = sr + s0 * (c0[:, None] * g0[None, :]) + s1 * (c1[:, None] * g1[None, :]) \
            + s2 * (c2[:, None] * g2[None, :]) + s3 * (c3[:, None] * g3[None, :])
        valid = (t0 + keys) < end
        s = s * sm_scale_log2
        if HAS_MASK:
            s = s + mk_s.index(slot).load(key_l)[:, None] * 1.4426950408889634  # (landed with the rope rows)
        seen = valid[:, None]
        if CAUSAL:
            seen = seen & ((t0 + keys)[:, None] <= last[None, :])
        s = gl.where(seen, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[None, :])
        alpha = gl.exp2(m_i - m_use)
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        # P in units of the largest key scale so far (each copy in [0, 1])
        u_new = gl.maximum(u, gl.max(gl.where(valid, gl.maximum(gl.maximum(c0, c1), gl.maximum(c2, c3)), 0.0),
                                     axis=0))
        inv_u = gl.where(u_new > 0.0, 1.0 / u_new, 0.0)
        rescale = alpha * gl.where(u_new > 0.0, u * inv_u, 1.0)
        u = u_new
        p_s.index(z + 4 * k).store((p * (c0 * inv_u)[:, None]).to(gl.float16))
        p_s.index(z + 4 * k + 1).store((p * (c1 * inv_u)[:, None]).to(gl.float16))
        p_s.index(z + 4 * k + 2).store((p * (c2 * inv_u)[:, None]).to(gl.float16))
        p_s.index(z + 4 * k + 3).store((p * (c3 * inv_u)[:, None]).to(gl.float16))
        fence_async_shared()
        mbarrier.arrive(sync.index(k))  # (a partition barrier, then one arrival): every warp's P is stored
        mbarrier.wait(sync.index(k), i & 1)
        # O^T += V^T P^T, block by block (the f16 tile read transposed)
        o0 = warpgroup_mma(tile.slice(0, SB, dim=1).permute((1, 0)), p_s.index(z + 4 * k + 0), o0 * rescale[None, :],
                           is_async=True)
        o1 = warpgroup_mma(tile.slice(SB, SB, dim=1).permute((1, 0)), p_s.index(z + 4 * k + 1), o1 * rescale[None, :],
                           is_async=True)
        o2 = warpgroup_mma(tile.slice(2 * SB, SB, dim=1).permute((1, 0)), p_s.index(z + 4 * k + 2), o2 * rescale[None, :],
                           is_async=True)
        o3 = warpgroup_mma(tile.slice(3 * SB, SB, dim=1).permute((1, 0)), p_s.index(z + 4 * k + 3), o3 * rescale[None, :],
                           is_async=True)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3])
        mbarrier.arrive(empty.index(buf))  # the converter may refill this buffer

    l_i = gl.sum(l_acc, axis=0)
    o_scale = gl.where(l_i == 0.0, 0.0, u / gl.where(l_i == 0.0, 1.0, l_i))
    _store_block(o_base, o0, o_scale, 0, row0, so_s, so_h, H, SH)
    _store_block(o_base, o1, o_scale, 1, row0, so_s, so_h, H, SH)
    _store_block(o_base, o2, o_scale, 2, row0, so_s, so_h, H, SH)
    _store_block(o_base, o3, o_scale, 3, row0, so_s, so_h, H, SH)
    rows = row0 + gl.arange(0, BLOCK_R, layout=row_l)
    lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * lse_scale
    gl.store(l_base + (rows // H) * sl_s + (rows % H) * sl_h, lse, mask=rows < SH)


def _narrow_kernel_src(Q, QT, KV, KS, KT, LENS, O, L, T, H, SH, sm_scale_log2, lse_scale, lens_sb, lens_c, lens_r,
                       sq_b, sq_s, sq_h, sqt_b, sqt_s, sqt_h, skv_b, sks_b, sks_t, sks_c, skt_b8,
                       so_b, so_sp, so_s, so_h, sl_b, sl_sp, sl_s, sl_h,
                       MASK, QPOS, sm_b, sm_t, sqp_b, sqp_s, cp_world, cp_rank,
                       SKV_T: gl.constexpr, SKT_T: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_SCORERS: gl.constexpr, NUM_SPLITS: gl.constexpr, HAS_LENS: gl.constexpr,
                       L2_AHEAD: gl.constexpr, HAS_MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """One (BLOCK_R-row block, split, batch row): the parent region (scorer 0's warps) puts q
    into shared memory, then the converter and NUM_SCORERS scorers run the split's tiles; each
    scorer writes a partial of its own (partial index split * NUM_SCORERS + scorer).
    ``skt_b8``: the rope's batch stride in units of 8 elements (16 bytes: its cp.async vectors)."""
    pid_r = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    row0 = pid_r * BLOCK_R
    salt = pid_sp // NUM_SPLITS  # 0, which LLVM cannot prove

    # ---- queries: the latent part in f16 scaled per (row, 128-column block) by a power of two
    ld_q: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [4, 1, 1], [2, 1, 0])
    rq = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld_q)))
    bq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, ld_q)))
    cq = gl.arange(0, SB, layout=gl.SliceLayout(0, gl.SliceLayout(1, ld_q)))
    q_off = (rq // H)[:, None, None] * sq_s + (rq % H)[:, None, None] * sq_h + (bq[None, :, None] * SB
                                                                                   + cq[None, None, :])
    q = gl.load(Q + b * sq_b + q_off, mask=(rq < SH)[:, None, None], other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(q), axis=2)
    e = gl.floor(gl.log2(gl.where(amax > 0.0, amax, 1.0)))  # (NaN stays NaN: NaN in, NaN out)
    f = gl.exp2(13.0 - e)  # largest |q| of the block into [2^13, 2^14): f16's range, exactly
    # (buffers with a unit leading dimension are indexed with an opaque zero in every tile, so
    # that the wgmma descriptors are formed in the loop, not hoisted out of it and spilled)
    q_s = gl.allocate_shared_memory(gl.float16, [1, BLOCK_R, DL],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_R, DL], gl.float16))
    q_s.index(0).store(gl.reshape((q * f[:, :, None]).to(gl.float16), [BLOCK_R, DL]))
    # the factors that scale the partial scores back, one [BLOCK_R] vector per block
    g_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    inv_f = gl.exp2(e - 13.0)
    blk_i = gl.arange(0, 4, layout=gl.SliceLayout(0, inv_f.type.layout))
    for i in gl.static_range(4):
        g_s.index(i).store(gl.sum(gl.where(blk_i[None, :] == i, inv_f, 0.0), axis=1))
    ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ld_qr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
    q_rope = gl.load(QT + b * sqt_b + (rr // H)[:, None] * sqt_s + (rr % H)[:, None] * sqt_h + cr[None, :],
                     mask=(rr < SH)[:, None], other=0.0)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_R, DR],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_R, DR], gl.bfloat16))
    qr_s.index(0).store(q_rope)

    # ---- two buffers (the f16 tile both products read, its bf16 rope rows, its scales), P's copies
    tile_s = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, DL],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.float16))
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_N, DR],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16))
    # the next tile's fp8 words on their way in: one [BLOCK_N, 32]-word piece per 128-column block
    # (its two halves of a row swapped on odd rows: an 8-lane phase of _WORDS_LAYOUT's loads, two
    # rows x 64 bytes, then covers all 32 banks; one of _COPY_LAYOUT's copies writes a 128-byte row)
    stage_s = gl.allocate_shared_memory(gl.int32, [4, BLOCK_N, SB // 4], gl.SwizzledSharedLayout(16, 1, 2, [1, 0]))
    sc_s = gl.allocate_shared_memory(gl.float32, [2 * 4, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_s = gl.allocate_shared_memory(gl.float16, [NUM_SCORERS * 4, BLOCK_N, BLOCK_R],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], gl.float16))
    if HAS_MASK:  # each rope slot's tile: its mask entries
        mk_s = gl.allocate_shared_memory(gl.float32, [3, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        mk_s = sc_s  # unused
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    rope_full = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [NUM_SCORERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        # per fill: the converter once (a partition barrier, then one arrival) after its f16 and
        # scale stores
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(3):
        mbarrier.init(rope_full.index(i), count=128)  # every converter thread once its rope copies land
    for i in gl.static_range(NUM_SCORERS):
        mbarrier.init(sync.index(i), count=1)

    start, end = _split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    qpos_row = QPOS + b * sqp_b
    if CAUSAL:
        end = _causal_end(end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_R, BLOCK_R)  # (per thread)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    fence_async_shared()
    _barrier()  # q and the factors in shared memory before any partition reads them

    kv_words = (KV + b * skv_b).to(gl.pointer_type(gl.int32), bitcast=True)
    kt_row = KT + b * (skt_b8 * 8)
    ks_row = KS + b * sks_b
    o_base = O + b * so_b + (pid_sp * NUM_SCORERS) * so_sp
    l_base = L + b * sl_b + (pid_sp * NUM_SCORERS) * sl_sp
    if NUM_SCORERS == 1:
        gl.warp_specialize([
            (_scorer, (0, NUM_SCORERS, salt, q_s, qr_s, g_s, tile_s, rope_s, sc_s, p_s, full, rope_full, empty, sync, start, end, n_tiles,
                        sm_scale_log2, lse_scale, o_base, so_s, so_h, l_base, sl_s, sl_h, row0, H, SH, BLOCK_R,
                        BLOCK_N, mk_s, qpos_row, sqp_s, cp_world, cp_rank, HAS_MASK, CAUSAL)),
            (_converter, (salt, tile_s, rope_s, sc_s, stage_s, full, rope_full, empty, kv_words, ks_row, kt_row, sks_t, sks_c, start,
                          end, n_tiles, SKV_T // 4, SKT_T, BLOCK_N, KV + b * skv_b, L2_AHEAD, mk_s, MASK + b * sm_b, sm_t,
                          HAS_MASK)),
        ], [4], [152])
    else:
        gl.warp_specialize([
            (_scorer, (0, NUM_SCORERS, salt, q_s, qr_s, g_s, tile_s, rope_s, sc_s, p_s, full, rope_full, empty, sync, start, end, n_tiles,
                        sm_scale_log2, lse_scale, o_base, so_s, so_h, l_base, sl_s, sl_h, row0, H, SH, BLOCK_R,
                        BLOCK_N, mk_s, qpos_row, sqp_s, cp_world, cp_rank, HAS_MASK, CAUSAL)),
            (_scorer, (1, NUM_SCORERS, salt, q_s, qr_s, g_s, tile_s, rope_s, sc_s, p_s, full, rope_full, empty, sync, start, end, n_tiles,
                        sm_scale_log2, lse_scale, o_base + so_sp, so_s, so_h, l_base + sl_sp, sl_s, sl_h, row0, H,
                        SH, BLOCK_R, BLOCK_N, mk_s, qpos_row, sqp_s, cp_world, cp_rank, HAS_MASK, CAUSAL)),
            (_converter, (salt, tile_s, rope_s, sc_s, stage_s, full, rope_full, empty, kv_words, ks_row, kt_row, sks_t, sks_c, start,
                          end, n_tiles, SKV_T // 4, SKT_T, BLOCK_N, KV + b * skv_b, L2_AHEAD, mk_s, MASK + b * sm_b, sm_t,
                          HAS_MASK)),
        ], [4, 4], [168, 168])


if HAS_GLUON:
    _E4M3_F16_ASM = gl.constexpr(_E4M3_F16_ASM_TEXT)
    _to_f16 = gluon.jit(_to_f16_src)
    _prefetch_l2 = gluon.jit(_prefetch_l2_src)
    _issue_tile = gluon.jit(_issue_tile_src)
    _take_tile = gluon.jit(_take_tile_src)
    _issue_rope = gluon.jit(_issue_rope_src)
    _put = gluon.jit(_put_src)
    _converter = gluon.jit(_converter_src)
    _store_block = gluon.jit(_store_block_src)
    _scorer = gluon.jit(_scorer_src)
    _narrow_jit = gluon.jit(_narrow_kernel_src)


# --------------------------------------------------------------------------------------
# the registry's entry (kernel "gluon_fp8_narrow")
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the narrow fp8 kernel cannot run a call of this shape (None: it can): the fp8 Gluon
    calls (gluon_common.fp8_gluon_reason: a mask only as one row per request, any causal cap)."""
    return fp8_gluon_reason(shape)


def offered(shape) -> Optional[str]:
    """At most MAX_ROWS query rows (one row block reads the cache once), on the Triton it was
    timed with (3.6)."""
    if not roles_preferred(shape.triton):
        return "the narrow fp8 kernel is offered on Triton 3.6 only, where it was timed"
    if shape.rows > MAX_ROWS:
        return f"more than {MAX_ROWS} query rows: each {MAX_ROWS} would read the cache again"
    return None


def unmeasured(shape) -> bool:
    """False: the chooser takes it where its fp8 timings (path table, gluon_fp8_narrow) say so."""
    return False


def launch_args(call, out=None, lse_out=None, num_splits: Optional[int] = None,
                config: Optional[GluonConfig] = None, scorers: int = SCORERS):
    """(out, lse_out, None) when the outputs are final without a launch, else (out, lse_out,
    (grid, args, consts, stage-2 launch or None)) for a call's rank view (a ShardView).
    `scorers`: scorer warpgroups a program (1 or 2); each writes a partial of its own."""
    cfg = config or NARROW
    if (cfg.block_h, cfg.block_n) != (NARROW.block_h, NARROW.block_n):
        raise ValueError(f"the narrow fp8 Gluon kernel runs {NARROW.block_h}-row x {NARROW.block_n}-key tiles, "
                         f"not {cfg.block_h} x {cfg.block_n}")
    if scorers not in (1, 2):
        raise ValueError(f"the narrow fp8 Gluon kernel runs 1 or 2 scorer warpgroups, not {scorers}")
    if call.kv_scale is None:
        raise ValueError("the narrow fp8 Gluon kernel needs the latent's scales (kv_scale)")
    out, lse_out, done, frame = split_frame(call, out, lse_out, num_splits, cfg, partials_per_split=scorers)
    if done:
        return out, lse_out, None
    parts, n_rb, ns, (lens, lens_sb, lens_c, lens_r), (o_part, l_part, ops, lps, l_scale) = frame
    qm, qt, km, kt, ks = parts.q_main, parts.q_tail, parts.k_main, parts.k_tail, call.kv_scale
    if kt.stride(-1) != 1 or any(x % 8 for x in kt.stride()[:-1]) or kt.data_ptr() % 16:
        raise ValueError(f"the narrow fp8 Gluon kernel copies the rope rows 16 bytes at a time: it needs unit "
                         f"feature stride, 16-byte aligned data and strides of multiples of 8, got {tuple(kt.stride())}")
    if km.stride(-1) != 1 or km.stride(0) % 16 or km.stride(1) % 16 or km.data_ptr() % 16:
        raise ValueError(f"the narrow fp8 Gluon kernel reads the latent rows 16 bytes at a time: it needs unit "
                         f"feature stride, 16-byte aligned data and strides of multiples of 16, got "
                         f"{tuple(km.stride())}")
    if qm.stride(-1) != 1 or qt.stride(-1) != 1:
        raise ValueError("the narrow fp8 Gluon kernel needs queries with unit feature stride")
    B, S, H, _ = call.q_lat.shape
    T = km.shape[1]
    n_part = ns * scorers
    args = (qm, qt, km, ks, kt, lens, o_part, l_part,
            T, H, S * H, float(call.scale) * LOG2E, l_scale, lens_sb, lens_c, lens_r,
            *qm.stride()[:3], *qt.stride()[:3], km.stride(0), ks.stride(0), ks.stride(1), ks.stride(2),
            kt.stride(0) // 8, ops[0], ops[1], ops[2], ops[3], lps[0], lps[1], lps[2], lps[3])
    m_args, m_consts = mask_args(call, T, kt)
    args += m_args
    consts = dict(SKV_T=km.stride(1), SKT_T=kt.stride(1), BLOCK_R=cfg.block_h, BLOCK_N=cfg.block_n,
                  NUM_SCORERS=scorers, NUM_SPLITS=ns, HAS_LENS=call.kv_lens is not None,
                  L2_AHEAD=L2_AHEAD, **m_consts)
    stage2 = (reduce_launch(o_part, l_part, out, lse_out, H, call.lse_base, call.v_dim, n_part) if n_part > 1
              else None)
    return out, lse_out, ((n_rb, ns, B), args, consts, stage2)


def run(call: AttentionCall, out=None, lse_out=None, *, num_splits: Optional[int] = None,
        config: Optional[GluonConfig] = None, scorers: int = SCORERS):
    """Run the narrow fp8 kernel (plus the stage-2 merge of its partials); returns (out, lse_out)."""
    return launch_plan(_narrow_jit, *launch_args(call.shard(), out, lse_out, num_splits, config, scorers))
