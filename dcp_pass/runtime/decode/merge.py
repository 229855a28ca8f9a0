"""Exact log-sum-exp merge of partial attention results, and output/LSE packing.

Every DCP rank attends over its own stripe of the KV cache and produces a partial
output ``o_r`` normalised over that stripe, plus the stripe's log-sum-exp ``lse_r``.
The full-context result is recovered exactly:

    lse = log_b(sum_r b ** lse_r)
    o   = sum_r b ** (lse_r - lse) * o_r

with ``b`` the base of the attention kernel's LSE ("e" for FlashMLA, "2" for
FlashInfer). Mixing bases silently scales every weight by ln 2, so the base is an
explicit, validated argument everywhere.

The reference here is plain torch with no data-dependent Python branches, so the
compile pass can emit it into a graph and aot_autograd / inductor can trace it.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from dcp_pass.runtime.decode.merge_checks import LSE_BASES, check_base, packed_lse_columns
from dcp_pass.runtime.decode.merge_checks import check_merge_args as _check_merge_args
from dcp_pass.runtime.decode.merge_checks import check_packed_width as _check_packed_width

__all__ = [
    "LSE_BASES",
    "check_base",
    "merge_partials",
    "merge_partials_dispatch",
    "pack_output_lse",
    "unpack_output_lse",
    "packed_lse_columns",
    "rescale_partial",
    "global_lse",
    "merge_packed",
    "fold_sink",
]


def _exp(x: Tensor, base: str) -> Tensor:
    return torch.exp(x) if base == "e" else torch.exp2(x)


def _log(x: Tensor, base: str) -> Tensor:
    return torch.log(x) if base == "e" else torch.log2(x)


def _acc_dtype(*tensors: Tensor) -> torch.dtype:
    """The merge's accumulation dtype: fp64 when any operand is fp64 (an fp64 model is
    merged in fp64, so DCP stays exact to fp64 rounding), fp32 otherwise."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _masked_lse(lses: Tensor, acc: torch.dtype = torch.float32) -> Tensor:
    # -inf, and only -inf, marks an empty shard: the kernels return it exactly when a
    # shard has no visible key (a count, not a value), and its weight is then exactly 0
    # below. NaN and +inf are data (a NaN in the cache or the weights, an overflowed
    # score) and propagate into the merged result as they would without DCP.
    return lses.to(acc)


def _empty(masked: Tensor) -> Tensor:
    return masked == float("-inf")


def _global_lse(masked: Tensor, base: str) -> Tuple[Tensor, Tensor, Tensor]:
    """From masked partial LSEs [c, ...]: (weights [c, ...], total [...], lse [...]).

    ``weights`` are b**(lse_r - max) (0 for empty shards), ``total`` their sum.
    """
    m = masked.amax(dim=0)  # NaN if any shard's LSE is NaN
    # An all-empty row has max -inf; shifting by it would give -inf - -inf = NaN.
    # Shift by 0 instead: every weight is then exp(-inf) = 0 and the row stays empty.
    m = torch.where(_empty(m), torch.zeros_like(m), m)
    w = _exp(masked - m, base)
    total = w.sum(dim=0)
    # log(0) = -inf, so an all-empty row gets lse = -inf without a branch.
    lse = m + _log(total, base)
    return w, total, lse


def merge_partials(
    outputs: Tensor,
    lses: Tensor,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Merge c partial attention results exactly.

    outputs: [c, ..., D] (fp32/bf16/fp16/fp64), lses: [c, ...] (any float dtype; read as fp32).
    Returns the merged output [..., D] in ``out_dtype`` (default outputs.dtype), and
    with ``return_lse`` also the merged fp32 LSE [...] in the same base. When outputs or
    LSEs are fp64 the merge runs in fp64 and the LSE comes back fp64.
    Empty shards (LSE -inf) get weight 0; an all-empty row is 0 with LSE -inf. A NaN or
    +inf LSE is data, not emptiness: the row's result is NaN, as without DCP.
    """
    out_dtype = _check_merge_args("merge_partials", outputs, lses, base, out_dtype)
    acc = _acc_dtype(outputs, lses)
    masked = _masked_lse(lses, acc)
    w, total, lse = _global_lse(masked, base)
    # Normalise the weights once per row; guarding the divisor keeps all-empty rows
    # (total exactly 0) at 0 instead of 0/0, and leaves a NaN total visible.
    scale = w / torch.where(total == 0, torch.ones_like(total), total)
    o32 = outputs.to(acc)
    # An empty shard's output is not data (another kernel may leave 0/0 there);
    # 0 * NaN would poison the sum, so zero it explicitly.
    o32 = torch.where(_empty(masked).unsqueeze(-1), torch.zeros_like(o32), o32)
    out = (scale.unsqueeze(-1) * o32).sum(dim=0).to(out_dtype)
    if return_lse:
        return out, lse
    return out


def fold_sink(o: Tensor, lse: Tensor, sink: Tensor, base: str = "e", out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """A merged attention output with a sink logit per head counted in its softmax.

    o [..., H, D] and lse [..., H] (in base ``base``) are the merged result over the keys;
    sink [..., H] holds the sink logits in natural-log units, broadcast against lse. The sink
    joins the denominator and adds no value:

        lse_t = logaddexp(lse, s),  o_t = o * exp(lse - lse_t)

    computed in fp32 (fp64 for fp64 operands). A row with no visible key (lse -inf) gives
    0, all its weight on the sink, as the model's softmax over [scores, s] does; a NaN in o,
    lse or s gives NaN.
    """
    check_base(base)
    acc = _acc_dtype(o, lse, sink)
    lse = lse.to(acc)
    s = sink.to(acc)
    if base == "2":
        s = s * math.log2(math.e)
        keep = torch.exp2(lse - torch.logaddexp2(lse, s))
    else:
        keep = torch.exp(lse - torch.logaddexp(lse, s))
    return (o.to(acc) * keep.unsqueeze(-1)).to(o.dtype if out_dtype is None else out_dtype)


def global_lse(lses: Tensor, base: str = "e") -> Tensor:
    """fp32 (fp64 for fp64 LSEs) logsumexp over dim 0 of partial LSEs [c, ...], empty
    shards ignored (-inf if all empty)."""
    check_base(base)
    return _global_lse(_masked_lse(lses, _acc_dtype(lses)), base)[2]


def rescale_partial(o: Tensor, lse: Tensor, global_lse: Tensor, base: str = "e") -> Tensor:
    """fp32 (fp64 if any input is fp64) ``o * b**(lse - global_lse)``, with empty shards
    (or empty rows) giving 0.

    This is one rank's contribution to the merged output when the sum over ranks is
    done by a collective (reduce-scatter / all-reduce) instead of locally.
    """
    check_base(base)
    acc = _acc_dtype(o, lse, global_lse)
    masked = _masked_lse(lse, acc)
    valid = ~_empty(masked)
    # global_lse is -inf only where every shard, this one included, is empty: the
    # weight is forced to 0 there. NaN/+inf pass through into the weight.
    g = global_lse.to(acc)
    g = torch.where(_empty(g), torch.zeros_like(g), g)
    w = torch.where(valid, _exp(masked - g, base), torch.zeros_like(masked))
    o32 = torch.where(valid.unsqueeze(-1), o.to(acc), torch.zeros((), dtype=acc, device=o.device))
    return o32 * w.unsqueeze(-1)


def pack_output_lse(o: Tensor, lse: Tensor) -> Tensor:
    """[..., D] output + fp32 [...] LSE -> one [..., D + k] buffer of o.dtype.

    The LSE's 4 bytes are reinterpreted (not converted) into k = 4 // o.element_size()
    tail columns so a single collective moves both, and the round trip is bit-exact
    (NaN payloads and -0.0 included). Traceable: dtype views and, for 2-byte outputs,
    integer arithmetic (_lse_halves), so it fuses under inductor.
    fp64 outputs take the LSE as one fp64 column, converted (exact for fp32 and fp64
    LSEs); unpacking returns it as fp64.
    """
    if o.shape[:-1] != lse.shape:
        raise ValueError(f"pack_output_lse: o {tuple(o.shape)} must be lse {tuple(lse.shape)} + [D]")
    k = packed_lse_columns(o.dtype)
    if o.dtype == torch.float64:
        return torch.cat([o, lse.to(torch.float64).unsqueeze(-1)], dim=-1)
    if k == 2:
        tail = _lse_halves(lse.to(torch.float32)).view(o.dtype)
    else:
        # contiguous() first: a dtype view needs a unit-stride last dimension.
        tail = lse.to(torch.float32).contiguous().unsqueeze(-1).view(o.dtype)
    assert tail.shape[-1] == k
    return torch.cat([o, tail], dim=-1)


# The fp32 LSE in two 16-bit columns, low half first (the bytes of `lse.view(bf16)` on a
# little-endian machine), made with integer arithmetic and same-size bitcasts only, which
# inductor fuses into the neighbouring kernels; a bitcast that changes the element size
# (fp32 -> 2 x bf16) is a fallback op of its own on each side, a host call per layer
# without CUDA graphs. Bit-exact, NaN payloads and -0.0 included.
def _lse_halves(lse32: Tensor) -> Tensor:
    """fp32 [...] -> int16 [..., 2] (low half, high half of the bits)."""
    # one broadcast shift over the two columns rather than a stack of two: a stack is a
    # concatenation, which inductor would not fuse into the pack's own concatenation
    shifts = torch.arange(0, 32, 16, dtype=torch.int32, device=lse32.device)
    half = (lse32.view(torch.int32).unsqueeze(-1) >> shifts) & 0xFFFF
    return torch.where(half >= 0x8000, half - 0x10000, half).to(torch.int16)  # as signed 16-bit values


def _lse_from_halves(halves: Tensor) -> Tensor:
    """Inverse of _lse_halves: any 2-byte [..., 2] -> fp32 [...]."""
    h = halves.view(torch.int16).to(torch.int32)
    return (h[..., 1] * 0x10000 + (h[..., 0] & 0xFFFF)).view(torch.float32)


def unpack_output_lse(packed: Tensor, D: int) -> Tuple[Tensor, Tensor]:
    """Inverse of pack_output_lse: [..., D + k] -> (o [..., D] view, fp32 lse [...]; fp64 for fp64)."""
    _check_packed_width("unpack_output_lse", packed, D)
    o = packed[..., :D]
    if packed.dtype == torch.float64:
        return o, packed[..., D]
    if packed.element_size() == 2:
        return o, _lse_from_halves(packed[..., D:])
    # The tail slice is not aligned for a wider dtype view in general (row stride D+k
    # may be odd); a small contiguous copy makes the reinterpretation legal.
    lse = packed[..., D:].contiguous().view(torch.float32).squeeze(-1)
    return o, lse


def _eager_cuda(t: Tensor) -> bool:
    """True when ``t`` is a real CUDA tensor outside any tracing, where a raw Triton
    launch is safe. Under dynamo, make_fx or fake tensors the traceable reference is
    used instead."""
    if not t.is_cuda or torch.compiler.is_compiling():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return False
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


@functools.lru_cache(maxsize=None)
def _triton_usable() -> bool:
    # Cached: a failed import is retried from scratch (a sys.path scan) on every call,
    # and this runs on every eager merge.
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def merge_partials_dispatch(
    outputs: Tensor,
    lses: Tensor,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """merge_partials, on the Triton kernel for eager CUDA tensors, else the reference.

    Under torch.compile the reference is used: a raw Triton launch is not traceable
    with fake tensors, and inductor fuses the reference into one kernel anyway.
    """
    if _eager_cuda(outputs) and _triton_usable() and _acc_dtype(outputs, lses) != torch.float64:
        from dcp_pass.runtime.decode.kernels.merge_triton import merge_partials_triton

        return merge_partials_triton(outputs, lses, base, out_dtype, return_lse)
    return merge_partials(outputs, lses, base, out_dtype, return_lse)


def merge_packed(
    packed: Tensor,
    D: int,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Merge a packed buffer [c, ..., D + k] (pack_output_lse per shard).

    Eager CUDA uses the fused Triton unpack+merge; everything else unpacks with
    views and runs the reference merge (traceable).
    """
    if _eager_cuda(packed) and _triton_usable() and packed.dtype != torch.float64:
        from dcp_pass.runtime.decode.kernels.merge_triton import unpack_merge_triton

        return unpack_merge_triton(packed, D, base, out_dtype, return_lse)
    o, lse = unpack_output_lse(packed, D)
    return merge_partials(o, lse, base, out_dtype, return_lse)
