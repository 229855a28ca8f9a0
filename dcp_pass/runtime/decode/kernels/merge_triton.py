"""Triton kernels for the exact DCP LSE merge.

Same maths as ``dcp_pass.runtime.decode.merge.merge_partials`` (see there); these exist so
eager CUDA runs do the merge in one pass over the partials, and so the packed
all-to-all receive buffer can be merged without first being split into separate
output and LSE tensors.

Layout contract: partials are addressed as [c, N, D] with arbitrary strides (N is the
flattened row count, e.g. B*S*H), LSEs as [c, N]. One program handles one row and one
block of D columns; the c loop runs twice (max, then weighted sum) because c is small
and re-reading c scalars is cheaper than the rescaling an online merge needs.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from dcp_pass.runtime.decode.merge_checks import check_base, check_merge_args, check_packed_width

__all__ = ["merge_partials_triton", "unpack_merge_triton"]

# Caps the per-program column block: MLA's latent dim (512) fits in one block, and
# larger head dims just use more programs along D.
_MAX_BLOCK_D = 1024


@triton.jit
def _load_lse(
    lse_ptr,
    bits_ptr,
    r,
    n,
    s_lc,
    s_ln,
    bits_base,
    s_bc,
    s_bn,
    PACKED: tl.constexpr,
    K: tl.constexpr,
    ELEM_BITS: tl.constexpr,
):
    if PACKED:
        # The fp32 LSE was stored as K integer pieces of ELEM_BITS each, low piece
        # first (little-endian reinterpretation on the host side). Rebuilding the
        # word from pieces avoids a 4-byte load at an address that is only
        # element-aligned when the row length D + K is odd.
        word = tl.zeros((), dtype=tl.uint32)
        for j in tl.static_range(K):
            piece = tl.load(bits_ptr + r * s_bc + n * s_bn + bits_base + j)
            if ELEM_BITS == 32:
                piece_u = piece.to(tl.uint32, bitcast=True)
            elif ELEM_BITS == 16:
                piece_u = piece.to(tl.uint16, bitcast=True).to(tl.uint32)
            else:
                piece_u = piece.to(tl.uint8, bitcast=True).to(tl.uint32)
            word = word | (piece_u << (j * ELEM_BITS))
        val = word.to(tl.float32, bitcast=True)
    else:
        val = tl.load(lse_ptr + r * s_lc + n * s_ln).to(tl.float32)
    return val


@triton.jit
def _merge_kernel(
    o_ptr,
    lse_ptr,
    bits_ptr,
    out_ptr,
    out_lse_ptr,
    N,
    D,
    s_oc,
    s_on,
    s_od,
    s_lc,
    s_ln,
    bits_base,
    s_bc,
    s_bn,
    s_outn,
    s_outd,
    C: tl.constexpr,
    BASE2: tl.constexpr,
    PACKED: tl.constexpr,
    K: tl.constexpr,
    ELEM_BITS: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # C (the DCP size) is a compile-time constant: it is fixed per deployment, and a
    # runtime loop bound trips older Triton interpreters (3.6 + numpy 2).
    n = tl.program_id(0)
    pid_d = tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    NEG_INF = float("-inf")

    # Pass 1: max over non-empty shards. Only -inf marks an empty shard (no visible
    # key); NaN and +inf are values and propagate as they would without DCP.
    m = tl.full((), NEG_INF, tl.float32)
    for r in range(C):
        l = _load_lse(lse_ptr, bits_ptr, r, n, s_lc, s_ln, bits_base, s_bc, s_bn, PACKED, K, ELEM_BITS)
        valid = l != NEG_INF
        m = tl.maximum(m, tl.where(valid, l, NEG_INF))
    # All-empty row: shift by 0 so no -inf - -inf NaN appears; all weights become 0.
    m = tl.where(m == NEG_INF, 0.0, m)

    # Pass 2: weighted sum in fp32.
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r in range(C):
        l = _load_lse(lse_ptr, bits_ptr, r, n, s_lc, s_ln, bits_base, s_bc, s_bn, PACKED, K, ELEM_BITS)
        valid = l != NEG_INF
        if BASE2:
            w = tl.exp2(l - m)
        else:
            w = tl.exp(l - m)
        w = tl.where(valid, w, 0.0)
        total += w
        o = tl.load(o_ptr + r * s_oc + n * s_on + cols * s_od, mask=cmask, other=0.0).to(tl.float32)
        # An empty shard's output is not data: it must not leak through 0 * NaN.
        o = tl.where(valid, o, 0.0)
        acc += w * o

    # total is 0 exactly when every shard is empty; NaN/inf totals must stay visible
    safe_total = tl.where(total == 0.0, 1.0, total)
    res = acc / safe_total
    tl.store(out_ptr + n * s_outn + cols * s_outd, res.to(out_ptr.dtype.element_ty), mask=cmask)
    if RETURN_LSE:
        # log of the guarded total, then -inf for empty rows: never log(0).
        if BASE2:
            lse = m + tl.log2(safe_total)
        else:
            lse = m + tl.log(safe_total)
        lse = tl.where(total == 0.0, NEG_INF, lse)
        # Only one column block writes the row's LSE.
        if pid_d == 0:
            tl.store(out_lse_ptr + n, lse)


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(max(D, 1)), _MAX_BLOCK_D)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _launch(
    o3: Tensor,
    D: int,
    lead,
    out_dtype: torch.dtype,
    base: str,
    return_lse: bool,
    lse: Tensor,
    lse_strides,
    bits: Tensor,
    bits_args,
    PACKED: bool,
    K: int,
    ELEM_BITS: int,
):
    """Run _merge_kernel over partials o3 [c, N, >= D] and shape the result like [*lead, D].

    ``lse``/``lse_strides`` address separate LSEs [c, N]; ``bits``/``bits_args`` (column
    offset, strides) address LSEs packed into the rows' tail (PACKED=True).
    """
    c, N = o3.shape[0], o3.shape[1]
    out = torch.empty((N, D), dtype=out_dtype, device=o3.device)
    out_lse = torch.empty((N,), dtype=torch.float32, device=o3.device)
    if N > 0 and D > 0:
        BLOCK_D = _block_d(D)
        grid = (N, triton.cdiv(D, BLOCK_D))
        _merge_kernel[grid](
            o3,
            lse,
            bits,
            out,
            out_lse,
            N,
            D,
            o3.stride(0),
            o3.stride(1),
            o3.stride(2),
            *lse_strides,
            *bits_args,
            out.stride(0),
            out.stride(1),
            C=c,
            BASE2=(base == "2"),
            PACKED=PACKED,
            K=K,
            ELEM_BITS=ELEM_BITS,
            RETURN_LSE=return_lse,
            BLOCK_D=BLOCK_D,
        )
    out = out.reshape(*lead, D)
    if return_lse:
        return out, out_lse.reshape(lead)
    return out


def merge_partials_triton(
    outputs: Tensor,
    lses: Tensor,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Triton version of merge_partials: outputs [c, ..., D], lses [c, ...]."""
    out_dtype = check_merge_args("merge_partials_triton", outputs, lses, base, out_dtype)
    c, D = outputs.shape[0], outputs.shape[-1]
    # reshape keeps a view whenever the leading dims can be flattened, so strided
    # inputs (e.g. a head slice) are read in place.
    o3 = outputs.reshape(c, -1, D)
    l2 = lses.reshape(c, -1)
    return _launch(
        o3,
        D,
        outputs.shape[1:-1],
        out_dtype,
        base,
        return_lse,
        l2,
        (l2.stride(0), l2.stride(1)),
        l2,
        (0, 0, 0),
        PACKED=False,
        K=1,
        ELEM_BITS=32,
    )


def unpack_merge_triton(
    packed: Tensor,
    D: int,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Merge straight from a packed receive buffer [c, ..., D + k] (see pack_output_lse).

    Returns the merged output [..., D] (and fp32 LSE [...] with return_lse); no
    intermediate unpacked copies are made.
    """
    check_base(base)
    k = check_packed_width("unpack_merge_triton", packed, D)
    out_dtype = packed.dtype if out_dtype is None else out_dtype
    p3 = packed.reshape(packed.shape[0], -1, D + k)
    elem = packed.element_size()
    # Same storage seen as integers of the same width: the kernel assembles the LSE
    # bits from these pieces.
    bits = p3.view(_INT_OF_SIZE[elem])
    return _launch(
        p3,
        D,
        packed.shape[1:-1],
        out_dtype,
        base,
        return_lse,
        p3,
        (0, 0),
        bits,
        (D * bits.stride(2), bits.stride(0), bits.stride(1)),
        PACKED=True,
        K=k,
        ELEM_BITS=8 * elem,
    )
