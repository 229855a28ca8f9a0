"""What the two Gluon MLA kernels share: ``mla_gluon.py`` (the lock-step form) and
``mla_gluon_roles.py`` (the role-split form) import it, neither imports the other.

The Gluon imports and the aliases of names that moved between Triton releases, DeepSeek's
column counts, the calls both forms take (:func:`gluon_reason`), their configuration
(:class:`GluonConfig`, the lock-step kernel's :class:`Schedule` names), the launch frame
both fill (:func:`split_frame`), and the device-side helper both inline for a split's keys.

The registry (``registry.py``) lists the two forms as two kernels; on Triton 3.6, where it
was measured 2-16 % faster on the H200 (docs/kernels.md), the role-split form is
preferred for the calls it takes (row strides of multiples of 16 elements, masked and causal
calls included), the lock-step form runs the rest.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from .common import fp8_reason, launch, lens_operand, mla_refusal, outputs

try:  # Gluon ships with Triton >= 3.5 (torch 2.11's Triton 3.6 has it); nothing here runs without it
    import triton
    from triton.compiler.errors import CompilationError
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.runtime.errors import OutOfResources

    # names that moved between Triton releases (3.6: async_copy_global_to_shared for cp.async
    # and TMA, thread_barrier; later: async_load, barrier); the kernels call these aliases
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    from triton.experimental.gluon.language.nvidia.hopper import tma
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (3.6: the older name)

    # what a Triton that cannot build or launch a Gluon kernel raises (its API moves between
    # releases): the chooser then stops offering both forms in this process
    BUILD_ERRORS: tuple = (CompilationError, OutOfResources)
    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the Triton build
    BUILD_ERRORS = ()
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "BUILD_ERRORS", "D_LAT", "D_ROPE", "GLUON_DEFAULT", "GluonConfig", "ROLES_TILES", "Schedule",
           "default_q_reg", "fp8_gluon_reason", "gluon_reason", "launch_plan", "lock_step_default", "roles_preferred",
           "split_frame"]

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
    ROLE_SPLIT = 10  # not a lock-step schedule: the role-split kernel (mla_gluon_roles.py)


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
        roles = self.schedule == Schedule.ROLE_SPLIT or (self.schedule is None and self.tiles == ROLES_TILES
                                                         and roles_preferred())
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
    return _hopper_operands_reason(shape, None if bf16 else "it takes bfloat16 queries and caches",
                                   _row_mask_reason(shape))


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
    return _hopper_operands_reason(shape, None if bf16 else "it takes bfloat16 queries and rope columns",
                                   _row_mask_reason(shape))


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
    from .splits import partial_outputs, split_count

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


def _split_keys_src(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr,
                    HAS_LENS: gl.constexpr):
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
    _split_keys = gluon.jit(_split_keys_src)
