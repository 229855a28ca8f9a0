"""Torch references of the shard-local attention: plain torch, fp32 accumulation (fp64 for
fp64 inputs), on every device.

:func:`heads_attention_reference` is attention over per-head keys and values (grouped-query
and multi-head attention, and MLA models that re-expand the latent per head): query head h
reads kv head ``h // (H // Hk)``. The keys given are the visible ones already (the op cuts
a rank's window rows out of its shard), so emptiness is a count: no key gives output 0 and
LSE -inf. A NaN in a query, key or value propagates as it would without DCP.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

LOG2E = 1.4426950408889634

__all__ = ["accumulation_dtype", "heads_attention_reference"]


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (an fp32 LSE would cost fp64 models ~1e-7 in the merge), else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def heads_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: Optional[torch.Tensor] = None,
    lse_base: str = "e",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B,S,H,D]`` over ``k [B,T,Hk,D]`` / ``v [B,T,Hk,Dv]`` (every key visible).

    ``mask``: additive, broadcastable to ``[B,S,H,T]``. Returns ``(out [B,S,H,Dv] in q's dtype,
    lse [B,S,H])`` with the LSE fp32 (fp64 for fp64 inputs) in ``lse_base`` ("e" or "2").
    """
    if lse_base not in ("e", "2"):
        raise ValueError(f"lse_base must be 'e' or '2', got {lse_base!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be 4-D ([B,S,H,D], [B,T,Hk,D], [B,T,Hk,Dv]), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, S, H, D = q.shape
    T, Hk = k.shape[1], k.shape[2]
    if Hk == 0 or H % Hk:
        raise ValueError(f"the query's {H} heads must be a multiple of the {Hk} key/value heads")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, T, Hk, D={D}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, T, Hk, Dv] with k's [B, T, Hk] = {tuple(k.shape[:3])}, got {tuple(v.shape)}")
    G = H // Hk
    acc = accumulation_dtype(q)
    scores = torch.einsum("bskgd,btkd->bskgt", q.to(acc).reshape(B, S, Hk, G, D), k.to(acc)).reshape(B, S, H, T)
    scores = scores * scale
    if mask is not None:
        scores = scores + mask.to(acc)
    if T == 0:
        lse = scores.new_full((B, S, H), float("-inf"))
    else:
        lse = torch.logsumexp(scores, dim=-1)
    # -inf: no visible key (or every key masked), output 0; a NaN score is data and gives NaN
    empty = torch.isneginf(lse)
    p = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("bskgt,btkd->bskgd", p.reshape(B, S, Hk, G, T), v.to(acc)).reshape(B, S, H, v.shape[-1])
    if lse_base == "2":
        lse = lse * LOG2E
    return out.to(q.dtype), lse
