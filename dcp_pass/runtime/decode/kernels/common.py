"""Host-side pieces shared by the MLA attention kernels (``mla_attention``, ``mla_wide``, the Gluon ones).

Argument checks (including which calls the Triton kernels take: :func:`triton_reason`), the
operands every launch builds the same way (mask, causal positions, output buffers) and
small constants, and three device-side helpers both Triton kernels inline (a shard's key
count, query positions as int32, the keys a position sees). Nothing here launches a
kernel; both kernel modules import from here and from ``splits`` (split count, stage-2
merge), neither from the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Optional, Tuple

import torch

from dcp_pass import env
from dcp_pass.runtime.decode.call import (  # noqa: F401
    AttentionCall,
    Causal,
    Parts,
    ShardView,
    check_base,
    mask_rows_shared,
    pow2,
    split_parts,
)

try:  # triton is optional at import time (CPU-only installs still get the reference)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "INTERPRETED",
    "LOG2E",
    "LN2",
    "Causal",
    "Parts",
    "AttentionCall",
    "ShardView",
    "check_base",
    "split_parts",
    "pow2",
    "mask_operand",
    "mask_rows_shared",
    "cuda_properties",
    "causal_operand",
    "outputs",
    "check_launchable",
    "lse_scale",
    "mla_refusal",
    "fp8_reason",
    "triton_reason",
    "triton_device_reason",
    "lens_operand",
    "launch",
    "recording_launches",
    "FP8_READS",
    "fp8_read",
    "FOLD_F16_READS",
    "fold_dtype",
    "fold_operand",
    "fp8_dots_dtype",
    "row_alignment",
    "shard_keys",
    "positions_i32",
    "keys_up_to",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _probe_src(X):
    pass


if HAS_TRITON:
    # With TRITON_INTERPRET=1 set before triton's import, triton.jit returns interpreted
    # functions and the kernels run on CPU tensors (tests); the flag must precede the
    # import because triton's own library functions (tl.cdiv, tl.max) are jitted too.
    INTERPRETED = not isinstance(triton.jit(_probe_src), triton.runtime.JITFunction)
else:  # pragma: no cover
    INTERPRETED = False


def _squeeze_scalar_index() -> None:
    """Let older Triton interpreters index with computed scalars under NumPy >= 2.4.

    The interpreter holds a scalar as a one-element array, and Triton < 3.7 turns it into
    an int with ``int(array)``, which NumPy 2.4 refuses for an array of one dimension:
    every kernel loop over a computed bound (``range(start, end, BLOCK_N)``) then fails
    under TRITON_INTERPRET=1 with "only 0-dimensional arrays can be converted to Python
    scalars" (torch 2.11 ships Triton 3.6). Later Tritons squeeze first; this installs the
    same conversion on the older ones, in the interpreter's own patching step, so compiled
    kernels are untouched.
    """
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7):
        return
    interp = getattr(triton.runtime, "interpreter", None)
    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_dcp_squeezes", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._dcp_squeezes = True  # type: ignore[attr-defined]  # marks the patch as ours
    interp._patch_lang_tensor = patch_lang_tensor


if INTERPRETED:
    _squeeze_scalar_index()


def _bcast_mask(mask, B, S, H, T, device, keep_bool=False):
    if mask is None:
        return None
    m = mask
    if m.device != device:
        m = m.to(device)
    if m.dtype == torch.bool:
        # a keep mask (True: visible): read in place as bytes by a kernel that takes it, else
        # made additive (a copy of the mask's own size, fp32)
        m = m.view(torch.uint8) if keep_bool else torch.where(m, 0.0, float("-inf"))
    elif m.dtype != torch.float32:
        m = m.float()
    return torch.broadcast_to(m, (B, S, H, T))


def mask_operand(mask, B, S, H, T, device, keep_bool=False):
    """(mask as fp32 [B, S, H, T] or None, its strides, MASK_SHARED) for the kernels;
    with `keep_bool` a boolean mask comes as its uint8 bytes (1: visible), no copy.

    MASK_SHARED: one mask row serves every row of a block (rows differ only by head, or the
    mask does not vary over query tokens either).
    """
    mask_b = _bcast_mask(mask, B, S, H, T, device, keep_bool)
    ms = mask_b.stride() if mask_b is not None else (0, 0, 0, 0)
    return mask_b, ms, mask_b is not None and mask_rows_shared(ms, S)


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def cuda_properties(device: torch.device):
    """The device's properties (SM count, shared memory, compute capability), looked up once:
    launch paths read them on every call."""
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())


def causal_operand(causal, B, S, dummy):
    """(q_pos [B, S], its strides, cp_world, cp_rank); without causal ``dummy`` stands in (CAUSAL is off)."""
    if causal is None:
        return dummy, (0, 0), 1, 0
    q_pos, cp_world, cp_rank = causal
    q_pos = torch.broadcast_to(q_pos, (B, S))
    return q_pos, q_pos.stride(), int(cp_world), int(cp_rank)


def outputs(q_lat, v_dim, out, lse_out, empty_shard):
    """The output buffers (allocated when not given) and whether they are final already.

    Final without a launch: no rows, or an empty shard (neutral partials: output 0, LSE -inf).
    """
    B, S, H, _ = q_lat.shape
    if out is None:
        out = torch.empty(B, S, H, v_dim, dtype=q_lat.dtype, device=q_lat.device)
    if lse_out is None:
        lse_out = torch.empty(B, S, H, dtype=torch.float32, device=q_lat.device)
    if B == 0 or S * H == 0:
        return out, lse_out, True
    if empty_shard:
        out.zero_()
        lse_out.fill_(float("-inf"))
        return out, lse_out, True
    return out, lse_out, False


def check_launchable(device, kv_lens, who, dtype=None):
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"{who} on CPU tensors needs TRITON_INTERPRET=1 set before triton's import")
    if device.type != "cuda" and dtype == torch.bfloat16:
        # the interpreter keeps bfloat16 as raw 16-bit integers and tl.dot multiplies those
        # (triton-lang/triton#11584, Triton 3.6 and 3.9 alike): values ~1e9, no error of its own
        raise ValueError(
            f"{who}: Triton's interpreter computes tl.dot on bfloat16 wrongly; "
            "on CPU pass float32 or float16 tensors (the GPU path takes bfloat16)"
        )
    if kv_lens is not None and kv_lens.device != device:
        raise ValueError("kv_lens must be on the query's device")


def lens_operand(kv_lens: Optional[torch.Tensor], stripe: Tuple[int, int], B: int, dummy: torch.Tensor):
    """(pointer, batch stride, c, r) of the key counts: one count for every row or one per row."""
    if kv_lens is None:
        return dummy, 0, 1, 0
    if kv_lens.dim() != 1 or kv_lens.shape[0] not in (1, B):
        raise ValueError(f"kv_lens must be [1] or [B={B}], got shape {tuple(kv_lens.shape)}")
    c, r = stripe
    if not 0 <= r < c:
        raise ValueError(f"lens_stripe must be (c, r) with 0 <= r < c, got {stripe}")
    return kv_lens, (0 if kv_lens.shape[0] == 1 else kv_lens.stride(0)), c, r


class _LaunchLog(threading.local):
    entries: Optional[list] = None


_LAUNCH_LOG = _LaunchLog()


def launch(
    kernel, grid, args, consts: dict, num_warps: int, num_stages: Optional[int] = None, maxnreg: Optional[int] = None
):
    """``kernel[grid](*args, **consts, num_warps=, num_stages=, maxnreg=)``, recorded while
    `recording_launches` is on (``maxnreg``: a cap on registers per thread, for occupancy).

    Every Triton launch of the attention kernels goes through here, so that the op's
    replay (runtime/decode/replay.py) sees each compiled kernel with its grid
    and arguments once and can launch it again without Triton's per-call binding.
    """
    options = dict(consts, num_warps=num_warps)
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = kernel[grid](*args, **options)
    if _LAUNCH_LOG.entries is not None:
        _LAUNCH_LOG.entries.append((kernel, compiled, tuple(grid), tuple(args), options))
    return compiled


@contextlib.contextmanager
def recording_launches():
    """Collect (jit function, compiled kernel, grid, args, options) of every `launch` inside."""
    saved, _LAUNCH_LOG.entries = _LAUNCH_LOG.entries, []
    try:
        yield _LAUNCH_LOG.entries
    finally:
        _LAUNCH_LOG.entries = saved


FP8_READS = tuple(r for r in env.VARIABLES["DCP_FP8_READ"].choices if r)  # how the Triton kernels read an fp8 latent

# each kernel's read where DCP_FP8_READ is unset: the faster one on the H200, both exact to fp32
# rounding (benchmarks/results/fp8_kernel_v2_h200.json): the split kernel's fold 1.5x its dequant
# at 16 heads (0.44 vs 0.67 ms, 32 x 32K keys), the two-GEMM kernel's dequant 1.4x its fold at
# 128 heads (1.40 vs 1.95 ms)
DEFAULT_FP8_READ = {"split": "fold", "wide": "dequant"}


def fp8_read(kernel: str) -> str:
    """How `kernel` ("split" or "wide") reads an fp8 latent tile: DCP_FP8_READ when set (read
    at each launch), else :data:`DEFAULT_FP8_READ`.

    ``fold``: the fp8 values enter the dots as fp16 (exact, one packed conversion per two
    values), each 128-column block's scales multiply the block's partial scores and the
    probabilities instead of the values; ``fold_qdtype``: the same with the dots in the
    queries' dtype; ``fold_once``: ``fold`` with the split kernel loading and converting each
    fp8 tile once, the converted tile in shared memory serving both dots (the two-GEMM kernel
    reads it as ``fold``); ``dequant``: every value times its scale in fp32, then rounded to
    the queries' dtype."""
    return env.fp8_read() or DEFAULT_FP8_READ[kernel]


FOLD_F16_READS = ("fold", "fold_once")  # the fold reads whose dots take 16-bit queries in fp16


def fold_dtype(read: str, query_dtype: torch.dtype) -> torch.dtype:
    """The dots' dtype of an fp8 fold read (``fold``, ``fold_qdtype``, ``fold_once``) for
    queries of `query_dtype`: fp32 queries keep fp32 dots; ``fold`` and ``fold_once`` put 16-bit
    ones into fp16 (e4m3 -> fp16 is one packed conversion per two values on sm_90, e4m3 -> bf16
    adds a slow one per value)."""
    if query_dtype == torch.float32 or read not in FOLD_F16_READS:
        return query_dtype
    return torch.float16


def fp8_dots_dtype(read: str, query_dtype: torch.dtype, has_tail: bool) -> torch.dtype:
    """The dtype of every dot a Triton kernel runs for an fp8 call (what the interpreter's
    bf16 check must see): a fold read's latent dots in :func:`fold_dtype`, a rope part's in
    the queries' dtype."""
    dots = fold_dtype(read, query_dtype) if read.startswith("fold") else query_dtype
    return query_dtype if has_tail else dots


def row_alignment(t: torch.Tensor, paged: bool) -> int:
    """The largest power of two, up to 16 bytes' worth of elements, dividing the element offset
    of every row of `t` [B or pages, rows, cols] from its batch row (paged: from the pool's
    start). A kernel's ``tl.multiple_of`` hint with it lets rows of a packed layout (whose
    strides are not multiples of 16) load in 16-byte vectors."""
    g = math.gcd(t.stride(1), t.stride(0) if paged else 0, max(1, 16 // t.element_size()))
    return g & -g


def lse_scale(base):
    """Factor from a base-2 LSE to one in ``base``."""
    return LN2 if base == "e" else 1.0


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mla_refusal(shape) -> Optional[str]:
    """The calls no MLA kernel takes, and why (None for the others)."""
    if shape.per_head:
        return "per-head keys and values (GQA / MHA): the per-head kernel and the torch reference take them"
    if shape.offset_lens:
        return "a window start (kv_start) with device key counts: the torch reference only"
    return None


FP8_KERNELS = "the split-KV Triton kernel and the torch reference"


def fp8_reason(shape) -> Optional[str]:
    """Why a kernel that reads 16-bit caches only cannot take this call (None: not an fp8 call)."""
    if shape.kv_quant:
        return f"it reads 16-bit caches, not an {shape.kv_quant} latent ({FP8_KERNELS} do)"
    return None


def triton_reason(shape, fp8: bool = False) -> Optional[str]:
    """Why the Triton kernels (split and wide) cannot take a call of this
    :class:`~dcp_pass.runtime.decode.call.CallShape` (None: they can); ``fp8``: the kernel
    reads fp8 latent caches (an fp8 call is then judged by its queries' dtype)."""
    if not HAS_TRITON:
        return "triton is not importable"
    if shape.per_head or shape.offset_lens:
        return mla_refusal(shape)
    if shape.kv_quant:
        if not fp8:
            return fp8_reason(shape)
        if shape.dtype != torch.float8_e4m3fn:
            return f"an {shape.kv_quant} latent cache must be float8_e4m3fn, not {shape.dtype}"
        shape = dataclasses.replace(shape, dtype=shape.query_dtype, kv_quant="")
    if shape.dtype not in TRITON_DTYPES:
        return f"the Triton kernels take float16, bfloat16 or float32 caches, not {shape.dtype}"
    if not shape.same_dtypes:
        return "the queries and caches are not of one dtype"
    if not shape.fused and shape.v_dim > shape.d_main:
        return f"values ({shape.v_dim} columns) wider than the key part ({shape.d_main}): not a decode MLA layout"
    if pow2(shape.d_main) > 1024 or pow2(shape.d_tail) > 256:
        return f"{shape.d_main} + {shape.d_tail} score columns: the kernels take up to 1024 + 256"
    return triton_device_reason(shape)


def triton_device_reason(shape) -> Optional[str]:
    """Why a Triton kernel cannot run on the call's device (None: it can): CUDA, or the
    interpreter on CPU in float32 / float16."""
    if shape.device != "cuda" and not INTERPRETED:
        return f"it needs CUDA tensors, or TRITON_INTERPRET=1 set before triton's import for {shape.device} tensors"
    if shape.device != "cuda" and shape.dtype == torch.bfloat16:
        # the interpreter keeps bfloat16 as raw 16-bit integers and tl.dot multiplies those
        # (triton-lang/triton#11584, Triton 3.6 and 3.9 alike): values ~1e9, no error of its own
        return (
            "Triton's interpreter computes tl.dot on bfloat16 wrongly; on CPU pass float32 or float16 "
            "tensors (the GPU path takes bfloat16)"
        )
    return None


# --------------------------------------------------------------------------------------
# device-side helpers (inlined by the split and wide kernels; the Gluon kernel spells the
# same three steps in its own dialect)
# --------------------------------------------------------------------------------------
def _shard_keys_src(LENS, b, lens_sb, T, lens_c, lens_r):
    """Request b's keys on rank ``lens_r`` of ``lens_c`` (``(n + c - 1 - r) // c`` of the global
    count n, capped at T). n is clamped to [0, c T] in its own dtype before the int32
    arithmetic: a count past 2^31 would wrap (2^32 + 5 read as 5)."""
    n = tl.minimum(tl.maximum(tl.load(LENS + b * lens_sb), 0), T * lens_c).to(tl.int32)
    return tl.minimum((n + (lens_c - 1 - lens_r)) // lens_c, T)


def _positions_i32_src(qpos):
    """Query positions as int32, clamped to [-1, 2^31 - 2]: every key an int32 index can
    address is at or before the upper clamp, and the cap ``+ 1`` of keys_up_to stays in range;
    comparisons of int64 positions against every [rows, keys] element cost the split kernel
    1.3x at 64 rows."""
    return tl.minimum(tl.maximum(qpos, -1), 2147483646).to(tl.int32)


def _keys_up_to_src(qmax, cp_world, cp_rank):
    """How many local keys (local k at global ``k * cp_world + cp_rank``) stand at or before
    global position qmax (an int32 from positions_i32)."""
    return tl.where(qmax >= cp_rank, (qmax - cp_rank) // cp_world + 1, 0).to(tl.int32)


def _fold_operand_src(x, DOT_DTYPE: tl.constexpr):
    """A query tile ``x`` [R, C] as a DOT_DTYPE operand of an fp8 fold read, and its rows'
    power-of-two factors ``f`` [R]: ``x = operand * f`` (exactly, up to fp16 subnormals).

    bf16 rows read into fp16 are divided by a power of two that puts the row's largest value
    near 2^14, so that every value lies in fp16's range; fp16 has the more mantissa bits, so
    the conversion is then exact (values below 2^-28 of the row's largest become fp16
    subnormals, their rounding far below anything bf16 resolves). Other reads: f = 1."""
    if DOT_DTYPE == tl.float16 and x.dtype == tl.bfloat16:
        xf = x.to(tl.float32)
        big = tl.max(tl.abs(xf), axis=1)
        e = tl.ceil(tl.log2(tl.where(big > 0.0, big, 1.0))) - 14.0
        f = tl.exp2(tl.minimum(tl.maximum(e, -100.0), 100.0))
        y = (xf * (1.0 / f)[:, None]).to(DOT_DTYPE)
    else:
        f = tl.full([x.shape[0]], 1.0, tl.float32)
        y = x.to(DOT_DTYPE)
    return y, f


if HAS_TRITON:
    shard_keys = triton.jit(_shard_keys_src)
    positions_i32 = triton.jit(_positions_i32_src)
    keys_up_to = triton.jit(_keys_up_to_src)
    fold_operand = triton.jit(_fold_operand_src)
else:  # pragma: no cover - the kernels that call them do not exist either
    shard_keys = positions_i32 = keys_up_to = fold_operand = None
