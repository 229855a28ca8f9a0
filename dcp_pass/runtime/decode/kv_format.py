"""The FP8 storage of a striped MLA latent cache (option ``kv_cache_dtype="fp8_e4m3"``).

**Stored**: one packed ``uint8`` row per token, FlashMLA's layout::

    [ latent: L x float8_e4m3fn | scales: ceil(L / 128) x float32 | rope: R x the model's dtype ]

DeepSeek-V3 (L = 512, R = 64, bf16): 512 + 16 + 128 = 656 bytes instead of 1152. The latent
is quantised in blocks of 128 consecutive columns, each with its own scale
``absmax(block) / 448`` (448: e4m3's largest finite value), so a value is stored as
``e4m3(x / scale)`` and read back as ``e4m3 * scale``. The rotary columns stay in the model's
16-bit dtype: they carry position through the rotation and are 64 of 576 columns. A model
that keeps its rotary keys in their own cache buffer (the reference's ``pe_cache``) keeps
that buffer as it is; only the latent buffer is packed (R = 0 in its layout).

**Read**: as three strided views of the packed rows (:func:`views`): the fp8 latent
``[..., L]``, the fp32 scales ``[..., ceil(L / 128)]`` and the rope ``[..., R]``. Kernels
and the torch reference take them as separate operands (``AttentionCall.kv_scale``).

Why one packed row rather than three tensors: a token is one row of one tensor, so
everything that moves rows (the striped write, the host tier, transfers) moves it whole,
one cache shard stays one graph input and one allocation; the views cost nothing (byte
offsets 0, L and L + 4 ceil(L / 128) are multiples of the element sizes whenever L is a
multiple of 4). Why not power-of-two scales (which would make ``e4m3 * scale`` exact in
bf16): absmax / 448 uses e4m3's whole range, and the kernels dequantise in fp32 anyway.

Pure torch: importing this module imports no kernel and no Triton. Every function is
traceable: the striped write quantises inside the compiled graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = [
    "FP8_E4M3",
    "FP8_MAX",
    "SCALE_BLOCK",
    "Fp8Layout",
    "dequantize",
    "layout_of",
    "pack",
    "pack_columns",
    "quantize",
    "rope_bytes",
    "rope_bytes_of",
    "scale_columns",
    "views",
]

FP8_E4M3 = "fp8_e4m3"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
SCALE_BLOCK = 128  # latent columns per fp32 scale


def scale_columns(latent: int) -> int:
    """fp32 scales of one row of `latent` quantised columns."""
    return -(-int(latent) // SCALE_BLOCK)


@dataclass(frozen=True)
class Fp8Layout:
    """The packed row of one cache buffer: `latent` fp8 columns, their scales, then `rope`
    columns of `rope_dtype` (0: the rotary keys live in another buffer)."""

    latent: int
    rope: int
    rope_dtype: torch.dtype

    def __post_init__(self):
        if self.latent <= 0 or self.latent % 4:
            raise ValueError(f"an fp8 latent cache needs a positive multiple of 4 latent columns, got {self.latent}")
        if self.rope < 0:
            raise ValueError(f"rope columns must be >= 0, got {self.rope}")

    @property
    def n_scales(self) -> int:
        return scale_columns(self.latent)

    @property
    def scale_offset(self) -> int:
        return self.latent

    @property
    def rope_offset(self) -> int:
        return self.latent + 4 * self.n_scales

    @property
    def rope_end(self) -> int:
        return self.rope_offset + self.rope * self.rope_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of a packed row: a multiple of 4, so that the fp32 scales of every row are aligned."""
        return -(-self.rope_end // 4) * 4

    @property
    def columns(self) -> int:
        """Columns of the model's cache buffer this row stores."""
        return self.latent + self.rope

    def spec(self) -> str:
        """The layout as the string the graph's attention op carries (same on every rank)."""
        return f"{FP8_E4M3}:{self.latent}+{self.rope}:{str(self.rope_dtype).replace('torch.', '')}"

    @classmethod
    def parse(cls, spec: str) -> "Fp8Layout":
        try:
            kind, widths, dtype = spec.split(":")
            latent, rope = (int(x) for x in widths.split("+"))
            rope_dtype = getattr(torch, dtype)
        except (ValueError, AttributeError) as e:
            raise ValueError(f"not an fp8 cache layout: {spec!r}") from e
        if kind != FP8_E4M3 or not isinstance(rope_dtype, torch.dtype):
            raise ValueError(f"not an fp8 cache layout: {spec!r}")
        return cls(latent, rope, rope_dtype)


def quantize(latent: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[..., L]`` values -> (``[..., L]`` float8_e4m3fn, ``[..., ceil(L / 128)]`` fp32 scales).

    Scale ``absmax / 448`` per block of 128 columns (an all-zero block: scale 0, values 0).
    A NaN or inf in a block makes its scale NaN or inf, so the whole block reads back NaN:
    NaN in, NaN out, as with an unquantised cache.
    """
    L = latent.shape[-1]
    nb = scale_columns(L)
    x = latent.float()
    pad = nb * SCALE_BLOCK - L
    blocks = (torch.nn.functional.pad(x, (0, pad)) if pad else x).unflatten(-1, (nb, SCALE_BLOCK))
    scale = blocks.abs().amax(-1) / FP8_MAX
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    # clamp: x / scale may round past 448, which e4m3fn (no inf) would make NaN; clamp keeps NaN
    q = (blocks / divisor.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2)
    return (q[..., :L] if pad else q).to(FP8_DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per block, in `dtype` (float64: exact)."""
    L = q.shape[-1]
    per_column = scale.to(dtype).repeat_interleave(SCALE_BLOCK, dim=-1)[..., :L]
    return q.to(dtype) * per_column


def rope_bytes(rope: torch.Tensor, layout: Fp8Layout) -> torch.Tensor:
    """The rotary columns of a packed row, as bytes."""
    return rope_bytes_of(rope, layout.rope_dtype)


def pack(values: torch.Tensor, layout: Fp8Layout) -> torch.Tensor:
    """``[..., L (+ R)]`` cache values -> packed rows ``[..., row_bytes]`` (the latent and scale
    bytes only when `values` holds the latent only and the layout has rope columns)."""
    width = values.shape[-1]
    if width not in (layout.latent, layout.columns):
        raise ValueError(f"pack: {width} columns, the layout stores {layout.latent} latent (+ {layout.rope} rope)")
    q, scale = quantize(values[..., : layout.latent])
    pieces = [q.view(torch.uint8), scale.contiguous().view(torch.uint8)]
    end = layout.rope_offset
    if width > layout.latent:
        pieces.append(rope_bytes(values[..., layout.latent :], layout))
        end = layout.rope_end
    if end % 4:  # the row's padding (odd rope widths of a 16-bit dtype)
        pieces.append(values.new_zeros(values.shape[:-1] + (4 - end % 4,), dtype=torch.uint8))
    return torch.cat(pieces, dim=-1)


def pack_columns(values: torch.Tensor, latent: int, rope: int, rope_dtype: torch.dtype) -> torch.Tensor:
    """:func:`pack` with the layout as plain numbers (what a graph node carries)."""
    return pack(values, Fp8Layout(latent, rope, rope_dtype))


def rope_bytes_of(rope: torch.Tensor, rope_dtype: torch.dtype) -> torch.Tensor:
    """The rotary columns of packed rows as bytes (a graph node's form of :func:`rope_bytes`)."""
    return rope.to(rope_dtype).contiguous().view(torch.uint8)


def views(packed: torch.Tensor, layout: Fp8Layout) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(fp8 latent ``[..., L]``, fp32 scales ``[..., nb]``, rope ``[..., R]`` or None) of packed rows
    (any leading shape and row stride; the last dim contiguous)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != layout.row_bytes:
        raise ValueError(
            f"fp8 cache rows must be uint8 [..., {layout.row_bytes}] ({layout.spec()}), got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    latent = packed[..., : layout.latent].view(FP8_DTYPE)
    scales = packed[..., layout.scale_offset : layout.rope_offset].view(torch.float32)
    rope = packed[..., layout.rope_offset : layout.rope_end].view(layout.rope_dtype) if layout.rope else None
    return latent, scales, rope


def layout_of(spec: str) -> Optional[Fp8Layout]:
    """The layout a graph's format string names ("" or None: an unquantised cache)."""
    return Fp8Layout.parse(spec) if spec else None
