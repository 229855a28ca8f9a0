"""Argument checks shared by the torch merge (``merge``) and its Triton kernels
(``kernels.merge_triton``), kept apart so that neither imports the other's privates."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["LSE_BASES", "check_base", "check_merge_args", "check_packed_width", "packed_lse_columns"]

LSE_BASES = ("e", "2")


def check_base(base: str) -> str:
    """Validate an LSE base name; returns it unchanged."""
    if base not in LSE_BASES:
        raise ValueError(f"LSE base must be one of {LSE_BASES} (as a string), got {base!r}")
    return base


def check_merge_args(
    fn: str, outputs: Tensor, lses: Tensor, base: str, out_dtype: Optional[torch.dtype]
) -> torch.dtype:
    """Validate merge arguments (outputs [c, ..., D], lses [c, ...]); returns the output dtype."""
    check_base(base)
    if outputs.dim() != lses.dim() + 1 or outputs.shape[:-1] != lses.shape:
        raise ValueError(f"{fn}: outputs {tuple(outputs.shape)} must be lses {tuple(lses.shape)} + [D]")
    return outputs.dtype if out_dtype is None else out_dtype


def check_packed_width(fn: str, packed: Tensor, D: int) -> int:
    """k, the LSE tail columns of a packed [..., D + k] buffer; raises if the width is not D + k."""
    k = packed_lse_columns(packed.dtype)
    if packed.shape[-1] != D + k:
        raise ValueError(f"{fn}: last dim {packed.shape[-1]} != D + k = {D} + {k}")
    return k


def packed_lse_columns(dtype: torch.dtype) -> int:
    """Number of tail columns of ``dtype`` that hold one fp32 LSE (one fp64 column for
    fp64 outputs: the LSE is stored converted, which is exact, not reinterpreted)."""
    if dtype == torch.float64:
        return 1
    size = torch.empty((), dtype=dtype).element_size()
    if size > 4 or 4 % size:
        raise ValueError(f"cannot pack an fp32 LSE into columns of {dtype} ({size}-byte elements)")
    return 4 // size
