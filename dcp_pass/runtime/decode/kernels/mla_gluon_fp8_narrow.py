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

One warpgroup a program; a tile's fp8 bytes and bf16 rope rows arrive by ``cp.async`` into a
ring of STAGES staging buffers (the scales by plain loads a tile ahead, in registers), are
converted into the f16 tile, then the two products run one after the other. The row sums
are kept per key and row ([64, 16], rescaled with the running max) and reduced once at the
end; the running max crosses the warps once a tile (``gl.max`` over keys).

Scope: an fp8 e4m3 latent of 512 columns with its fp32 scales (4 a token), 64 bf16 rope
columns (packed rows or a buffer of their own), bf16 queries, kv_lens with ``lens_stripe``,
no mask or causal cap, 16-byte aligned rows; the split kernel's partials and stage-2 merge.
The registry's "gluon_fp8_narrow" kernel, offered for calls of at most 16 query rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from .common import LOG2E, AttentionCall, launch, only_reference
from .gluon_common import D_LAT, D_ROPE, HAS_GLUON, GluonConfig, roles_preferred, split_frame
from .splits import reduce_launch

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .gluon_common import BUILD_ERRORS, _async_load, _barrier, _split_keys  # noqa: F401
    from .mla_gluon_roles import _opaque

__all__ = ["NARROW", "supports", "offered", "unmeasured", "run", "launch_args"]

NARROW = GluonConfig(block_h=16, block_n=64, stages=3)  # query rows (N), keys (M), staging buffers
MAX_ROWS = 16  # the rows the chooser offers it for (more rows re-read the cache once per 16)

if HAS_GLUON:
    DL, DR, SB = gl.constexpr(512), gl.constexpr(64), gl.constexpr(128)

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


def _issue_tile_src(lat_dst, rope_dst, kv_words, kt_row, t0, end, SKV_W: gl.constexpr, SKT_T: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """The cp.async copies of the tile at key t0 (its fp8 bytes as 4-byte words, 16 bytes a copy,
    and its bf16 rope rows) as one commit group; keys past `end` zero-filled."""
    ld: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    w = gl.arange(0, DL // 4, layout=gl.SliceLayout(0, ld))
    _async_load(lat_dst, kv_words + (t0 + n).to(gl.int64)[:, None] * SKV_W + w[None, :], mask=((t0 + n) < end)[:, None])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_r))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_r))
    _async_load(rope_dst, kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :],
                mask=((t0 + nr) < end)[:, None])
    cp.commit_group()


def _block_scale_src(ks_row, sks_t, sks_c, t0, end, blk: gl.constexpr, key_l: gl.constexpr, BLOCK_N: gl.constexpr):
    """The keys' scales of latent block `blk` for the tile at t0 ([BLOCK_N], one per key row of
    S^T); 0 past `end`."""
    k = t0 + gl.arange(0, BLOCK_N, layout=key_l)
    return gl.load(ks_row + k.to(gl.int64) * sks_t + blk * sks_c, mask=k < end, other=0.0)


def _q_block_factor_src(inv_f, blk: gl.constexpr, row_l: gl.constexpr):
    """Column `blk` of the [BLOCK_R, 4] query factors, as a [BLOCK_R] vector over S^T's columns."""
    idx = gl.arange(0, 4, layout=gl.SliceLayout(0, inv_f.type.layout))
    return gl.convert_layout(gl.sum(gl.where(idx[None, :] == blk, inv_f, 0.0), axis=1), row_l)


def _store_block_src(o_base, acc, scale_r, blk: gl.constexpr, row0, so_s, so_h, H, SH):
    """Output columns [128 blk, 128 blk + 128) of the block's rows from O^T's accumulator."""
    o_l: gl.constexpr = acc.type.layout
    cols = blk * SB + gl.arange(0, SB, layout=gl.SliceLayout(1, o_l))
    rows = row0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_l))
    o = acc * gl.convert_layout(scale_r, gl.SliceLayout(0, o_l))[None, :]
    gl.store(o_base + (rows // H)[None, :] * so_s + (rows % H)[None, :] * so_h + cols[:, None],
             o.to(o_base.dtype.element_ty), mask=(rows < SH)[None, :])


def _narrow_kernel_src(Q, QT, KV, KS, KT, LENS, O, L, T, H, SH, sm_scale_log2, lse_scale, lens_sb, lens_c, lens_r,
                       sq_b, sq_s, sq_h, sqt_b, sqt_s, sqt_h, skv_b, sks_b, sks_t, sks_c, skt_b8,
                       so_b, so_sp, so_s, so_h, sl_b, sl_sp, sl_s, sl_h,
                       SKV_T: gl.constexpr, SKT_T: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr, HAS_LENS: gl.constexpr):
    """One (BLOCK_R-row block, split, batch row), one warpgroup. ``skt_b8``: the rope's batch
    stride in units of 8 elements (16 bytes: its cp.async vectors)."""
    pid_r = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    row0 = pid_r * BLOCK_R
    # S^T and O^T: keys (or value columns) along M over the 4 warps, the query rows along N
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_R, 16])
    key_l: gl.constexpr = gl.SliceLayout(1, s_mma)
    row_l: gl.constexpr = gl.SliceLayout(0, s_mma)

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
    inv_f = gl.exp2(e - 13.0)
    q16 = gl.reshape((q * f[:, :, None]).to(gl.float16), [BLOCK_R, DL])
    # (buffers with a unit leading dimension are indexed with an opaque zero in every tile, so
    # that the 68 wgmma descriptors are formed in the loop, not hoisted out of it and spilled)
    q_s = gl.allocate_shared_memory(gl.float16, [1, BLOCK_R, DL],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_R, DL], gl.float16))
    q_s.index(0).store(q16)
    ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ld_qr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
    q_rope = gl.load(QT + b * sqt_b + (rr // H)[:, None] * sqt_s + (rr % H)[:, None] * sqt_h + cr[None, :],
                     mask=(rr < SH)[:, None], other=0.0)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_R, DR],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_R, DR], gl.bfloat16))
    qr_s.index(0).store(q_rope)
    g0 = _q_block_factor(inv_f, 0, row_l)
    g1 = _q_block_factor(inv_f, 1, row_l)
    g2 = _q_block_factor(inv_f, 2, row_l)
    g3 = _q_block_factor(inv_f, 3, row_l)

    # ---- staging ring (fp8 words, bf16 rope), the f16 tile both products read, P's four copies
    lat_st = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, DL // 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    rope_st = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DR],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16))
    tile_s = gl.allocate_shared_memory(gl.float16, [1, BLOCK_N, DL],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.float16))
    p_s = gl.allocate_shared_memory(gl.float16, [4, BLOCK_N, BLOCK_R],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], gl.float16))

    start, end = _split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    salt = pid_sp // NUM_SPLITS  # 0, which LLVM cannot prove
    kv_words = (KV + b * skv_b).to(gl.pointer_type(gl.int32), bitcast=True)
    kt_row = KT + b * (skt_b8 * 8)
    ks_row = KS + b * sks_b
    for i in gl.static_range(STAGES - 1):
        _issue_tile(lat_st.index(i), rope_st.index(i), kv_words, kt_row, start + i * BLOCK_N, end, SKV_T // 4, SKT_T,
                    BLOCK_N)
    fence_async_shared()
    _barrier()  # q's shared copies before the tensor cores read them

    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=row_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=s_mma)  # row sums, per key: reduced at the end
    u = gl.max(gl.zeros([BLOCK_N], gl.float32, layout=key_l), axis=0)  # P's unit: the largest key scale so far
    o0 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o1 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o2 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    o3 = gl.zeros([SB, BLOCK_R], gl.float32, layout=s_mma)
    c0 = _block_scale(ks_row, sks_t, sks_c, start, end, 0, key_l, BLOCK_N)
    c1 = _block_scale(ks_row, sks_t, sks_c, start, end, 1, key_l, BLOCK_N)
    c2 = _block_scale(ks_row, sks_t, sks_c, start, end, 2, key_l, BLOCK_N)
    c3 = _block_scale(ks_row, sks_t, sks_c, start, end, 3, key_l, BLOCK_N)
    ld_w: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=key_l)
    for j in range(n_tiles):
        slot = j % STAGES
        t0 = start + j * BLOCK_N
        z = _opaque(salt + j) - j  # 0
        tile = tile_s.index(z)
        q_lat = q_s.index(z)
        cp.wait_group(STAGES - 2)
        fence_async_shared()  # the copies' writes before the tensor cores' reads (the rope rows)
        _barrier()  # every thread's copies of tile j landed; every warp is past tile j - 1's products
        nxt = j + STAGES - 1
        _issue_tile(lat_st.index(nxt % STAGES), rope_st.index(nxt % STAGES), kv_words, kt_row, start + nxt * BLOCK_N,
                    end, SKV_T // 4, SKT_T, BLOCK_N)
        # this tile's fp8 bytes -> the f16 tile, a 128-column block at a time (16 words a thread)
        for blk in gl.static_range(4):
            words = lat_st.index(slot).slice(blk * (SB // 4), SB // 4, dim=1).load(ld_w)
            tile.slice(blk * SB, SB, dim=1).store(_to_f16(words))
        fence_async_shared()
        _barrier()
        # S^T: the rope part (bf16) and the four latent blocks (f16), one accumulator each
        zero = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=s_mma)
        sr = warpgroup_mma(rope_st.index(slot), qr_s.index(z).permute((1, 0)), zero, use_acc=False, is_async=True)
        s0 = warpgroup_mma(tile.slice(0, SB, dim=1), q_lat.slice(0, SB, dim=1).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        s1 = warpgroup_mma(tile.slice(SB, SB, dim=1), q_lat.slice(SB, SB, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        s2 = warpgroup_mma(tile.slice(2 * SB, SB, dim=1), q_lat.slice(2 * SB, SB, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        s3 = warpgroup_mma(tile.slice(3 * SB, SB, dim=1), q_lat.slice(3 * SB, SB, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        sr, s0, s1, s2, s3 = warpgroup_mma_wait(0, deps=[sr, s0, s1, s2, s3])
        # the next tile's scales, under this tile's softmax and value product
        n0 = _block_scale(ks_row, sks_t, sks_c, t0 + BLOCK_N, end, 0, key_l, BLOCK_N)
        n1 = _block_scale(ks_row, sks_t, sks_c, t0 + BLOCK_N, end, 1, key_l, BLOCK_N)
        n2 = _block_scale(ks_row, sks_t, sks_c, t0 + BLOCK_N, end, 2, key_l, BLOCK_N)
        n3 = _block_scale(ks_row, sks_t, sks_c, t0 + BLOCK_N, end, 3, key_l, BLOCK_N)
        s = sr + s0 * (c0[:, None] * g0[None, :]) + s1 * (c1[:, None] * g1[None, :]) \
            + s2 * (c2[:, None] * g2[None, :]) + s3 * (c3[:, None] * g3[None, :])
        valid = (t0 + keys) < end
        s = gl.where(valid[:, None], s * sm_scale_log2, float("-inf"))
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
        p_s.index(z).store((p * (c0 * inv_u)[:, None]).to(gl.float16))
        p_s.index(z + 1).store((p * (c1 * inv_u)[:, None]).to(gl.float16))
        p_s.index(z + 2).store((p * (c2 * inv_u)[:, None]).to(gl.float16))
        p_s.index(z + 3).store((p * (c3 * inv_u)[:, None]).to(gl.float16))
        fence_async_shared()
        _barrier()
        # O^T += V^T P^T, block by block (the f16 tile read transposed)
        o0 = warpgroup_mma(tile.slice(0, SB, dim=1).permute((1, 0)), p_s.index(z), o0 * rescale[None, :],
                           is_async=True)
        o1 = warpgroup_mma(tile.slice(SB, SB, dim=1).permute((1, 0)), p_s.index(z + 1), o1 * rescale[None, :],
                           is_async=True)
        o2 = warpgroup_mma(tile.slice(2 * SB, SB, dim=1).permute((1, 0)), p_s.index(z + 2), o2 * rescale[None, :],
                           is_async=True)
        o3 = warpgroup_mma(tile.slice(3 * SB, SB, dim=1).permute((1, 0)), p_s.index(z + 3), o3 * rescale[None, :],
                           is_async=True)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3])
        c0, c1, c2, c3 = n0, n1, n2, n3
    cp.wait_group(0)

    l_i = gl.sum(l_acc, axis=0)
    o_scale = gl.where(l_i == 0.0, 0.0, u / gl.where(l_i == 0.0, 1.0, l_i))
    o_base = O + b * so_b + pid_sp * so_sp
    _store_block(o_base, o0, o_scale, 0, row0, so_s, so_h, H, SH)
    _store_block(o_base, o1, o_scale, 1, row0, so_s, so_h, H, SH)
    _store_block(o_base, o2, o_scale, 2, row0, so_s, so_h, H, SH)
    _store_block(o_base, o3, o_scale, 3, row0, so_s, so_h, H, SH)
    rows = row0 + gl.arange(0, BLOCK_R, layout=row_l)
    lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * lse_scale
    gl.store(L + b * sl_b + pid_sp * sl_sp + (rows // H) * sl_s + (rows % H) * sl_h, lse, mask=rows < SH)


if HAS_GLUON:
    _E4M3_F16_ASM = gl.constexpr(_E4M3_F16_ASM_TEXT)
    _to_f16 = gluon.jit(_to_f16_src)
    _issue_tile = gluon.jit(_issue_tile_src)
    _block_scale = gluon.jit(_block_scale_src)
    _q_block_factor = gluon.jit(_q_block_factor_src)
    _store_block = gluon.jit(_store_block_src)
    _narrow_jit = gluon.jit(_narrow_kernel_src)


# --------------------------------------------------------------------------------------
# the registry's entry (kernel "gluon_fp8_narrow")
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the narrow fp8 kernel cannot run a call of this shape (None: it can): the fp8 Gluon
    kernel's calls (Hopper, fp8 e4m3 latent of 512 columns with its scales, 64 bf16 rope
    columns, bf16 queries, contiguous caches) without a mask or causal cap."""
    if not HAS_GLUON:
        return "this Triton has no Gluon"
    if shape.per_head or shape.offset_lens:
        return only_reference(shape)
    if shape.kv_quant != "fp8_e4m3":
        return "it reads fp8_e4m3 latent caches"
    if shape.dtype != torch.float8_e4m3fn:
        return f"an fp8_e4m3 latent cache must be float8_e4m3fn, not {shape.dtype}"
    if shape.paged:
        return "it reads contiguous caches, not page pools"
    if shape.device != "cuda" or shape.capability != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if shape.query_dtype != torch.bfloat16 or not shape.same_dtypes:
        return "it takes bfloat16 queries and rope columns"
    if (shape.d_main, shape.d_tail, shape.v_dim) != (D_LAT, D_ROPE, D_LAT):
        return f"it is written for {D_LAT} latent (= values) + {D_ROPE} rope columns"
    if shape.mask != "none" or shape.causal:
        return "it takes no mask and no causal cap"
    if not shape.gluon_aligned:
        return "its operands need unit feature strides, 16-byte aligned data and row strides of 8k elements"
    return None


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
                config: Optional[GluonConfig] = None):
    """(out, lse_out, None) when the outputs are final without a launch, else (out, lse_out,
    (grid, args, consts, stage-2 launch or None)) for a call's rank view (a ShardView)."""
    cfg = config or NARROW
    if (cfg.block_h, cfg.block_n) != (NARROW.block_h, NARROW.block_n) or cfg.stages < 2:
        raise ValueError(f"the narrow fp8 Gluon kernel runs {NARROW.block_h}-row x {NARROW.block_n}-key tiles "
                         f"in >= 2 stages, not {cfg.block_h} x {cfg.block_n} in {cfg.stages}")
    if call.kv_scale is None:
        raise ValueError("the narrow fp8 Gluon kernel needs the latent's scales (kv_scale)")
    out, lse_out, done, frame = split_frame(call, out, lse_out, num_splits, cfg)
    if done:
        return out, lse_out, None
    parts, n_rb, ns, (lens, lens_sb, lens_c, lens_r), (o_part, l_part, ops, lps, l_scale) = frame
    qm, qt, km, kt, ks = parts.q_main, parts.q_tail, parts.k_main, parts.k_tail, call.kv_scale
    if kt.stride(-1) != 1 or any(x % 8 for x in kt.stride()[:-1]) or kt.data_ptr() % 16:
        raise ValueError(f"the narrow fp8 Gluon kernel copies the rope rows 16 bytes at a time: it needs unit "
                         f"feature stride, 16-byte aligned data and strides of multiples of 8, got {tuple(kt.stride())}")
    if km.stride(-1) != 1 or km.stride(0) % 16 or km.stride(1) % 16 or km.data_ptr() % 16:
        raise ValueError(f"the narrow fp8 Gluon kernel copies the latent rows 16 bytes at a time: it needs unit "
                         f"feature stride, 16-byte aligned data and strides of multiples of 16, got "
                         f"{tuple(km.stride())}")
    if qm.stride(-1) != 1 or qt.stride(-1) != 1:
        raise ValueError("the narrow fp8 Gluon kernel needs queries with unit feature stride")
    B, S, H, _ = call.q_lat.shape
    T = km.shape[1]
    args = (qm, qt, km, ks, kt, lens, o_part, l_part,
            T, H, S * H, float(call.scale) * LOG2E, l_scale, lens_sb, lens_c, lens_r,
            *qm.stride()[:3], *qt.stride()[:3], km.stride(0), ks.stride(0), ks.stride(1), ks.stride(2),
            kt.stride(0) // 8, ops[0], ops[1], ops[2], ops[3], lps[0], lps[1], lps[2], lps[3])
    consts = dict(SKV_T=km.stride(1), SKT_T=kt.stride(1), BLOCK_R=cfg.block_h, BLOCK_N=cfg.block_n,
                  STAGES=cfg.stages, NUM_SPLITS=ns, HAS_LENS=call.kv_lens is not None)
    stage2 = (reduce_launch(o_part, l_part, out, lse_out, H, call.lse_base, call.v_dim, ns) if ns > 1 else None)
    return out, lse_out, ((n_rb, ns, B), args, consts, stage2)


def run(call: AttentionCall, out=None, lse_out=None, *, num_splits: Optional[int] = None,
        config: Optional[GluonConfig] = None):
    """Run the narrow fp8 kernel (plus the stage-2 merge when split); returns (out, lse_out)."""
    out, lse_out, plan = launch_args(call.shard(), out, lse_out, num_splits, config)
    if plan is None:
        return out, lse_out
    grid, args, consts, stage2 = plan
    launch(_narrow_jit, grid, args, consts, 4)
    if stage2 is not None:
        kernel, grid2, args2, consts2, warps = stage2
        launch(kernel, grid2, args2, consts2, warps)
    return out, lse_out
