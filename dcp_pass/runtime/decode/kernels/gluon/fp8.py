"""Role-split one-read MLA decode kernel in Gluon (Hopper) for an fp8 latent cache.

The bf16 role-split kernel (``roles.py``) with its loader rewritten; its scorer is
that module's, unchanged. The cache is FlashMLA's packed row (``runtime/decode/kv_format.py``):
512 e4m3 latent values, one fp32 scale per 128 of them, 64 bf16 rope values, read through
three strided views.

Hopper's wgmma multiplies two operands of one type, and an fp8 wgmma needs both K-major: the
values product ``P @ V`` reads V [keys, 512] along its keys, so an fp8 tile cannot feed it.
Both GEMMs therefore read a 16-bit copy of the tile in shared memory, the same bf16 tile
the bf16 kernel reads. Where that copy comes from:

* the *loader* holds the next fp8 tile in registers (plain 16-byte loads issued one tile
  ahead: 64 + 16 registers a thread for the values and their scales), and, once both value
  GEMMs of a buffer's tile are done, writes ``bf16(fp32(e4m3) * scale)`` into it, 128
  columns at a time; the rope columns, already bf16, go by ``cp.async`` as before. An
  fp8 staging buffer in shared memory would not fit: q (72 KiB) + two bf16 tiles (144 KiB)
  leave 10 KiB of the 227, and a 32 KiB fp8 tile takes 32;
* the *scorer* then sees exactly the bf16 kernel's operands and runs its code.

Dequantised, not folded: the product is rounded to bf16 once (relative error at most 2^-8 a
value, a sixteenth of e4m3's own rounding 2^-4, and the rounding P already gets in the bf16
kernel), in bf16's range, so no scale can overflow or underflow it. Folding the
scales (exact e4m3 values in fp16, each 128-column block's scale applied to its partial
scores and to P) would split the score GEMM into four chains with a wait each and a second
[64, 64] accumulator, and P into four scaled copies, all on the scorer, the role that sets
the bf16 kernel's pace (and has no registers left); dequantising puts the whole cost on the
loader. Profiled at 128 heads (docs/kernels.md) that makes the loader the pace: its loads and
conversions of a tile take longer than the scorer's products, which wait for its fills.

Scope: fp8 e4m3 latent of 512 columns with its [B, T, 4] fp32 scales, 64 bf16 rope columns
(packed rows or a buffer of their own), bf16 queries, kv_lens with ``lens_stripe``, a mask
row per request (copied with its tile's rope rows) and any causal cap (the scorer's, as in the
bf16 kernel), the split kernel's partials and stage-2 merge. The registry's
"gluon_fp8" kernel; the chooser takes it where its fp8 timings (path table key
``gluon_fp8``) are the fastest, which on the H200 is every plain fp8 call measured (16-128
heads): 1.9-2.0x the two-GEMM kernel's read at 128 heads, 1.2x the split kernel's at 16.
"""

from __future__ import annotations

from typing import Optional

from ..common import LOG2E, AttentionCall
from ..splits import reduce_launch
from .common import (
    GLUON_DEFAULT,
    HAS_GLUON,
    ROLES_TILES,
    GluonConfig,
    fp8_gluon_reason,
    launch_plan,
    mask_args,
    roles_preferred,
    split_frame,
)

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
        role_buffers,
        scorer,
        split_keys,
        store_half,
    )

__all__ = ["supports", "offered", "unmeasured", "run", "launch_args"]
if HAS_GLUON:
    DL, DR = gl.constexpr(512), gl.constexpr(64)
    SB = gl.constexpr(128)  # latent columns per scale


def _load_block_src(
    kv_words, ks_row, sks_t, sks_c, t0, end, blk: gl.constexpr, SKV_W: gl.constexpr, BLOCK_N: gl.constexpr
):
    """One 128-column block of the fp8 tile at key t0 as [BLOCK_N, 32] int32 words (four e4m3
    values each, 16 bytes a thread per row: a tensor of int8 would take a register per value)
    and its keys' scales; keys past `end` read as value 0 and scale 0."""
    ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, SB // 4, layout=gl.SliceLayout(0, ld))
    keep = (t0 + n) < end
    t = (t0 + n).to(gl.int64)
    x = gl.load(kv_words + t[:, None] * SKV_W + (blk * (SB // 4) + c)[None, :], mask=keep[:, None], other=0)
    s = gl.load(ks_row + t * sks_t + blk * sks_c, mask=keep, other=0.0)
    return x, s


def _load_tile_src(j, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile j's four blocks and scales into registers (a tile past the split: all masked, no traffic)."""
    t0 = start + j * BLOCK_N
    x0, s0 = _load_block(kv_words, ks_row, sks_t, sks_c, t0, end, 0, SKV_W, BLOCK_N)
    x1, s1 = _load_block(kv_words, ks_row, sks_t, sks_c, t0, end, 1, SKV_W, BLOCK_N)
    x2, s2 = _load_block(kv_words, ks_row, sks_t, sks_c, t0, end, 2, SKV_W, BLOCK_N)
    x3, s3 = _load_block(kv_words, ks_row, sks_t, sks_c, t0, end, 3, SKV_W, BLOCK_N)
    return x0, x1, x2, x3, s0, s1, s2, s3


# e4m3 pairs -> f16 pairs (exact, one packed conversion each), f16 -> f32, times the scale in
# fp32, rounded once to bf16: four values of one word, the lowest-addressed first
_DEQUANT_ASM_TEXT = """{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 p01, p23;
.reg .f32 f0, f1, f2, f3;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p01, lo;
cvt.rn.f16x2.e4m3x2 p23, hi;
mov.b32 {h0, h1}, p01;
mov.b32 {h2, h3}, p23;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
mul.f32 f0, f0, $5;
mul.f32 f1, f1, $5;
mul.f32 f2, f2, $5;
mul.f32 f3, f3, $5;
cvt.rn.bf16.f32 $0, f0;
cvt.rn.bf16.f32 $1, f1;
cvt.rn.bf16.f32 $2, f2;
cvt.rn.bf16.f32 $3, f3;
}"""


def _dequant_src(x, s):
    """[BLOCK_N, 32] words of e4m3 values and their rows' scales -> [BLOCK_N, 128]
    bf16(e4m3 * scale), the product in fp32 (e4m3 -> fp16 -> fp32 is exact); column 4k + i is
    byte i of word k."""
    v0, v1, v2, v3 = gl.inline_asm_elementwise(
        _DEQUANT_ASM,
        "=h,=h,=h,=h,r,f",
        [x, s[:, None]],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=1,
    )
    w = gl.join(gl.join(v0, v1), gl.join(v2, v3))  # [n, k, i, p] = value 2p + i of word k
    w = gl.permute(w, (0, 1, 3, 2))  # [n, k, p, i]: row-major order is then column 4k + 2p + i
    return gl.reshape(w, [x.shape[0], 4 * x.shape[1]])


def _put_src(
    j,
    salt,
    full,
    k_lat,
    k_rope,
    x0,
    x1,
    x2,
    x3,
    s0,
    s1,
    s2,
    s3,
    kt_row,
    start,
    end,
    n_tiles,
    SKT_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    mk_row,
    sm_t,
    HAS_MASK: gl.constexpr,
):
    """Tile j (if the split has it) into buffer j % 2: its rope rows (and its mask entries) by
    cp.async (each loader thread arrives on `full` when they land) and its dequantised latent
    from registers (one more arrival once every thread's stores are fenced for the tensor
    cores)."""
    if j < n_tiles:
        buf = opaque(j + salt) % 2
        t0 = start + j * BLOCK_N
        ld_rope: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_rope))
        cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_rope))
        async_load(
            k_rope.index(buf),
            kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :],
            mask=((t0 + nr) < end)[:, None],
        )
        if HAS_MASK:
            copy_mask(mk.index(buf), mk_row, t0, end, sm_t, BLOCK_N)
        cp.mbarrier_arrive(full.index(buf), increment_count=False)
        lat = k_lat.index(buf)
        lat.slice(0, SB, dim=1).store(_dequant(x0, s0))
        lat.slice(SB, SB, dim=1).store(_dequant(x1, s1))
        lat.slice(2 * SB, SB, dim=1).store(_dequant(x2, s2))
        lat.slice(3 * SB, SB, dim=1).store(_dequant(x3, s3))
        fence_async_shared()  # these stores before the tensor cores' reads
        mbarrier.arrive(full.index(buf))


def _loader_fp8_src(
    salt,
    k_lat,
    k_rope,
    a_s,
    l_s,
    full,
    p_ready,
    empty,
    done,
    kv_words,
    ks_row,
    kt_row,
    sks_t,
    sks_c,
    start,
    end,
    n_tiles,
    o_base,
    so_s,
    so_h,
    row0,
    H,
    SH,
    SKV_W: gl.constexpr,
    SKT_T: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    mk_row,
    sm_t,
    HAS_MASK: gl.constexpr,
):
    """The loader: tiles into the two buffers (dequantised from the fp8 tile it holds in
    registers, loaded a tile ahead) and value columns 0-255 of every tile with P from shared
    memory; a buffer is refilled (tile j + 2) once both value GEMMs of tile j are done."""
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    x0, x1, x2, x3, s0, s1, s2, s3 = _load_tile(0, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N)
    _put(
        0,
        salt,
        full,
        k_lat,
        k_rope,
        x0,
        x1,
        x2,
        x3,
        s0,
        s1,
        s2,
        s3,
        kt_row,
        start,
        end,
        n_tiles,
        SKT_T,
        BLOCK_N,
        mk,
        mk_row,
        sm_t,
        HAS_MASK,
    )
    x0, x1, x2, x3, s0, s1, s2, s3 = _load_tile(1, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N)
    _put(
        1,
        salt,
        full,
        k_lat,
        k_rope,
        x0,
        x1,
        x2,
        x3,
        s0,
        s1,
        s2,
        s3,
        kt_row,
        start,
        end,
        n_tiles,
        SKT_T,
        BLOCK_N,
        mk,
        mk_row,
        sm_t,
        HAS_MASK,
    )
    x0, x1, x2, x3, s0, s1, s2, s3 = _load_tile(2, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, layout=o_mma)
    for j in range(n_tiles):
        buf = opaque(j + salt) % 2
        mbarrier.wait(p_ready.index(buf), (j // 2) & 1)
        alpha = a_s.index(buf).load(row_o)
        acc = warpgroup_mma(
            k_rope.index(buf), k_lat.index(buf).slice(0, 256, dim=1), acc * alpha[:, None], is_async=True
        )
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.wait(empty.index(buf), (j // 2) & 1)  # the scorer's value GEMM of this buffer is done too
        _put(
            j + 2,
            salt,
            full,
            k_lat,
            k_rope,
            x0,
            x1,
            x2,
            x3,
            s0,
            s1,
            s2,
            s3,
            kt_row,
            start,
            end,
            n_tiles,
            SKT_T,
            BLOCK_N,
            mk,
            mk_row,
            sm_t,
            HAS_MASK,
        )
        x0, x1, x2, x3, s0, s1, s2, s3 = _load_tile(j + 3, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N)
    mbarrier.wait(done, 0)
    store_half(o_base, acc, l_s.load(row_o), 0, row0, so_s, so_h, H, SH, BLOCK_H)


def _fp8_kernel_src(
    Q,
    QT,
    KV,
    KS,
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
    sq_b8,
    sq_s8,
    sq_h8,
    sqt_b8,
    sqt_s8,
    sqt_h8,
    skv_b,
    sks_b,
    sks_t,
    sks_c,
    skt_b8,
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
    """One (64-row block, split, batch row), as the bf16 role-split kernel: the parent region
    loads q and finds the split's keys, then the scorer and the fp8 loader run the tiles.
    Strides named ``*8`` are in units of 8 elements (16 bytes of bf16: the cp.async copies'
    vectors), so the compiler sees them aligned whatever the JIT can mark. MASK and CAUSAL as
    in the bf16 role-split kernel."""
    pid_h = gl.program_id(0)
    pid_sp = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    row0 = pid_h * BLOCK_H
    salt = pid_sp // NUM_SPLITS  # 0, which LLVM cannot prove
    q_lat_s = gl.allocate_shared_memory(
        gl.bfloat16, [BLOCK_H, DL], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DL], gl.bfloat16)
    )
    q_rope_s = gl.allocate_shared_memory(
        gl.bfloat16, [BLOCK_H, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DR], gl.bfloat16)
    )
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rq = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_q))
    cq = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_q))
    async_load(
        q_lat_s,
        Q + b * (sq_b8 * 8) + (rq // H)[:, None] * (sq_s8 * 8) + (rq % H)[:, None] * (sq_h8 * 8) + cq[None, :],
        mask=(rq < SH)[:, None],
    )
    ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_qr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
    async_load(
        q_rope_s,
        QT + b * (sqt_b8 * 8) + (rr // H)[:, None] * (sqt_s8 * 8) + (rr % H)[:, None] * (sqt_h8 * 8) + cr[None, :],
        mask=(rr < SH)[:, None],
    )
    cp.commit_group()

    # (full, per fill: every loader thread once its rope copies land, and the loader once (a
    # partition barrier, then one arrival) after its latent stores)
    k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, mk = role_buffers(
        gl.bfloat16, BLOCK_H, BLOCK_N, 128 + 1, HAS_MASK
    )

    start, end = split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    qpos_row = QPOS + b * sqp_b
    if CAUSAL:
        end = causal_end(end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_H)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    cp.wait_group(0)
    fence_async_shared()
    barrier()

    kv_words = (KV + b * skv_b).to(gl.pointer_type(gl.int32), bitcast=True)  # the fp8 rows as 4-byte words
    ks_row = KS + b * sks_b
    kt_row = KT + b * (skt_b8 * 8)
    o_base = O + b * so_b + pid_sp * so_sp
    l_base = L + b * sl_b + pid_sp * sl_sp
    gl.warp_specialize(
        [
            (
                scorer,
                (
                    salt,
                    q_lat_s,
                    q_rope_s,
                    k_lat,
                    k_rope,
                    a_s,
                    l_s,
                    full,
                    p_ready,
                    empty,
                    done,
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
                    BLOCK_H,
                    BLOCK_N,
                    mk,
                    qpos_row,
                    sqp_s,
                    cp_world,
                    cp_rank,
                    HAS_MASK,
                    CAUSAL,
                ),
            ),
            (
                _loader_fp8,
                (
                    salt,
                    k_lat,
                    k_rope,
                    a_s,
                    l_s,
                    full,
                    p_ready,
                    empty,
                    done,
                    kv_words,
                    ks_row,
                    kt_row,
                    sks_t,
                    sks_c,
                    start,
                    end,
                    n_tiles,
                    o_base,
                    so_s,
                    so_h,
                    row0,
                    H,
                    SH,
                    SKV_T // 4,
                    SKT_T,
                    BLOCK_H,
                    BLOCK_N,
                    mk,
                    MASK + b * sm_b,
                    sm_t,
                    HAS_MASK,
                ),
            ),
        ],
        [4],
        [256],
    )


if HAS_GLUON:
    _DEQUANT_ASM = gl.constexpr(_DEQUANT_ASM_TEXT)
    _load_block = gluon.jit(_load_block_src)
    _load_tile = gluon.jit(_load_tile_src)
    _dequant = gluon.jit(_dequant_src)
    _put = gluon.jit(_put_src)
    _loader_fp8 = gluon.jit(_loader_fp8_src)
    _fp8_jit = gluon.jit(_fp8_kernel_src)


# --------------------------------------------------------------------------------------
# the registry's entry (kernel "gluon_fp8")
# --------------------------------------------------------------------------------------
def supports(shape) -> Optional[str]:
    """Why the fp8 kernel cannot run a call of this shape (None: it can): the fp8 Gluon calls
    (common.fp8_gluon_reason: a mask only as one row per request, any causal cap)."""
    return fp8_gluon_reason(shape)


def offered(shape) -> Optional[str]:
    """On the Triton it was timed with (3.6), at any row count: unlike the bf16 Gluon kernels it
    measured faster than the split kernel's fp8 read at 16 rows too (0.36 vs 0.44 ms, B=8,
    128K keys; fp8_paths_h200.json), so the fp8 timings decide."""
    if not roles_preferred(shape.triton):
        return "the role-split kernels are offered on Triton 3.6 only, where they were timed"
    return None


def unmeasured(shape) -> bool:
    """False: the chooser takes it where its fp8 timings (path table, gluon_fp8) say it is fastest."""
    return False


def launch_args(call, out=None, lse_out=None, num_splits: Optional[int] = None, config: Optional[GluonConfig] = None):
    """(out, lse_out, None) when the outputs are final without a launch, else (out, lse_out,
    (grid, args, consts, stage-2 launch or None)) for a call's rank view (a ShardView)."""
    cfg = config or GLUON_DEFAULT
    if cfg.tiles != ROLES_TILES:
        raise ValueError(
            f"the fp8 Gluon kernel runs {ROLES_TILES[0]} x {ROLES_TILES[1]} tiles in "
            f"{ROLES_TILES[2]} stages, not {cfg.block_h} x {cfg.block_n} in {cfg.stages}"
        )
    if call.kv_scale is None:
        raise ValueError("the fp8 Gluon kernel needs the latent's scales (kv_scale)")
    out, lse_out, done, frame = split_frame(call, out, lse_out, num_splits, cfg)
    if done:
        return out, lse_out, None
    parts, n_hb, ns, (lens, lens_sb, lens_c, lens_r), (o_part, l_part, ops, lps, l_scale) = frame
    qm, qt, km, kt, ks = parts.q_main, parts.q_tail, parts.k_main, parts.k_tail, call.kv_scale
    for name, t in (("q_lat", qm), ("q_rope", qt), ("rope", kt)):
        if t.stride(-1) != 1 or any(x % 8 for x in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(
                f"the fp8 Gluon kernel needs {name} with unit feature stride, 16-byte aligned data "
                f"and strides of multiples of 8 elements, got strides {tuple(t.stride())}"
            )
    if km.stride(-1) != 1 or km.stride(0) % 4 or km.stride(1) % 4 or km.data_ptr() % 16:
        raise ValueError(
            f"the fp8 Gluon kernel reads the latent in 4-byte words: it needs unit feature stride, "
            f"16-byte aligned data and strides of multiples of 4, got strides {tuple(km.stride())}"
        )
    B, S, H, _ = call.q_lat.shape
    T = km.shape[1]
    args = (
        qm,
        qt,
        km,
        ks,
        kt,
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
        *(x // 8 for x in qm.stride()[:3]),
        *(x // 8 for x in qt.stride()[:3]),
        km.stride(0),
        ks.stride(0),
        ks.stride(1),
        ks.stride(2),
        kt.stride(0) // 8,
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
        SKV_T=km.stride(1),
        SKT_T=kt.stride(1),
        BLOCK_H=64,
        BLOCK_N=64,
        NUM_SPLITS=ns,
        HAS_LENS=call.kv_lens is not None,
        **m_consts,
    )
    stage2 = reduce_launch(o_part, l_part, out, lse_out, H, call.lse_base, call.v_dim, ns) if ns > 1 else None
    return out, lse_out, ((n_hb, ns, B), args, consts, stage2)


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[GluonConfig] = None,
):
    """Run the fp8 kernel (plus the stage-2 merge when split); returns (out, lse_out)."""
    return launch_plan(_fp8_jit, *launch_args(call.shard(), out, lse_out, num_splits, config))
