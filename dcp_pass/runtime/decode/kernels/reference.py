"""The torch reference of the shard-local attention (the registry's "torch" kernel): plain
torch, fp32 accumulation (fp64 for fp64 inputs), on every device and for every call the
other kernels take (dense or paged caches, masks, causal caps, striped counts), and the
checking mode of fp32 models.

:func:`attention_reference` runs an :class:`~dcp_pass.runtime.decode.call.AttentionCall`;
:func:`heads_attention_reference` is attention over per-head keys and values (grouped-query
and multi-head attention, and MLA models that re-expand the latent per head): query head h
reads kv head ``h // (H // Hk)``. The keys given are the visible ones already (the op cuts
a rank's window rows out of its shard), so emptiness is a count: no key gives output 0 and
LSE -inf. A NaN in a query, key or value propagates as it would without DCP.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from dcp_pass.runtime.decode.call import AttentionCall, CallShape, check_base, split_parts

LOG2E = 1.4426950408889634

__all__ = ["accumulation_dtype", "attention_reference", "gather_pages", "heads_attention_reference", "run",
           "supports"]


def supports(shape: CallShape) -> Optional[str]:
    """Every call: the reference is what the chooser falls back to."""
    return None


def run(call: AttentionCall, out: Optional[torch.Tensor] = None, lse_out: Optional[torch.Tensor] = None):
    """The registry's entry: :func:`attention_reference`."""
    return attention_reference(call, out, lse_out)


def _local_lens(kv_lens: torch.Tensor, stripe: Tuple[int, int], B: int) -> torch.Tensor:
    """Rank r's share of global counts under stripe (c, r), as [B] local counts."""
    from dcp_pass.runtime.decode.layout import local_length

    return local_length(kv_lens.to(torch.long).clamp(min=0), *stripe).expand(B)


def mla_scores_attention(q_lat, q_rope, kv, pe, v_dim, scale, mask, kv_lens, causal, acc_dtype, lens_stripe=(1, 0)):
    """(out [B,S,H,v_dim], lse_e [B,S,H]) in ``acc_dtype`` over a dense shard."""
    parts = split_parts(q_lat, q_rope, kv, pe, v_dim)
    B, S, H, _ = q_lat.shape
    T = kv.shape[1]
    dev = q_lat.device
    scores = torch.einsum("bshd,btd->bsht", parts.q_main.to(acc_dtype), parts.k_main.to(acc_dtype))
    if parts.q_tail is not None:
        scores = scores + torch.einsum("bshd,btd->bsht", parts.q_tail.to(acc_dtype), parts.k_tail.to(acc_dtype))
    scores = scores * scale
    if mask is not None:
        scores = scores + mask.to(acc_dtype)
    visible = torch.ones(B, S, 1, T, dtype=torch.bool, device=dev)
    t_idx = torch.arange(T, device=dev)
    if kv_lens is not None:
        lens = _local_lens(kv_lens.to(dev), lens_stripe, B)
        visible = visible & (t_idx.view(1, 1, 1, T) < lens.view(B, 1, 1, 1))
    if causal is not None:
        q_pos, c, r = causal
        gpos = t_idx * int(c) + int(r)
        visible = visible & (gpos.view(1, 1, 1, T) <= q_pos.to(dev).long().view(B, S, 1, 1))
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if T > 0 else scores.new_full((B, S, H), float("-inf"))
    # -inf: no visible key (empty shard or every key masked), output 0. A NaN/+inf in
    # the scores is data and gives NaN here, as the model without DCP would.
    empty = torch.isneginf(lse)
    p = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    p = p.masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("bsht,btd->bshd", p, kv[..., :v_dim].to(acc_dtype))
    return out, lse


def gather_pages(pool: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """[num_pages, P, D] pool + [B, max_pages] table -> contiguous [B, max_pages * P, D]."""
    B, max_pages = page_table.shape
    P = pool.shape[1]
    idx = page_table.long().clamp(0, max(pool.shape[0] - 1, 0))
    if pool.shape[0] == 0:
        return pool.new_zeros(B, max_pages * P, pool.shape[-1])
    return pool[idx].reshape(B, max_pages * P, pool.shape[-1])


def attention_reference(call: AttentionCall, out: Optional[torch.Tensor] = None,
                        lse_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain torch MLA attention in fp32 (fp64 when the query is fp64).

    Returns ``(out [B,S,H,v_dim] in q dtype, lse [B,S,H])`` in the call's LSE base; the LSE
    is fp32, fp64 for an fp64 query (an fp32 LSE would cost fp64 models ~1e-7 in the merge).
    A paged call reads its pages into one dense shard per row first.
    """
    base = check_base(call.lse_base)
    acc = accumulation_dtype(call.q_lat)
    kv, pe = call.kv, call.pe
    if call.paged:
        kv = gather_pages(kv, call.page_table)
        pe = gather_pages(pe, call.page_table) if pe is not None else None
    o, lse = mla_scores_attention(call.q_lat, call.q_rope, kv, pe, call.v_dim, call.scale, call.mask, call.kv_lens,
                                  call.causal, acc, call.lens_stripe)
    if base == "2":
        lse = lse * LOG2E
    if out is None:
        out = o.to(call.q_lat.dtype)
    else:
        out.copy_(o)
    if lse_out is None:
        lse_out = lse.to(acc)
    else:
        lse_out.copy_(lse)
    return out, lse_out


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
