"""Narrow-row fp8 MLA decode kernel in Gluon (Hopper): the keys are the wgmma's M dimension.

A rank of a DCP group with 16 heads runs 16 query rows over its stripe: the call is
memory-bound, and an fp8 cache (656 bytes a token instead of 1152) could make it 1.76x
faster. The fp8 role-split kernel (``fp8.py``) cannot: its 64-row tile does four
times the matrix work of 16 rows, which at 16 heads costs more than reading the cache. Here
both products are transposed so that the 64 keys of a tile fill the wgmma's 64 rows and the
query rows are its narrow N:

* scores ``S^T = K Q^T`` in fp8: M = 64 keys, K = each 128-column latent block (one
  accumulator a block, so that each block's per-key scale multiplies its partial scores
  exactly), N = 32: the 16 query rows twice, as two e4m3 parts ``hi = e4m3(q f)`` and
  ``lo = e4m3(16 (q f - hi))``, where ``f`` is the power of two that puts the row's largest
  value of the block into [2^7, 2^8). The A operand is the tile's e4m3 bytes as copied into
  shared memory: nothing converts them for this product. The 64 rope columns are a bf16
  product of their own;
* values ``O^T = V^T P^T``: M = 512 value columns (four 128-column blocks), N = 16 rows, K =
  64 keys, in f16: V^T is not K-major, which an fp8 operand must be, so each block's bytes
  go from shared memory into the wgmma's register operand, two keys' bytes paired by ``prmt``
  and converted to f16 exactly (the value columns permuted in registers, put back when the
  output is stored); each block's per-key scale multiplies P instead (four [64, 16] copies).

What is rounded: ``hi + lo / 16`` equals ``q f`` for every bf16 query value down to 2^-14 of its
block's largest (two e4m3 parts hold its 8 significant bits); the fp8 tensor cores add a
block's products with less than fp32's precision (LSE error ~1e-3, outputs as the bf16
kernels'); P is rounded once to f16 (11 bits). The cache is never rounded.

Three warpgroups a program (``gl.warp_specialize``): a *loader* stages each tile by TMA into
one of STAGES slots, once the scorer that held the slot has freed it: the e4m3 bytes (a [64,
128]-byte box per block, 128-byte-swizzled, the fp8 wgmma's operand layout), the bf16 rope rows
and the keys' four scales ([64, 4], key-major), one expected byte count on the slot's barrier
(a decode step's mask entries by ``cp.async`` beside them). Issuing six boxes a tile leaves the
loader almost no work and few registers: the scorers get 224 each, and the stream alone runs
6 % faster than 128 threads' copies did (the whole kernel 14 %). Two *scorers* take
alternate tiles (scorer k the tiles k, k + 2, ...), each with its own running max, row sums and
output, and write partials of their own that the split kernel's stage-2 merge combines; a
scorer zeroes a split's last tile past its end (TMA copies what the cache holds there), and
frees its slot once the last block's value operand is in registers. Four slots: 199
KiB of shared memory. A scorer's row sums are kept per key and row ([64, 16], rescaled with
the running max) and reduced once at the end; its running max crosses its warps once a tile.

Scope: an fp8 e4m3 latent of 512 columns with its fp32 scales (4 a token), 64 bf16 rope
columns (packed rows or a buffer of their own), bf16 queries, kv_lens with ``lens_stripe``, a
decode step's mask row per request (its entries staged with the tile) and any causal cap (each
row's last visible key compared per tile; the split's keys cut at the block's last), 16-byte
aligned rows; the split kernel's partials and stage-2 merge.
The registry's "gluon_fp8_narrow" kernel, offered for calls of at most 16 query rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common import LOG2E, AttentionCall
from ..splits import reduce_launch
from .common import HAS_GLUON, GluonConfig, fp8_gluon_reason, launch_plan, mask_args, roles_preferred, split_frame

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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .common import (  # noqa: F401
        BUILD_ERRORS,
        async_load,
        barrier,
        causal_end,
        copy_mask,
        opaque,
        row_positions,
        split_keys,
        tma_load,
    )

__all__ = ["NARROW", "supports", "offered", "unmeasured", "run", "launch_args"]

NARROW = GluonConfig(block_h=16, block_n=64, stages=4)  # query rows (N), keys (M), staged tiles
SCORERS = 2  # scorer warpgroups a program, beside the loader
SCORER_REGS, LOADER_REGS = 224, 64  # registers a thread of each worker partition (the loader only issues copies)
SB_W = 128  # a latent row's 512 e4m3 bytes as 4-byte words
MAX_ROWS = 16  # the rows the chooser offers it for (more rows re-read the cache once per 16)

if HAS_GLUON:
    DL, DR, SB = gl.constexpr(512), gl.constexpr(64), gl.constexpr(128)
    # the values operand V^T [128 value columns, 64 keys] of one block, as the words a scorer reads
    # from the staged bytes: a thread holds keys 2 (l % 4) + i + 8 hi + 16 kk of word (four value
    # columns) 8 w + l // 4, so that pairing two keys' bytes gives the wgmma's register operand
    # with no data between threads (the value columns permuted: _store_block puts them back)
    _PV_WORDS = gl.constexpr(
        gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=[[0, 8], [0, 16]],
            block_bases=[],
            shape=[64, 32],
        )
    )
    _A_OP = gl.constexpr(
        gl.DotOperandLayout(
            0, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]), 2
        )
    )
    # a block's [64 keys, 128] e4m3 bytes as 4-byte words, and as the fp8 wgmma reads them
    _WORDS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    _BYTES_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    _REINTERPRET_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    # the staged pieces as rank-3 TMA boxes [1, rows, columns] (batch row, keys, columns): a unit
    # leading dimension moves no address. Built once: the host's descriptors take the same objects
    # (constructing them costs microseconds a call)
    _WORDS3, _ROPE3, _SCALES3 = (
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3),
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3),
    )
    _WORDS3_SMEM, _ROPE3_SMEM, _SCALES3_SMEM = gl.constexpr(_WORDS3), gl.constexpr(_ROPE3), gl.constexpr(_SCALES3)
    # a block's [128 value columns, 16 rows] of output in column order: a thread's registers hold
    # four adjacent columns first (the stores' 16-byte vectors), eight lanes a row's 32 columns
    _STORE_LAYOUT = gl.constexpr(
        gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [2, 0], [0, 1], [0, 8]],
            lane_bases=[[0, 2], [0, 4], [4, 0], [8, 0], [16, 0]],
            warp_bases=[[32, 0], [64, 0]],
            block_bases=[],
            shape=[128, 16],
        )
    )
    # a tile's scales [64 keys, 4 blocks] as a scorer reads them: a thread holds its score rows'
    # keys (those of SliceLayout(1, the score accumulator)) with all four blocks, so that two
    # splits give each block's vector in the scorer's own layout
    _SCALES4 = gl.constexpr(
        gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]],
            lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[64, 4],
        )
    )

# two keys' words (four value columns each) -> eight f16: for value column c, byte c of both words
# (prmt selector 0x40 + 0x11 c) becomes one f16 pair (outputs 2c, 2c + 1)
_PAIRS_ASM_TEXT = (
    "{\n.reg .b32 t, p;\n.reg .b16 l, u;\n"
    + "".join(
        f"prmt.b32 t, $8, $9, {0x40 + 0x11 * c:#x};\nmov.b32 {{l, u}}, t;\ncvt.rn.f16x2.e4m3x2 p, l;\n"
        f"mov.b32 {{${2 * c}, ${2 * c + 1}}}, p;\n"
        for c in range(4)
    )
    + "}"
)


def _pv_operand_src(words_s, piece):
    """A staged block's V^T [128 value columns (permuted), 64 keys] in f16, as the values
    product's register operand (exact: every e4m3 value is an f16)."""
    x = words_s.index(piece).load(_PV_WORDS)
    x = gl.reshape(x, [4, 2, 4, 2, 32])  # [kk, hi, c, i, q]
    x = gl.permute(x, (0, 1, 2, 4, 3))  # [kk, hi, c, q, i]
    xa, xb = gl.split(x)
    o = gl.inline_asm_elementwise(
        _PAIRS_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [xa, xb], dtype=(gl.float16,) * 8, is_pure=True, pack=1
    )
    t = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    t = gl.reshape(t, [4, 2, 4, 4, 8, 2, 2, 2])  # [kk, hi, c, w, r, i, a, b]
    t = gl.permute(t, (7, 3, 6, 4, 0, 1, 2, 5))  # [b, w, a, r, kk, hi, c, i]
    return gl.convert_layout(gl.reshape(t, [SB, 64]), _A_OP, assert_trivial=True)


def _hi_lo_src(acc, s_layout: gl.constexpr):
    """A block's [64 keys, 32] fp8 scores (B column n: query row n % 8 + 8 (n // 16), part
    (n // 8) % 2) -> [64, 16] scores of the rows, hi + lo / 16 (no data between threads)."""
    a = gl.reshape(acc, [64, 2, 2, 8])  # [key, row // 8, part, row % 8]
    a = gl.permute(a, (0, 1, 3, 2))
    hi, lo = gl.split(gl.reshape(a, [64, 16, 2]))
    return gl.convert_layout(hi + lo * 0.0625, s_layout, assert_trivial=True)


def _loader_src(
    words_s,
    rope_s,
    sc_s,
    mk_s,
    full,
    free,
    kvd,
    ktd,
    ksd,
    b,
    start,
    end,
    n_tiles,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    mk_row,
    sm_t,
    HAS_MASK: gl.constexpr,
):
    """The loader (a 4-warp worker): tile j into slot j % STAGES once the scorer that held it freed
    it, by TMA: the e4m3 bytes (four [64, 128]-byte boxes, 128-byte-swizzled: the fp8 wgmma's
    operand layout), the bf16 rope rows and the keys' scales ([64, 4] fp32, key-major), one
    expected byte count on the slot's barrier; a decode step's mask entries by cp.async (each
    thread arrives when its copies land). Keys past T arrive as zeros; keys past the split's
    end within T as the cache holds them (the scorer zeroes or masks them)."""
    # (the slots as rank-3 boxes' destinations [n, 1, rows, columns]: a unit dimension moves no address)
    words3 = _reinterpreted(words_s, gl.int32, [STAGES * 4, 1, BLOCK_N, SB // 4], _WORDS3_SMEM)
    rope3 = _reinterpreted(rope_s, gl.bfloat16, [STAGES, 1, BLOCK_N, DR], _ROPE3_SMEM)
    sc3 = _reinterpreted(sc_s, gl.float32, [STAGES, 1, BLOCK_N, 4], _SCALES3_SMEM)
    for j in range(n_tiles):
        slot = j % STAGES
        mbarrier.wait(free.index(slot), ((j // STAGES) & 1) ^ 1)
        t0 = start + j * BLOCK_N
        bar = full.index(slot)
        mbarrier.expect(bar, BLOCK_N * (4 * SB + 2 * DR + 16))
        for blk in gl.static_range(4):
            tma_load(kvd, [b, t0, blk * (SB // 4)], bar, words3.index(4 * slot + blk))
        tma_load(ktd, [b, t0, 0], bar, rope3.index(slot))
        tma_load(ksd, [b, t0, 0], bar, sc3.index(slot))
        if HAS_MASK:
            copy_mask(mk_s.index(slot), mk_row, t0, end, sm_t, BLOCK_N)
            cp.mbarrier_arrive(bar, increment_count=False)
            cp.commit_group()
    if HAS_MASK:
        cp.wait_group(0)


def _reinterpreted_src(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """The same shared memory as another type, shape and layout (the method's name moved between
    Triton 3.6 and 3.9)."""
    if _REINTERPRET_PUBLIC:
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)


def _zero_tail_src(words_s, slot, t0, end, BLOCK_N: gl.constexpr):
    """A partial tile's keys past the split's end set to zero in its four byte pieces: TMA copied
    what the cache holds there, and P's zero times a NaN byte would be NaN."""
    zl: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    keep = ((t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zl))) < end)[:, None]
    for blk in gl.static_range(4):
        w = words_s.index(4 * slot + blk)
        w.store(gl.where(keep, w.load(zl), 0))


def _tile_scales_src(sc_s, slot, valid, key_l: gl.constexpr):
    """The tile's four block scales as [64] vectors in the scorer's key layout, zero past the
    split's end (whatever the cache holds there must not reach P)."""
    t = gl.reshape(sc_s.index(slot).load(_SCALES4), [64, 2, 2])  # [key, block // 2, block % 2]
    even, odd = gl.split(t)
    c0, c2 = gl.split(even)
    c1, c3 = gl.split(odd)
    c0 = gl.where(valid, gl.convert_layout(c0, key_l, assert_trivial=True), 0.0)
    c1 = gl.where(valid, gl.convert_layout(c1, key_l, assert_trivial=True), 0.0)
    c2 = gl.where(valid, gl.convert_layout(c2, key_l, assert_trivial=True), 0.0)
    c3 = gl.where(valid, gl.convert_layout(c3, key_l, assert_trivial=True), 0.0)
    return c0, c1, c2, c3


def _store_block_src(o_base, acc, scale_r, blk: gl.constexpr, row0, so_s, so_h, H, SH):
    """Output columns of block blk from O^T's accumulator. Its rows (logical 64 b + 16 w + 8 a + r,
    physical value column 4 (8 w + r) + a + 2 b) are put in column order in registers, so that a
    thread stores four adjacent columns of a row at once and eight lanes a row's 128 bytes (the
    accumulator's own order wrote 4-byte pieces 16 bytes apart: 8 us a call on the H200)."""
    o = acc * gl.convert_layout(scale_r, gl.SliceLayout(0, acc.type.layout))[None, :]
    o = gl.permute(gl.reshape(o, [2, 4, 2, 8, acc.shape[1]]), (1, 3, 0, 2, 4))  # [b, w, a, r, n] -> [w, r, b, a, n]
    o = gl.convert_layout(gl.reshape(o, [SB, acc.shape[1]]), _STORE_LAYOUT)  # (registers reordered in place)
    cols = blk * SB + gl.arange(0, SB, layout=gl.SliceLayout(1, _STORE_LAYOUT))
    rows = row0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, _STORE_LAYOUT))
    gl.store(
        o_base + (rows // H)[None, :] * so_s + (rows % H)[None, :] * so_h + cols[:, None],
        o.to(o_base.dtype.element_ty),
        mask=(rows < SH)[None, :],
    )


def _scorer_src(
    k: gl.constexpr,
    NUM_SCORERS: gl.constexpr,
    salt,
    q_s,
    qr_s,
    g_s,
    words_s,
    bytes_s,
    rope_s,
    sc_s,
    p_s,
    full,
    free,
    sync,
    start,
    end,
    n_tiles,
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
    BLOCK_R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    mk_s,
    qpos_row,
    sqp_s,
    cp_world,
    cp_rank,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """Scorer k (of NUM_SCORERS, each a warpgroup): tiles k, k + NUM_SCORERS, ...: S^T (fp8, from
    the staged bytes), the online softmax over its keys (the mask row added, HAS_MASK; keys after
    a row's query position unseen, CAUSAL), P's four scaled copies, O^T (f16, the staged bytes
    converted in registers); its own partial output and LSE."""
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_R, 16])
    s8_mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_R, 32]
    )
    key_l: gl.constexpr = gl.SliceLayout(1, s_mma)
    row_l: gl.constexpr = gl.SliceLayout(0, s_mma)
    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=row_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=s_mma)  # row sums, per key: reduced at the end
    u = gl.max(gl.zeros([BLOCK_N], gl.float32, layout=key_l), axis=0)  # P's unit: the largest key scale so far
    o0 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o1 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o2 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o3 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    keys = gl.arange(0, BLOCK_N, layout=key_l)
    if CAUSAL:  # each row's last visible local key (key k sits at global position k * cp_world + cp_rank)
        qpos = row_positions(qpos_row, sqp_s, row0, H, SH, row_l, BLOCK_R, CAUSAL)
        last = gl.where(qpos >= cp_rank, (qpos - cp_rank) // cp_world, -1)
    else:
        last = 0
    n_mine = gl.maximum(gl.cdiv(n_tiles - k, NUM_SCORERS), 0)
    for i in range(n_mine):
        j = k + i * NUM_SCORERS
        t0 = start + j * BLOCK_N
        slot = opaque(j + salt) % STAGES
        z = opaque(j + salt) - j  # 0: the descriptors are formed here, not hoisted and spilled
        q8 = q_s.index(z)
        mbarrier.wait(full.index(slot), (j // STAGES) & 1)
        valid = (t0 + keys) < end
        if t0 + BLOCK_N > end:  # (the split's last tile)
            _zero_tail(words_s, slot, t0, end, BLOCK_N)
            barrier()
            fence_async_shared()  # the zeros before the tensor cores' reads
        zero = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=s_mma)
        zero8 = gl.zeros([BLOCK_N, 2 * BLOCK_R], gl.float32, layout=s8_mma)
        sr = warpgroup_mma(rope_s.index(slot), qr_s.index(z).permute((1, 0)), zero, use_acc=False, is_async=True)
        c0, c1, c2, c3 = _tile_scales(sc_s, slot, valid, key_l)
        # two blocks' accumulators in flight, each added once done (four at once: more registers
        # live, and slower on the H200)
        a0 = warpgroup_mma(
            bytes_s.index(4 * slot), q8.slice(0, SB, dim=1).permute((1, 0)), zero8, use_acc=False, is_async=True
        )
        a1 = warpgroup_mma(
            bytes_s.index(4 * slot + 1), q8.slice(SB, SB, dim=1).permute((1, 0)), zero8, use_acc=False, is_async=True
        )
        sr, a0 = warpgroup_mma_wait(1, deps=[sr, a0])
        s = sr + _hi_lo(a0, s_mma) * (c0[:, None] * g_s.index(0).load(row_l)[None, :])
        a2 = warpgroup_mma(
            bytes_s.index(4 * slot + 2),
            q8.slice(2 * SB, SB, dim=1).permute((1, 0)),
            zero8,
            use_acc=False,
            is_async=True,
        )
        a1 = warpgroup_mma_wait(1, deps=[a1])
        s = s + _hi_lo(a1, s_mma) * (c1[:, None] * g_s.index(1).load(row_l)[None, :])
        a3 = warpgroup_mma(
            bytes_s.index(4 * slot + 3),
            q8.slice(3 * SB, SB, dim=1).permute((1, 0)),
            zero8,
            use_acc=False,
            is_async=True,
        )
        a2 = warpgroup_mma_wait(1, deps=[a2])
        s = s + _hi_lo(a2, s_mma) * (c2[:, None] * g_s.index(2).load(row_l)[None, :])
        a3 = warpgroup_mma_wait(0, deps=[a3])
        s = s + _hi_lo(a3, s_mma) * (c3[:, None] * g_s.index(3).load(row_l)[None, :])
        s = s * sm_scale_log2
        if HAS_MASK:
            s = s + mk_s.index(slot).load(key_l)[:, None] * 1.4426950408889634  # (staged with the tile)
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
        u_new = gl.maximum(u, gl.max(gl.maximum(gl.maximum(c0, c1), gl.maximum(c2, c3)), axis=0))
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
        # O^T += V^T P^T, block by block, two blocks' register operands at a time
        v0 = _pv_operand(words_s, 4 * slot)
        o0 = warpgroup_mma(v0, p_s.index(z + 4 * k + 0), o0 * rescale[None, :], is_async=True)
        v1 = _pv_operand(words_s, 4 * slot + 1)
        o1 = warpgroup_mma(v1, p_s.index(z + 4 * k + 1), o1 * rescale[None, :], is_async=True)
        o0, v0 = warpgroup_mma_wait(1, deps=[o0, v0])
        v2 = _pv_operand(words_s, 4 * slot + 2)
        o2 = warpgroup_mma(v2, p_s.index(z + 4 * k + 2), o2 * rescale[None, :], is_async=True)
        o1, v1 = warpgroup_mma_wait(1, deps=[o1, v1])
        v3 = _pv_operand(words_s, 4 * slot + 3)
        mbarrier.arrive(free.index(slot))  # every operand of the slot is read (the score GEMMs waited above)
        o3 = warpgroup_mma(v3, p_s.index(z + 4 * k + 3), o3 * rescale[None, :], is_async=True)
        o2, o3, v2, v3 = warpgroup_mma_wait(0, deps=[o2, o3, v2, v3])

    l_i = gl.sum(l_acc, axis=0)
    o_scale = gl.where(l_i == 0.0, 0.0, u / gl.where(l_i == 0.0, 1.0, l_i))
    _store_block(o_base, o0, o_scale, 0, row0, so_s, so_h, H, SH)
    _store_block(o_base, o1, o_scale, 1, row0, so_s, so_h, H, SH)
    _store_block(o_base, o2, o_scale, 2, row0, so_s, so_h, H, SH)
    _store_block(o_base, o3, o_scale, 3, row0, so_s, so_h, H, SH)
    rows = row0 + gl.arange(0, BLOCK_R, layout=row_l)
    lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * lse_scale
    gl.store(l_base + (rows // H) * sl_s + (rows % H) * sl_h, lse, mask=rows < SH)


def _block_exponents_src(Q, b, sq_b, sq_s, sq_h, rq, H, SH, ld_q: gl.constexpr):
    """The queries of block rows `rq` as fp32 [rows, 4 blocks, 128] (layout ld_q) and, per row and
    block, the exponent of the largest magnitude (0 for an all-zero block; NaN stays NaN)."""
    bq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, ld_q)))
    cq = gl.arange(0, SB, layout=gl.SliceLayout(0, gl.SliceLayout(1, ld_q)))
    q_off = (
        (rq // H)[:, None, None] * sq_s + (rq % H)[:, None, None] * sq_h + (bq[None, :, None] * SB + cq[None, None, :])
    )
    q = gl.load(Q + b * sq_b + q_off, mask=(rq < SH)[:, None, None], other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(q), axis=2)
    return q, gl.floor(gl.log2(gl.where(amax > 0.0, amax, 1.0)))


def _narrow_kernel_src(
    Q,
    QT,
    KVD,
    KTD,
    KSD,
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
    BLOCK_R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SCORERS: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    HAS_LENS: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """One (BLOCK_R-row block, split, batch row): the parent region (scorer 0's warps) puts the
    queries' e4m3 parts into shared memory, then the loader and NUM_SCORERS scorers run the
    split's tiles; each scorer writes a partial of its own (partial index split * NUM_SCORERS +
    scorer). KVD, KTD, KSD: TMA descriptors of the latent's bytes (as 4-byte words), the rope
    rows and the scales, each [B, T, columns]."""
    pid_r = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    row0 = pid_r * BLOCK_R
    salt = pid_sp // NUM_SPLITS  # 0, which LLVM cannot prove

    # ---- queries: per (row, 128-column block) scaled by the power of two f that puts the largest
    # |q| into [2^7, 2^8) (e4m3 reaches 448), then two e4m3 parts, hi = e4m3(q f) and lo =
    # e4m3(16 (q f - hi)); B column n of a block's score product: row n % 8 + 8 (n // 16), part
    # (n // 8) % 2, so that a thread's accumulator holds both parts of its rows (_hi_lo)
    ld_q: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [4, 1, 1], [2, 1, 0])
    nq = gl.arange(0, 2 * BLOCK_R, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld_q)))
    q, e = _block_exponents(Q, b, sq_b, sq_s, sq_h, row0 + nq % 8 + 8 * (nq // 16), H, SH, ld_q)
    qf = q * gl.exp2(7.0 - e)[:, :, None]
    hi = qf.to(gl.float8e4nv)
    lo = ((qf - hi.to(gl.float32)) * 16.0).to(gl.float8e4nv)
    # (buffers with a unit leading dimension are indexed with an opaque zero in every tile, so
    # that the wgmma descriptors are formed in the loop, not hoisted out of it and spilled)
    q_s = gl.allocate_shared_memory(
        gl.float8e4nv, [1, 2 * BLOCK_R, DL], gl.NVMMASharedLayout.get_default_for([2 * BLOCK_R, DL], gl.float8e4nv)
    )
    q_s.index(0).store(gl.reshape(gl.where((((nq // 8) % 2) == 0)[:, None, None], hi, lo), [2 * BLOCK_R, DL]))
    # the factors that scale a block's partial scores back, 2^(e - 7), one [BLOCK_R] vector per block
    rg = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld_q)))
    _, eg = _block_exponents(Q, b, sq_b, sq_s, sq_h, rg, H, SH, ld_q)
    g_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    inv_f = gl.exp2(eg - 7.0)
    blk_i = gl.arange(0, 4, layout=gl.SliceLayout(0, inv_f.type.layout))
    for i in gl.static_range(4):
        g_s.index(i).store(gl.sum(gl.where(blk_i[None, :] == i, inv_f, 0.0), axis=1))
    ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ld_qr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
    q_rope = gl.load(
        QT + b * sqt_b + (rr // H)[:, None] * sqt_s + (rr % H)[:, None] * sqt_h + cr[None, :],
        mask=(rr < SH)[:, None],
        other=0.0,
    )
    qr_s = gl.allocate_shared_memory(
        gl.bfloat16, [1, BLOCK_R, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_R, DR], gl.bfloat16)
    )
    qr_s.index(0).store(q_rope)

    # ---- STAGES slots (the tile's e4m3 bytes, one piece a block; its rope rows, scales and mask
    # entries); P's copies
    words_s = gl.allocate_shared_memory(gl.int32, [STAGES * 4, BLOCK_N, SB // 4], _WORDS_SMEM)
    bytes_s = _reinterpreted(words_s, gl.float8e4nv, [STAGES * 4, BLOCK_N, SB], _BYTES_SMEM)  # (as the fp8 wgmma reads)
    rope_s = gl.allocate_shared_memory(
        gl.bfloat16, [STAGES, BLOCK_N, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16)
    )
    sc_s = gl.allocate_shared_memory(
        gl.float32, [STAGES, BLOCK_N, 4], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    )
    p_s = gl.allocate_shared_memory(
        gl.float16,
        [NUM_SCORERS * 4, BLOCK_N, BLOCK_R],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], gl.float16),
    )
    if HAS_MASK:
        mk_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        mk_s = sc_s  # unused
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [NUM_SCORERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1 + 128 * HAS_MASK)  # the expected bytes (+ every loader thread's copies)
        mbarrier.init(free.index(i), count=1)  # the scorer that took the slot (a partition barrier, then one arrival)
    for i in gl.static_range(NUM_SCORERS):
        mbarrier.init(sync.index(i), count=1)

    start, end = split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    qpos_row = QPOS + b * sqp_b
    if CAUSAL:
        end = causal_end(end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_R, BLOCK_R)  # (per thread)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    fence_async_shared()
    barrier()  # the queries and the factors in shared memory before any partition reads them

    mk_row = MASK + b * sm_b
    o_base = O + b * so_b + (pid_sp * NUM_SCORERS) * so_sp
    l_base = L + b * sl_b + (pid_sp * NUM_SCORERS) * sl_sp
    if NUM_SCORERS == 1:
        gl.warp_specialize(
            [
                (
                    _scorer,
                    (
                        0,
                        NUM_SCORERS,
                        salt,
                        q_s,
                        qr_s,
                        g_s,
                        words_s,
                        bytes_s,
                        rope_s,
                        sc_s,
                        p_s,
                        full,
                        free,
                        sync,
                        start,
                        end,
                        n_tiles,
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
                        BLOCK_R,
                        BLOCK_N,
                        STAGES,
                        mk_s,
                        qpos_row,
                        sqp_s,
                        cp_world,
                        cp_rank,
                        HAS_MASK,
                        CAUSAL,
                    ),
                ),
                (
                    _loader,
                    (
                        words_s,
                        rope_s,
                        sc_s,
                        mk_s,
                        full,
                        free,
                        KVD,
                        KTD,
                        KSD,
                        b.to(gl.int32),
                        start,
                        end,
                        n_tiles,
                        BLOCK_N,
                        STAGES,
                        mk_row,
                        sm_t,
                        HAS_MASK,
                    ),
                ),
            ],
            [4],
            [LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _scorer,
                    (
                        0,
                        NUM_SCORERS,
                        salt,
                        q_s,
                        qr_s,
                        g_s,
                        words_s,
                        bytes_s,
                        rope_s,
                        sc_s,
                        p_s,
                        full,
                        free,
                        sync,
                        start,
                        end,
                        n_tiles,
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
                        BLOCK_R,
                        BLOCK_N,
                        STAGES,
                        mk_s,
                        qpos_row,
                        sqp_s,
                        cp_world,
                        cp_rank,
                        HAS_MASK,
                        CAUSAL,
                    ),
                ),
                (
                    _scorer,
                    (
                        1,
                        NUM_SCORERS,
                        salt,
                        q_s,
                        qr_s,
                        g_s,
                        words_s,
                        bytes_s,
                        rope_s,
                        sc_s,
                        p_s,
                        full,
                        free,
                        sync,
                        start,
                        end,
                        n_tiles,
                        sm_scale_log2,
                        lse_scale,
                        o_base + so_sp,
                        so_s,
                        so_h,
                        l_base + sl_sp,
                        sl_s,
                        sl_h,
                        row0,
                        H,
                        SH,
                        BLOCK_R,
                        BLOCK_N,
                        STAGES,
                        mk_s,
                        qpos_row,
                        sqp_s,
                        cp_world,
                        cp_rank,
                        HAS_MASK,
                        CAUSAL,
                    ),
                ),
                (
                    _loader,
                    (
                        words_s,
                        rope_s,
                        sc_s,
                        mk_s,
                        full,
                        free,
                        KVD,
                        KTD,
                        KSD,
                        b.to(gl.int32),
                        start,
                        end,
                        n_tiles,
                        BLOCK_N,
                        STAGES,
                        mk_row,
                        sm_t,
                        HAS_MASK,
                    ),
                ),
            ],
            [4, 4],
            [SCORER_REGS, LOADER_REGS],
        )


if HAS_GLUON:
    _PAIRS_ASM = gl.constexpr(_PAIRS_ASM_TEXT)
    LOADER_REGS = gl.constexpr(LOADER_REGS)
    SCORER_REGS = gl.constexpr(SCORER_REGS)
    _pv_operand = gluon.jit(_pv_operand_src)
    _hi_lo = gluon.jit(_hi_lo_src)
    _loader = gluon.jit(_loader_src)
    _reinterpreted = gluon.jit(_reinterpreted_src)
    _zero_tail = gluon.jit(_zero_tail_src)
    _tile_scales = gluon.jit(_tile_scales_src)
    _store_block = gluon.jit(_store_block_src)
    _scorer = gluon.jit(_scorer_src)
    _block_exponents = gluon.jit(_block_exponents_src)
    _narrow_jit = gluon.jit(_narrow_kernel_src)


# --------------------------------------------------------------------------------------
# the registry's entry (kernel "gluon_fp8_narrow")
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the narrow fp8 kernel cannot run a call of this shape (None: it can): the fp8 Gluon
    calls (common.fp8_gluon_reason: a mask only as one row per request, any causal cap)."""
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


def tile_descriptors(km, kt, ks, block_n: int):
    """TMA descriptors [B, T, columns] of a call's latent bytes (as 4-byte words, boxes of [64 keys,
    128 bytes]), rope rows (bf16, [64, 64]) and scales (fp32, [64, 4]); TMA reads 16-byte aligned
    rows with strides of multiples of 16 bytes and unit column stride, and refuses anything else here
    (with what to change), not later in the launch."""
    for what, t in (("latent rows", km), ("rope rows", kt), ("scales", ks)):
        nbytes = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(x * nbytes % 16 for x in t.stride()[:-1]):
            raise ValueError(
                f"the narrow fp8 Gluon kernel reads the {what} by TMA 16 bytes at a time: it needs unit "
                f"feature stride, 16-byte aligned data and strides of multiples of 16 bytes, got "
                f"{tuple(t.stride())} ({t.dtype})"
            )
    B, T = km.shape[0], km.shape[1]
    words = km.view(torch.int32)
    return (
        TensorDescriptor(words, [B, T, SB_W], list(words.stride()), [1, block_n, 32], _WORDS3),
        TensorDescriptor(kt, [B, T, 64], list(kt.stride()), [1, block_n, 64], _ROPE3),
        TensorDescriptor(ks, [B, T, 4], list(ks.stride()), [1, block_n, 4], _SCALES3),
    )


def launch_args(
    call,
    out=None,
    lse_out=None,
    num_splits: Optional[int] = None,
    config: Optional[GluonConfig] = None,
    scorers: int = SCORERS,
):
    """(out, lse_out, None) when the outputs are final without a launch, else (out, lse_out,
    (grid, args, consts, stage-2 launch or None)) for a call's rank view (a ShardView).
    `scorers`: scorer warpgroups a program (1 or 2); each writes a partial of its own."""
    cfg = config or NARROW
    if (cfg.block_h, cfg.block_n) != (NARROW.block_h, NARROW.block_n):
        raise ValueError(
            f"the narrow fp8 Gluon kernel runs {NARROW.block_h}-row x {NARROW.block_n}-key tiles, "
            f"not {cfg.block_h} x {cfg.block_n}"
        )
    if scorers not in (1, 2):
        raise ValueError(f"the narrow fp8 Gluon kernel runs 1 or 2 scorer warpgroups, not {scorers}")
    if call.kv_scale is None:
        raise ValueError("the narrow fp8 Gluon kernel needs the latent's scales (kv_scale)")
    out, lse_out, done, frame = split_frame(call, out, lse_out, num_splits, cfg, partials_per_split=scorers)
    if done:
        return out, lse_out, None
    parts, n_rb, ns, (lens, lens_sb, lens_c, lens_r), (o_part, l_part, ops, lps, l_scale) = frame
    qm, qt, km, kt, ks = parts.q_main, parts.q_tail, parts.k_main, parts.k_tail, call.kv_scale
    if qm.stride(-1) != 1 or qt.stride(-1) != 1:
        raise ValueError("the narrow fp8 Gluon kernel needs queries with unit feature stride")
    B, S, H, _ = call.q_lat.shape
    kvd, ktd, ksd = tile_descriptors(km, kt, ks, cfg.block_n)
    T = km.shape[1]
    n_part = ns * scorers
    args = (
        qm,
        qt,
        kvd,
        ktd,
        ksd,
        lens,
        o_part,
        l_part,
        T,
        H,
        S * H,
        float(call.scale) * LOG2E,
        l_scale,
        lens_sb,
        lens_c,
        lens_r,
        *qm.stride()[:3],
        *qt.stride()[:3],
        ops[0],
        ops[1],
        ops[2],
        ops[3],
        lps[0],
        lps[1],
        lps[2],
        lps[3],
    )
    m_args, m_consts = mask_args(call, T, kt)
    args += m_args
    consts = dict(
        BLOCK_R=cfg.block_h,
        BLOCK_N=cfg.block_n,
        NUM_SCORERS=scorers,
        NUM_SPLITS=ns,
        HAS_LENS=call.kv_lens is not None,
        STAGES=cfg.stages,
        **m_consts,
    )
    stage2 = reduce_launch(o_part, l_part, out, lse_out, H, call.lse_base, call.v_dim, n_part) if n_part > 1 else None
    return out, lse_out, ((n_rb, ns, B), args, consts, stage2)


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[GluonConfig] = None,
    scorers: int = SCORERS,
):
    """Run the narrow fp8 kernel (plus the stage-2 merge of its partials); returns (out, lse_out)."""
    return launch_plan(_narrow_jit, *launch_args(call.shard(), out, lse_out, num_splits, config, scorers))
