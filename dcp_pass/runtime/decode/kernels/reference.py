"""The torch reference of the shard-local attention (the registry's "torch" kernel): plain
torch, fp32 accumulation (fp64 for fp64 inputs), on every device and for every call the
operand object can state: MLA over dense or paged caches, per-head keys and values (GQA,
MHA), masks, causal caps, windows, striped counts. It is the checking mode of fp32 models
and what the chooser falls back to.

A row with no visible key (an empty shard, a window that misses the rank, every key
masked) gives output 0 and LSE -inf: emptiness is a count. A NaN in a query, key or value
is data and propagates as it would without DCP; rows past a row's count hold no key, and
whatever they hold (a reused slot's NaN) is never read, as in the kernels.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from dcp_pass.runtime.decode.call import AttentionCall, CallShape, ShardView, check_base
from dcp_pass.runtime.decode.kv_format import dequantize
from dcp_pass.runtime.decode.layout import local_length, zero_rows

LOG2E = 1.4426950408889634

__all__ = ["accumulation_dtype", "attention_reference", "gather_pages", "reference_f64", "run", "supports"]


def supports(shape: CallShape) -> Optional[str]:
    """Every call: the reference is what the chooser falls back to."""
    return None


def run(call: AttentionCall, out: Optional[torch.Tensor] = None, lse_out: Optional[torch.Tensor] = None):
    """The registry's entry: :func:`attention_reference`."""
    return attention_reference(call, out, lse_out)


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (an fp32 LSE would cost fp64 models ~1e-7 in the merge), else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def gather_pages(pool: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """[num_pages, P, D] pool + [B, max_pages] table -> contiguous [B, max_pages * P, D]."""
    B, max_pages = page_table.shape
    P = pool.shape[1]
    idx = page_table.long().clamp(0, max(pool.shape[0] - 1, 0))
    if pool.shape[0] == 0:
        return pool.new_zeros(B, max_pages * P, pool.shape[-1])
    return pool[idx].reshape(B, max_pages * P, pool.shape[-1])


def _present(view: ShardView, B: int, T: int, device) -> Optional[torch.Tensor]:
    """[B, T]: which local rows hold keys (the rank's share of the counts, past the rows the
    view starts after); None without counts."""
    if view.kv_lens is None:
        return None

    lens = local_length(view.kv_lens.to(device=device, dtype=torch.long).clamp(min=0), *view.lens_stripe)
    lens = (lens - view.first_row).clamp(min=0).expand(B)
    return torch.arange(T, device=device).view(1, T) < lens.view(B, 1)


def _zero_absent(x: Optional[torch.Tensor], present: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`x` [B, T, ...] with its rows past the count zeroed: rows no key lives in (a reused
    slot, bytes never written) may hold anything, NaN included, and must not reach the output
    through 0 * NaN, as in the kernels, which never load them. Rows inside the count are data."""
    return x if x is None or present is None else zero_rows(x, present)


def _visible(view: ShardView, B: int, S: int, T: int, device) -> torch.Tensor:
    """[B, S, 1, T]: which local rows each query sees (the rank's share of the counts, past
    the rows the view starts after, and the causal cap in global positions)."""
    visible = torch.ones(B, S, 1, T, dtype=torch.bool, device=device)
    t_idx = torch.arange(T, device=device)
    present = _present(view, B, T, device)
    if present is not None:
        visible = visible & present.view(B, 1, 1, T)
    if view.causal is not None:
        q_pos, c, r = view.causal
        gpos = t_idx * int(c) + int(r)
        visible = visible & (
            gpos.view(1, 1, 1, T) <= torch.broadcast_to(q_pos.to(device).long(), (B, S)).view(B, S, 1, 1)
        )
    return visible


def _softmax(scores: torch.Tensor, visible: torch.Tensor):
    """(probabilities, lse_e) of [B, S, H, T] scores over the visible keys."""
    B, S, H, T = scores.shape
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if T > 0 else scores.new_full((B, S, H), float("-inf"))
    # -inf: no visible key (empty shard or every key masked), output 0. A NaN/+inf in
    # the scores is data and gives NaN here, as the model without DCP would.
    empty = torch.isneginf(lse)
    p = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0)
    return p, lse


def _mla(view: ShardView, acc: torch.dtype):
    kv, pe, ks = view.kv, view.pe, view.kv_scale
    if view.paged:
        kv = gather_pages(kv, view.page_table)
        pe = gather_pages(pe, view.page_table) if pe is not None else None
        ks = gather_pages(ks, view.page_table) if ks is not None else None
    if ks is not None:  # an fp8 latent: its rows as values, in the accumulation dtype
        kv = dequantize(kv, ks, acc)
    B, S, H, _ = view.q_lat.shape
    T = kv.shape[1]
    present = _present(view, B, T, view.q_lat.device)
    kv, pe = _zero_absent(kv, present), _zero_absent(pe, present)
    view = ShardView(
        view.q_lat,
        view.q_rope,
        kv,
        pe,
        None,
        view.v_dim,
        view.scale,
        view.mask,
        view.kv_lens,
        view.causal,
        view.lens_stripe,
        view.first_row,
        view.lse_base,
        None,
        1,
    )
    parts = view.parts()
    scores = torch.einsum("bshd,btd->bsht", parts.q_main.to(acc), parts.k_main.to(acc))
    if parts.q_tail is not None:
        scores = scores + torch.einsum("bshd,btd->bsht", parts.q_tail.to(acc), parts.k_tail.to(acc))
    scores = scores * view.scale
    scores = _add_mask(scores, view.mask, acc)
    p, lse = _softmax(scores, _visible(view, B, S, T, view.q_lat.device))
    return torch.einsum("bsht,btd->bshd", p, kv[..., : view.v_dim].to(acc)), lse


def _add_mask(scores: torch.Tensor, mask: Optional[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    """The scores under the call's mask: an additive one added, a boolean one (True: visible)
    setting -inf where it is False."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(acc)


def _heads(view: ShardView, acc: torch.dtype):
    q, k, v = view.q_lat, view.kv, view.v
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k and v must be 4-D ([B,S,H,D], [B,T,Hk,D], [B,T,Hk,Dv]), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, S, H, D = q.shape
    T, Hk = k.shape[1], k.shape[2]
    if Hk == 0 or H % Hk:
        raise ValueError(f"the query's {H} heads must be a multiple of the {Hk} key/value heads")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, T, Hk, D={D}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, T, Hk, Dv] with k's [B, T, Hk] = {tuple(k.shape[:3])}, got {tuple(v.shape)}")
    G = H // Hk
    present = _present(view, B, T, q.device)
    k, v = _zero_absent(k, present), _zero_absent(v, present)
    scores = torch.einsum("bskgd,btkd->bskgt", q.to(acc).reshape(B, S, Hk, G, D), k.to(acc)).reshape(B, S, H, T)
    scores = scores * view.scale
    scores = _add_mask(scores, view.mask, acc)
    p, lse = _softmax(scores, _visible(view, B, S, T, q.device))
    out = torch.einsum("bskgt,btkd->bskgd", p.reshape(B, S, Hk, G, T), v.to(acc)).reshape(B, S, H, v.shape[-1])
    return out, lse


def attention_impl(call: AttentionCall, acc: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse_e) of `call` in ``acc`` (fp32 or fp64), before the output dtype and LSE base."""
    view = call.shard()
    return _heads(view, acc) if view.v is not None else _mla(view, acc)


def reference_f64(call: AttentionCall) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse_e) of `call` computed in float64 from float64 copies of its operands: what tests
    compare kernels with. An fp8 latent is dequantised in float64 (exactly)."""
    d = lambda t: None if t is None or not t.is_floating_point() else t.double()  # noqa: E731
    kv = call.kv if call.kv_scale is None else dequantize(call.kv, call.kv_scale, torch.float64)
    return attention_impl(
        call.replace(
            q_lat=d(call.q_lat),
            q_rope=d(call.q_rope),
            kv=d(kv),
            pe=d(call.pe),
            mask=call.mask if call.mask is not None and call.mask.dtype == torch.bool else d(call.mask),
            v=d(call.v),
            kv_scale=None,
        ),
        torch.float64,
    )


def attention_reference(
    call: AttentionCall, out: Optional[torch.Tensor] = None, lse_out: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain torch attention of `call` in fp32 (fp64 when the query is fp64).

    Returns ``(out [B,S,H,v_dim] in q dtype, lse [B,S,H])`` in the call's LSE base; the LSE
    is fp32, fp64 for an fp64 query. A paged call reads its pages into one dense shard per
    row first.
    """
    base = check_base(call.lse_base)
    acc = accumulation_dtype(call.q_lat)
    o, lse = attention_impl(call, acc)
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
