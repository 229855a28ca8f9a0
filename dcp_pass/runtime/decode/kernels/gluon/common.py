"""What the Gluon MLA kernels share: ``lock_step.py`` (the lock-step form), ``roles.py`` (the
role-split form), ``seesaw.py``, ``fp8.py`` and ``fp8_narrow.py`` import it, none imports a
sibling's private names (the seesaw kernel launches through the role-split kernel's public
``launch_role_args``).

The Gluon imports and the aliases of names that moved between Triton releases, DeepSeek's
column counts, the calls both forms take (:func:`gluon_reason`), their configuration
(:class:`GluonConfig`, the lock-step kernel's :class:`Schedule` names), the launch frame
both fill (:func:`split_frame`), the device-side helper both inline for a split's keys, and
the device helpers of the warp-specialised forms (mask rows, causal caps, the scorer
warpgroup, the output stores) with :func:`mask_args`, their host side.

The registry (``../registry.py``) lists the two forms as two kernels; on Triton 3.6, where it
was measured 2-16 % faster on the H200 (docs/kernels.md), the role-split form is
preferred for the calls it takes (row strides of multiples of 16 elements, masked and causal
calls included), the lock-step form runs the rest.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from ..common import causal_operand, fp8_reason, launch, lens_operand, mask_operand, mla_refusal, outputs

try:  # Gluon ships with Triton >= 3.5 (torch 2.11's Triton 3.6 has it); nothing here runs without it
    import triton
    from triton.compiler.errors import CompilationError
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.runtime.errors import OutOfResources

    # names that moved between Triton releases (3.6: async_copy_global_to_shared for cp.async
    # and TMA, thread_barrier; later: async_load, barrier); the kernels call these aliases
    async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    from triton.experimental.gluon.language.nvidia.hopper import tma

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (3.6: the older name)

    # what a Triton that cannot build or launch a Gluon kernel raises (its API moves between
    # releases): the chooser then stops offering both forms in this process
    BUILD_ERRORS: tuple = (CompilationError, OutOfResources)
    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the Triton build
    BUILD_ERRORS = ()
    HAS_GLUON = False

__all__ = [
    "HAS_GLUON",
    "BUILD_ERRORS",
    "D_LAT",
    "D_ROPE",
    "GLUON_DEFAULT",
    "GluonConfig",
    "ROLES_TILES",
    "Schedule",
    "default_q_reg",
    "fp8_gluon_reason",
    "gluon_reason",
    "launch_plan",
    "lock_step_default",
    "roles_preferred",
    "split_frame",
]

D_LAT = 512  # latent columns (= values) the kernels are written for
D_ROPE = 64  # rope columns
MIN_ROWS = 64  # one program's row block: the chooser offers the kernels from one full block


class Schedule(enum.IntEnum):
    """How the lock-step kernel orders a tile's copies, GEMMs and barriers (its SCHEDULE
    constexpr), and, as a config's schedule, the role-split kernel."""

    BARRIER_PER_TILE = 1  # a barrier before the next tile's copies and one after the value GEMM
    ONE_BARRIER = 2  # the next tile's copies after the probabilities' barrier: one barrier fewer
    COPIES_UNDER_SCORES = 3  # as ONE_BARRIER, the next copies issued while the score GEMM runs
    TWO_BUFFERS = 6  # two ring buffers as separate allocations, two tiles per loop iteration
    ROLE_SPLIT = 10  # not a lock-step schedule: the role-split kernel (roles.py)


ROLES_TILES = (64, 64, 2)  # the role-split kernel's block_h, block_n, stages: the only tiles it runs


def _on_triton_36() -> bool:
    return HAS_GLUON and triton.__version__.startswith("3.6")


def lock_step_default() -> Schedule:
    """TWO_BUFFERS on Triton 3.6 (2-5 % faster than COPIES_UNDER_SCORES at 64 and 128 heads,
    and 3-8 % on masked and causal calls, on the H200); COPIES_UNDER_SCORES elsewhere:
    Triton 3.9's compiler spills with TWO_BUFFERS, offline."""
    return Schedule.TWO_BUFFERS if _on_triton_36() else Schedule.COPIES_UNDER_SCORES


def roles_preferred(version: Optional[str] = None) -> bool:
    """Whether the role-split kernel is the default for the calls it takes under Triton
    `version` (None: the installed one): on 3.6, where it was timed (2-16 % faster than
    TWO_BUFFERS at 64 and 128 heads, outputs exact); elsewhere it was not."""
    if version is None:
        return _on_triton_36()
    return version.startswith("3.6")


def default_q_reg() -> int:
    """256 on Triton 3.6 (measured on the H200 beside 128 over three leases: +0.6 % on average
    over 8 shapes, +0.7 to +1.1 % at 64 heads / B=8 / 32K; no spills since the row sums are
    kept per warpgroup); 0 elsewhere, where it was not measured (Triton
    3.9's compiler spills with 128 or 256, offline)."""
    return 256 if _on_triton_36() else 0


@dataclass(frozen=True)
class GluonConfig:
    block_h: int = 64
    block_n: int = 64
    stages: int = 2
    # None: the default form and schedule; a Schedule (or its number): that lock-step
    # schedule, or Schedule.ROLE_SPLIT for the role-split kernel
    schedule: Optional[int] = None
    # latent columns of q kept in registers (0, 128, 256); None: 0 with a mask or a causal cap,
    # else default_q_reg() (lock-step form only)
    q_reg: Optional[int] = None
    num_splits: Optional[int] = None
    waves: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "GluonConfig":
        """``"block_h,block_n,stages,schedule,q_reg"`` (the benchmarks' spelling; schedule 10 is
        Schedule.ROLE_SPLIT)."""
        return cls(*(int(x) for x in text.split(",")))

    @property
    def tiles(self) -> tuple:
        return self.block_h, self.block_n, self.stages

    @property
    def kernels(self) -> tuple:
        """The registry's kernels this configures, in preference order: the role-split kernel
        where it is asked for (or is the default and these are its tiles) and takes the call,
        else the lock-step kernel."""
        roles = self.schedule == Schedule.ROLE_SPLIT or (
            self.schedule is None and self.tiles == ROLES_TILES and roles_preferred()
        )
        return ("gluon_roles", "gluon_lock_step") if roles else ("gluon_lock_step",)

    def lock_step_schedule(self) -> int:
        """The lock-step kernel's schedule under this config (ROLE_SPLIT or None: its default)."""
        if self.schedule and self.schedule != Schedule.ROLE_SPLIT:
            return int(self.schedule)
        return int(lock_step_default())

    def q_reg_for(self, masked: bool) -> int:
        """The configured q_reg, else the default: 0 for a call with a mask or a causal cap (128
        was no faster there on the H200, 256 spills), else default_q_reg()."""
        if self.q_reg is not None:
            return self.q_reg
        return 0 if masked else default_q_reg()

    def tag(self) -> str:
        """The configuration as run on an unmasked call (defaults resolved; the role-split
        kernel keeps no q columns in registers)."""
        roles = self.kernels[0] == "gluon_roles"
        schedule = int(Schedule.ROLE_SPLIT) if roles else self.lock_step_schedule()
        q_reg = 0 if roles else self.q_reg_for(masked=False)
        return f"gluon {self.block_h}x{self.block_n}/8w/{self.stages}s/v{schedule}" + (f"/qreg{q_reg}" if q_reg else "")


GLUON_DEFAULT = GluonConfig()


def _gluon_call_reason(shape) -> Optional[str]:
    """What every Gluon kernel refuses first: a Triton without Gluon, a call only the
    reference runs."""
    if not HAS_GLUON:
        return "this Triton has no Gluon"
    if shape.per_head or shape.offset_lens:
        return mla_refusal(shape)
    return None


def _hopper_operands_reason(shape, dtype_reason: Optional[str], mask_reason: Optional[str] = None) -> Optional[str]:
    """The checks every Gluon kernel makes after its cache type, in this order: contiguous
    caches, a Hopper GPU, the kernel's dtypes (`dtype_reason`, given by the caller), DeepSeek's
    column counts, the kernel's mask rule (`mask_reason`), aligned operands."""
    if shape.paged:
        return "it reads contiguous caches, not page pools"
    if shape.device != "cuda" or shape.capability != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if dtype_reason:
        return dtype_reason
    if (shape.d_main, shape.d_tail, shape.v_dim) != (D_LAT, D_ROPE, D_LAT):
        return f"it is written for {D_LAT} latent (= values) + {D_ROPE} rope columns"
    if mask_reason:
        return mask_reason
    if not shape.gluon_aligned:
        return "its operands need unit feature strides, 16-byte aligned data and row strides of 8k elements"
    return None


def gluon_reason(shape) -> Optional[str]:
    """Why the Gluon kernels cannot run a call of this shape (None: they can): Hopper, bf16,
    512 latent (= values) + 64 rope columns, fused in one cache or in two, unit feature
    strides, 16-byte aligned data and row strides of multiples of 8 elements; a mask only if
    one row per request serves every head and token (a decode step's); any causal cap."""
    reason = _gluon_call_reason(shape)
    if reason is not None:
        return reason
    if shape.kv_quant:
        return fp8_reason(shape)
    bf16 = shape.dtype == torch.bfloat16 and shape.same_dtypes
    return _hopper_operands_reason(
        shape, None if bf16 else "it takes bfloat16 queries and caches", _row_mask_reason(shape)
    )


def _row_mask_reason(shape) -> Optional[str]:
    """The Gluon kernels' mask rule: a mask only as one row per request (a decode step's), which
    they copy with each tile."""
    if shape.mask == "full":
        return "it takes a mask only as one row per request shared by every head and query token"
    return None


def fp8_gluon_reason(shape) -> Optional[str]:
    """Why the fp8 Gluon kernels cannot run a call of this shape (None: they can): Hopper, an fp8
    e4m3 latent of 512 columns (= values) with its scales, 64 rope columns and queries in bf16,
    contiguous caches (packed rows or two buffers), a mask only as one row per request, operands
    with unit feature stride, 16-byte aligned data and row strides of multiples of 8 elements."""
    reason = _gluon_call_reason(shape)
    if reason is not None:
        return reason
    if shape.kv_quant != "fp8_e4m3":
        return "it reads fp8_e4m3 latent caches (16-bit caches take the bf16 Gluon kernels)"
    if shape.dtype != torch.float8_e4m3fn:
        return f"an fp8_e4m3 latent cache must be float8_e4m3fn, not {shape.dtype}"
    bf16 = shape.query_dtype == torch.bfloat16 and shape.same_dtypes
    return _hopper_operands_reason(
        shape, None if bf16 else "it takes bfloat16 queries and rope columns", _row_mask_reason(shape)
    )


def gluon_offered(shape) -> Optional[str]:
    """Why the chooser does not offer a Gluon kernel for a call it could run."""
    if shape.rows < MIN_ROWS:
        return f"fewer than {MIN_ROWS} query rows: less than one row block"
    return None


def split_frame(call, out, lse_out, num_splits, cfg: GluonConfig, partials_per_split: int = 1):
    """What the Gluon launches start from, over a call's rank view (a ShardView): (out,
    lse_out, done, (parts, n_hb, ns, lens operand, partial outputs)); ``done``: the outputs
    are final already (no rows, empty shard). ``partials_per_split``: partials each program
    writes (the narrow fp8 kernel's scorers write one each), so ns x that are merged."""
    from ..splits import partial_outputs, split_count

    parts = call.parts()
    q, kv = call.q_lat, call.kv
    B, S, H, _ = q.shape
    T = kv.shape[1]
    out, lse_out, done = outputs(q, call.v_dim, out, lse_out, T == 0)
    if done:
        return out, lse_out, True, None
    n_hb = triton.cdiv(S * H, cfg.block_h)
    ns = num_splits or cfg.num_splits or split_count(B, n_hb, T, kv.device, cfg.waves)
    lens = lens_operand(call.kv_lens, call.lens_stripe, B, kv)
    partials = partial_outputs(out, lse_out, ns * partials_per_split, H, call.lse_base)
    if partials[2][4] != 1:
        raise ValueError("the Gluon MLA kernels write outputs whose feature stride is 1")
    return out, lse_out, False, (parts, n_hb, ns, lens, partials)


def launch_plan(jit, out, lse_out, plan, num_warps: int = 4):
    """Launch a Gluon kernel's plan ``(grid, args, consts, stage-2 launch or None)`` as its
    ``launch_args`` builds it (None: the outputs are final already); returns (out, lse_out)."""
    if plan is None:
        return out, lse_out
    grid, args, consts, stage2 = plan
    launch(jit, grid, args, consts, num_warps)
    if stage2 is not None:
        kernel, grid2, args2, consts2, warps = stage2
        launch(kernel, grid2, args2, consts2, warps)
    return out, lse_out


def _split_keys_src(
    LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LENS: gl.constexpr
):
    """This split's keys [start, end): the request's local count (rank r's share of a global
    count under lens_stripe (c, r), clamped so nothing wraps in int32) cut into NUM_SPLITS
    whole-tile pieces. Both kernel forms take it."""
    if HAS_LENS:
        n_glob = gl.minimum(gl.maximum(gl.load(LENS + b * lens_sb), 0), T * lens_c).to(gl.int32)  # no int32 wrap
        kv_len = gl.minimum((n_glob + (lens_c - 1 - lens_r)) // lens_c, T)
    else:
        kv_len = T
    split_len = gl.cdiv(gl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_sp * split_len
    return start, gl.minimum(start + split_len, kv_len)


if HAS_GLUON:
    split_keys = gluon.jit(_split_keys_src)


# --------------------------------------------------------------------------------------
# device helpers shared by the warp-specialised forms (role split, seesaw, both fp8 ones)
# --------------------------------------------------------------------------------------
if HAS_GLUON:  # (the kernels read them as globals, which Triton allows only as constexprs)
    DL, DR = gl.constexpr(D_LAT), gl.constexpr(D_ROPE)


def _opaque_src(x):
    """x through an opaque mov: a buffer index LLVM cannot prove constant per partition (else it
    hoists the score GEMM's per-step descriptors out of the loop and ptxas spills them)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


def _copy_mask_src(dst, mk_row, t0, end, sm_t, BLOCK_N: gl.constexpr):
    """The mask row's entries for the tile at key t0 into `dst` (fp32 [BLOCK_N]), 4 bytes a copy
    (any key stride; 128 threads, two a key); past `end` zero-filled. Copied with the tile and
    covered by the same barrier arrival: read from global memory after the score GEMM, a mask
    row waits in the same queues as the cache stream (lock_step.py)."""
    n = gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([1], [32], [4], [0]))
    async_load(dst, mk_row + (t0 + n) * sm_t, mask=(t0 + n) < end)


def _query_positions_src(qpos_row, sqp_s, rows, H, SH):
    """The query positions of block rows `rows` (row = token * H + head) as int32, clamped into
    [-1, 2^31 - 2] so that the comparisons with key positions cannot wrap; -1 (sees nothing)
    for rows past SH."""
    q = gl.load(qpos_row + (rows // H) * sqp_s, mask=rows < SH, other=-1)
    return gl.minimum(gl.maximum(q, -1), 2147483646).to(gl.int32)


def _row_positions_src(qpos_row, sqp_s, row0, H, SH, row_l: gl.constexpr, BLOCK_H: gl.constexpr, CAUSAL: gl.constexpr):
    """A scorer's query positions of the block's rows, in layout `row_l`, for a causal cap (0,
    unused, without one)."""
    if CAUSAL:
        qpos = query_positions(qpos_row, sqp_s, row0 + gl.arange(0, BLOCK_H, layout=row_l), H, SH)
    else:
        qpos = 0
    return qpos


def _causal_end_src(
    end, qpos_row, sqp_s, row0, H, SH, cp_world, cp_rank, BLOCK_H: gl.constexpr, ROWS_PER_THREAD: gl.constexpr = 1
):
    """`end` cut at the last local key any row of the block may see: key k is at global position
    k * cp_world + cp_rank, visible to a row whose query position is not before it.
    ROWS_PER_THREAD = BLOCK_H: every thread reads all the rows' positions, so the maximum needs
    no reduction across warps (shared memory and a barrier; before the narrow fp8 kernel's
    partitions that cost its scorers 336 spilled bytes on Triton 3.6)."""
    rows = row0 + gl.arange(0, BLOCK_H, layout=gl.BlockedLayout([ROWS_PER_THREAD], [32], [4], [0]))
    qmax = gl.max(query_positions(qpos_row, sqp_s, rows, H, SH), axis=0)
    return gl.minimum(end, gl.where(qmax >= cp_rank, (qmax - cp_rank) // cp_world + 1, 0).to(gl.int32))


def _scores_log2_src(
    s, t0, end, sm_scale_log2, mk, qpos, cp_world, cp_rank, HAS_MASK: gl.constexpr, CAUSAL: gl.constexpr
):
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


def _store_half_src(o_base, acc, l_i, c0: gl.constexpr, row0, so_s, so_h, H, SH, BLOCK_H: gl.constexpr):
    """A partition's 256 output columns from c0, its accumulator over the rows' sums (0 where a
    row saw no key)."""
    o_mma: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_mma))
    o = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    rows_o = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_mma))
    cols_o = c0 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_mma))
    gl.store(
        o_base + (rows_o // H)[:, None] * so_s + (rows_o % H)[:, None] * so_h + cols_o[None, :],
        o.to(o_base.dtype.element_ty),
        mask=(rows_o < SH)[:, None],
    )


def _scorer_src(
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
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    mk,
    qpos_row,
    sqp_s,
    cp_world,
    cp_rank,
    HAS_MASK: gl.constexpr,
    CAUSAL: gl.constexpr,
):
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
    qpos = row_positions(qpos_row, sqp_s, row0, H, SH, row_s, BLOCK_H, CAUSAL)
    for j in range(n_tiles):
        buf = opaque(j + salt) % 2
        mbarrier.wait(full.index(buf), (j // 2) & 1)
        fence_async_shared()  # the copies' writes before the tensor cores' reads
        s = warpgroup_mma(
            q_rope_s,
            k_rope.index(buf).permute((1, 0)),
            gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma),
            use_acc=False,
            is_async=True,
        )
        s = warpgroup_mma(q_lat_s, k_lat.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        if HAS_MASK or CAUSAL:
            if HAS_MASK:
                mk_t = mk.index(buf).load(gl.SliceLayout(0, s_mma))  # landed with the tile
            else:
                mk_t = 0  # unused
            s = scores_log2(s, start + j * BLOCK_N, end, sm_scale_log2, mk_t, qpos, cp_world, cp_rank, HAS_MASK, CAUSAL)
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
        acc = warpgroup_mma(
            gl.convert_layout(pb, gl.DotOperandLayout(0, o_mma, 2)),
            k_lat.index(buf).slice(256, 256, dim=1),
            acc * gl.convert_layout(alpha, row_o)[:, None],
            is_async=True,
        )
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(buf))
    l_s.store(l_i)
    mbarrier.arrive(done)
    store_half(o_base, acc, l_i, 256, row0, so_s, so_h, H, SH, BLOCK_H)
    rows_m = row0 + gl.arange(0, BLOCK_H, layout=row_s)
    lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * lse_scale
    gl.store(l_base + (rows_m // H) * sl_s + (rows_m % H) * sl_h, lse, mask=rows_m < SH)


def _role_buffers_src(
    dt: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, FULL_COUNT: gl.constexpr, HAS_MASK: gl.constexpr
):
    """The role-split kernels' shared memory after q, in this order: two tiles of `dt` (latent,
    rope), each buffer's row rescale, the final row sums, the barriers (`full` counting
    FULL_COUNT arrivals a fill; the others one: Gluon's arrive is a partition barrier, then one
    arrival) and, with HAS_MASK, each buffer's mask entries (else `a_s` stands in, unused)."""
    k_lat = gl.allocate_shared_memory(
        dt, [2, BLOCK_N, DL], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.bfloat16)
    )
    k_rope = gl.allocate_shared_memory(
        dt, [2, BLOCK_N, DR], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16)
    )
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


if HAS_GLUON:
    opaque = gluon.jit(_opaque_src)
    copy_mask = gluon.jit(_copy_mask_src)
    query_positions = gluon.jit(_query_positions_src)
    row_positions = gluon.jit(_row_positions_src)
    causal_end = gluon.jit(_causal_end_src)
    scores_log2 = gluon.jit(_scores_log2_src)
    store_half = gluon.jit(_store_half_src)
    scorer = gluon.jit(_scorer_src)
    role_buffers = gluon.jit(_role_buffers_src)


def mask_args(call, T: int, dummy) -> tuple:
    """(arguments, constants) of a call's mask row and causal cap, for the warp-specialised Gluon
    kernels (role split, seesaw, both fp8 ones): MASK, QPOS, the mask row's batch and key
    strides, q_pos's, the stripe, after the plain call's arguments (``dummy``, a tensor on the
    call's device, stands in for an absent operand); HAS_MASK and CAUSAL. The mask is one row
    per request (gluon_reason, fp8_gluon_reason); T: the keys the kernel spans."""
    B, S, H, _ = call.q_lat.shape
    mask_b, ms, _ = mask_operand(call.mask, B, S, H, T, dummy.device)
    q_pos, qps, cp_world, cp_rank = causal_operand(call.causal, B, S, dummy)
    return (
        (mask_b if mask_b is not None else dummy, q_pos, ms[0], ms[3], *qps, cp_world, cp_rank),
        dict(HAS_MASK=mask_b is not None, CAUSAL=call.causal is not None),
    )
