"""Role-split one-read MLA decode kernel in Gluon (Hopper): a scorer and a loader warpgroup.

The lock-step kernel (``lock_step.py``) splits each tile's columns between its two
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
row's query position. Scope as ``lock_step.py``: 512 latent (= values) + 64 rope columns in
bf16, one fused cache or two, kv_lens with ``lens_stripe``, a mask row per request, any
causal cap, the split kernel's partials and stage-2 merge. The registry's "gluon_roles"
kernel; it copies q by cp.async as well as the cache, so its operands' row strides must be
multiples of 16 elements (Triton then marks them divisible).
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
    gluon_offered,
    gluon_reason,
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

__all__ = ["supports", "offered", "run"]
if HAS_GLUON:  # (the kernels read them as globals, which Triton allows only as constexprs)
    DL, DR = gl.constexpr(512), gl.constexpr(64)


def _copy_tile_src(
    lat_buf, rope_buf, t0, end, kv_row, kt_row, SKV_T: gl.constexpr, SKT_T: gl.constexpr, BLOCK_N: gl.constexpr
):
    """The loader's 128 threads copy the tile at key t0 (its latent and rope rows, from one
    fused cache or two); keys past `end` zero-filled, so nothing from past the end reaches
    P @ V. (Row strides are constexpr: each copy's address is then a base and an immediate.)"""
    ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_lat))
    c = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_lat))
    async_load(lat_buf, kv_row + (t0 + n).to(gl.int64)[:, None] * SKV_T + c[None, :], mask=((t0 + n) < end)[:, None])
    ld_rope: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_rope))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_rope))
    async_load(
        rope_buf, kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :], mask=((t0 + nr) < end)[:, None]
    )


def _fill_src(
    j,
    salt,
    full,
    k_lat,
    k_rope,
    start,
    end,
    n_tiles,
    kv_row,
    kt_row,
    SKV_T: gl.constexpr,
    SKT_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    mk_row,
    sm_t,
    HAS_MASK: gl.constexpr,
):
    """Tile j (if the split has it) into buffer j % 2, with its mask entries (HAS_MASK); each
    loader thread arrives on the buffer's `full` barrier once its copies have landed."""
    if j < n_tiles:
        buf = opaque(j + salt) % 2
        _copy_tile(k_lat.index(buf), k_rope.index(buf), start + j * BLOCK_N, end, kv_row, kt_row, SKV_T, SKT_T, BLOCK_N)
        if HAS_MASK:
            copy_mask(mk.index(buf), mk_row, start + j * BLOCK_N, end, sm_t, BLOCK_N)
        cp.mbarrier_arrive(full.index(buf), increment_count=False)


def _loader_src(
    salt,
    k_lat,
    k_rope,
    a_s,
    l_s,
    full,
    p_ready,
    empty,
    done,
    kv_row,
    kt_row,
    start,
    end,
    n_tiles,
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
    HAS_MASK: gl.constexpr,
):
    """The loader: the tiles' copies, and value columns 0-255 of every tile with P from shared
    memory; a buffer is refilled (tile j + 2) once both value GEMMs of tile j are done."""
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    _fill(
        0,
        salt,
        full,
        k_lat,
        k_rope,
        start,
        end,
        n_tiles,
        kv_row,
        kt_row,
        SKV_T,
        SKT_T,
        BLOCK_N,
        mk,
        mk_row,
        sm_t,
        HAS_MASK,
    )
    _fill(
        1,
        salt,
        full,
        k_lat,
        k_rope,
        start,
        end,
        n_tiles,
        kv_row,
        kt_row,
        SKV_T,
        SKT_T,
        BLOCK_N,
        mk,
        mk_row,
        sm_t,
        HAS_MASK,
    )
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
        _fill(
            j + 2,
            salt,
            full,
            k_lat,
            k_rope,
            start,
            end,
            n_tiles,
            kv_row,
            kt_row,
            SKV_T,
            SKT_T,
            BLOCK_N,
            mk,
            mk_row,
            sm_t,
            HAS_MASK,
        )
    mbarrier.wait(done, 0)
    store_half(o_base, acc, l_s.load(row_o), 0, row0, so_s, so_h, H, SH, BLOCK_H)


def _roles_kernel_src(
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
    q_lat_s = gl.allocate_shared_memory(
        dt, [BLOCK_H, DL], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DL], gl.bfloat16)
    )
    q_rope_s = gl.allocate_shared_memory(
        dt, [BLOCK_H, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_H, DR], gl.bfloat16)
    )
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rq = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_q))
    cq = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_q))
    async_load(
        q_lat_s,
        Q + b * sq_b + (rq // H)[:, None] * sq_s + (rq % H)[:, None] * sq_h + cq[None, :],
        mask=(rq < SH)[:, None],
    )
    ld_qr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_qr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_qr))
    async_load(
        q_rope_s,
        QT + b * sqt_b + (rr // H)[:, None] * sqt_s + (rr % H)[:, None] * sqt_h + cr[None, :],
        mask=(rr < SH)[:, None],
    )
    cp.commit_group()

    # (full: every loader thread once per fill)
    k_lat, k_rope, a_s, l_s, full, p_ready, empty, done, mk = role_buffers(dt, BLOCK_H, BLOCK_N, 128, HAS_MASK)

    # ---- this split's keys
    start, end = split_keys(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS, BLOCK_N, HAS_LENS)
    qpos_row = QPOS + b * sqp_b
    if CAUSAL:
        end = causal_end(end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_H)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    cp.wait_group(0)
    fence_async_shared()
    barrier()

    kv_row = KV + b * skv_b
    kt_row = KT + b * skt_b
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
                _loader,
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
                    kv_row,
                    kt_row,
                    start,
                    end,
                    n_tiles,
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
    _copy_tile = gluon.jit(_copy_tile_src)
    _fill = gluon.jit(_fill_src)
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


def run(
    call: AttentionCall,
    out=None,
    lse_out=None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[GluonConfig] = None,
):
    """Run the role-split kernel (plus the stage-2 merge when split); returns (out, lse_out)."""
    return launch_role_args(_roles_jit, "role-split", call, out, lse_out, num_splits, config)


def launch_role_args(
    jit, name: str, call: AttentionCall, out, lse_out, num_splits: Optional[int], config: Optional[GluonConfig]
):
    """Launch a Gluon kernel that takes the role-split kernel's arguments (this one and the
    seesaw kernel, ``seesaw.py``), plus the stage-2 merge when split."""
    cfg = config or GLUON_DEFAULT
    if cfg.tiles != ROLES_TILES:
        raise ValueError(
            f"the {name} Gluon kernel runs {ROLES_TILES[0]} x {ROLES_TILES[1]} tiles in "
            f"{ROLES_TILES[2]} stages, not {cfg.block_h} x {cfg.block_n} in {cfg.stages}"
        )
    view = call.shard()
    out, lse_out, done, frame = split_frame(view, out, lse_out, num_splits, cfg)
    if done:
        return out, lse_out
    parts, n_hb, ns, (lens, lens_sb, lens_c, lens_r), (o_part, l_part, ops, lps, l_scale) = frame
    B, S, H, _ = view.q_lat.shape
    T = view.kv.shape[1]
    m_args, m_consts = mask_args(view, T, view.kv)
    args = (
        parts.q_main,
        parts.q_tail,
        parts.k_main,
        parts.k_tail,
        lens,
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
        *parts.q_main.stride()[:3],
        *parts.q_tail.stride()[:3],
        parts.k_main.stride(0),
        parts.k_tail.stride(0),
        ops[0],
        ops[1],
        ops[2],
        ops[3],
        lps[0],
        lps[1],
        lps[2],
        lps[3],
        *m_args,
    )
    consts = dict(
        SKV_T=parts.k_main.stride(1),
        SKT_T=parts.k_tail.stride(1),
        BLOCK_H=64,
        BLOCK_N=64,
        NUM_SPLITS=ns,
        HAS_LENS=view.kv_lens is not None,
        **m_consts,
    )
    stage2 = reduce_launch(o_part, l_part, out, lse_out, H, view.lse_base, view.v_dim, ns) if ns > 1 else None
    return launch_plan(jit, out, lse_out, ((n_hb, ns, B), args, consts, stage2))
