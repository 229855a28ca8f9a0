"""DCP-aware target verification for speculative decoding (docs/compositions.md, section 4).

The draft model's KV cache is replicated on every DCP rank and its steps use no DCP
metadata; only the target model's MLA KV is striped. Verifying ``k`` draft tokens
is a static-shape attention with ``k`` query tokens per request whose KV (the
prefix plus the ``k`` draft tokens, already written striped) is spread over the
DCP group. Each rank attends over its own shard with:

* a rank-local view built from the cyclic token map: local token ``j`` of a request
  is global position ``j * c + rank``; with page-aligned virtual allocation it sits
  at physical slot ``req_to_token[j * c + rank] // c`` (:func:`rank_local_page_table`);
* the rank-local length ``local_length(kv_len, c, rank)``;
* causality in GLOBAL positions: query ``i`` of row ``b`` is at
  ``kv_len[b] - k + i`` and sees exactly the keys at global positions ``<=`` that.

It takes the attention operands as one :class:`~dcp_pass.runtime.decode.call.AttentionCall`
(global counts, ``stripe=(c, rank)``) and returns the rank-local ``(out, lse)`` for the
usual DCP exchange (or, with ``exchange=...``, the merged result).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from dcp_pass.runtime.decode.backends import attend
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.layout import _check_rank, local_length, owned_positions, whole_page_ids, zero_rows

__all__ = [
    "verify_query_positions",
    "rank_local_page_table",
    "verify_attention",
]


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")


def verify_query_positions(global_kv_len: torch.Tensor, k_tokens: int) -> torch.Tensor:
    """Global positions ``[B, k]`` of the verified tokens: ``kv_len[b] - k + i``.

    ``global_kv_len`` counts the prefix *and* the ``k`` draft tokens.
    """
    kv_len = torch.as_tensor(global_kv_len).long()
    if kv_len.dim() != 1:
        raise ValueError(f"global_kv_len must be [B], got shape {tuple(kv_len.shape)}")
    _check_positive_int("k_tokens", k_tokens)
    if kv_len.device.type == "cpu" and kv_len.numel() and int(kv_len.min()) < k_tokens:
        raise ValueError(f"every global_kv_len must include the {k_tokens} verified tokens, got {kv_len.tolist()}")
    return kv_len.view(-1, 1) - k_tokens + torch.arange(k_tokens, device=kv_len.device).view(1, -1)


def rank_local_page_table(
    req_to_token: Union[torch.Tensor, Sequence[torch.Tensor]],
    global_kv_len: Union[torch.Tensor, Sequence[int]],
    c: int,
    rank: int,
    page_size: int,
) -> torch.Tensor:
    """Rank-local page table ``[B, max_local_pages]`` from the cyclic token map.

    ``req_to_token``: per request, the virtual index of every token (a ``[B, T]``
    tensor or a list of 1-D tensors; at least ``kv_len[b]`` entries each). Local
    token ``j`` of row ``b`` (global position ``j * c + rank``) is at physical slot
    ``req_to_token[b][j * c + rank] // c``; local page ``m`` is the physical page of
    local token ``m * P``. Raises if the slots are not page-contiguous (the map was
    not allocated in whole widened pages). Unused entries are 0.
    """
    _check_rank(c, rank)
    _check_positive_int("page_size", page_size)
    given = torch.as_tensor(global_kv_len)
    if given.dtype.is_floating_point or given.dtype == torch.bool:  # 4.7 would be cut to 4 without a word
        raise ValueError(f"global_kv_len must be ints, got {given.dtype}: {global_kv_len!r}")
    lens = given.to("cpu", torch.long)
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"global_kv_len must be >= 0, got {lens.tolist()}")
    rows = list(req_to_token) if not isinstance(req_to_token, torch.Tensor) else list(req_to_token.unbind(0))
    if len(rows) != lens.numel():
        raise ValueError(f"{len(rows)} token maps for {lens.numel()} kv lengths")
    local = [int(local_length(int(n), c, rank)) for n in lens]
    max_pages = max([-(-n // page_size) for n in local] + [1])
    table = torch.zeros(len(rows), max_pages, dtype=torch.long)
    for b, r2t in enumerate(rows):
        r2t = torch.as_tensor(r2t).long().to("cpu")
        if r2t.numel() < int(lens[b]):
            raise ValueError(f"row {b}: token map has {r2t.numel()} entries, kv_len is {int(lens[b])}")
        # every rank's share is checked on every rank: a map wrong for one rank only raises on
        # all of them, so none goes on to the exchange alone
        for r in range(c):
            pages = _local_pages(r2t, int(lens[b]), c, r, page_size, b)
            if r == rank:
                table[b, : pages.numel()] = pages
    return table


def _local_pages(r2t: torch.Tensor, n: int, c: int, rank: int, page_size: int, b: int) -> torch.Tensor:
    """Rank `rank`'s physical pages of row `b` (token map `r2t`, `n` tokens); ValueError when
    the map cannot give them."""
    pos = owned_positions(0, n, c, rank)
    if pos.numel() and int(r2t[pos].min()) < 0:
        # v // c of a negative v is a negative page: it would index the pool's last pages
        raise ValueError(f"row {b}: the token map holds a negative virtual index {int(r2t[pos].min())}")
    if bool((r2t[pos] % c != rank).any()):
        raise ValueError(f"row {b}: the token map does not give rank {rank} the positions p % {c} == {rank}")
    pages = whole_page_ids(r2t[pos] // c, page_size)
    if pages is None:
        raise ValueError(f"row {b}: rank {rank}'s local slots are not page-contiguous; allocate whole widened pages")
    return pages


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]``; float8 rows through their bytes (indexing is not implemented for float8 on every device)."""
    if x.element_size() == 1 and x.dtype.is_floating_point:
        return x.view(torch.uint8)[idx].view(x.dtype)
    return x[idx]


def _zero_tail(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Zero the rows at or past each sequence's local length of a [B, T, D] view."""
    return zero_rows(x, torch.arange(x.shape[1], device=x.device).view(1, -1) < lens.view(-1, 1))


def verify_attention(
    call: AttentionCall,
    k_tokens: int,
    zero_tail: bool = True,
    exchange=None,
    group=None,
    out_dtype: Optional[torch.dtype] = None,
    *,
    attn_backend: Optional[str] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Rank-local target verification over a striped MLA cache.

    ``call``: an :class:`~dcp_pass.runtime.decode.call.AttentionCall` of the ``k`` verified tokens'
    queries ``q_lat [B, k, H, Dl]`` / ``q_rope [B, k, H, Dr]`` (all heads of the DCP group)
    over this rank's cache, either per-sequence striped (``kv [B, Tl, Dk]``, ``pe [B, Tl, Dr]``
    or None when fused) or paged (``kv [pages, P, Dk]`` + ``page_table [B, max_local_pages]``
    from :func:`rank_local_page_table`), with ``stripe=(c, rank)`` and ``kv_lens`` the global
    count of every row ``[B]``, the prefix and the ``k`` tokens included. The causal cap is
    verification's: query ``i`` of row ``b`` at global position ``kv_len[b] - k + i``.

    ``zero_tail`` zeroes the rows past each row's local length before attending so
    that stale rows (which may hold anything, NaN included) cannot poison the output
    through ``0 * NaN``; rows inside the length but causally masked for a query must
    be finite (they are real KV).

    Returns the rank-local ``(out [B,k,H,v_dim], lse [B,k,H])`` when ``exchange`` is
    None, else merges over ``group`` exactly like :func:`~dcp_pass.runtime.compose.extend.extend_attention_dcp`
    (``"a2a"``/``"ag_rs"``: this rank's head shard; ``"replicated"``: all heads).

    ``attn_backend``: a name of :data:`~dcp_pass.runtime.decode.backends.ATTENTION_BACKENDS`;
    None runs the Triton kernels on CUDA and the torch reference elsewhere.
    """
    c, rank = call.stripe
    _check_positive_int("k_tokens", k_tokens)
    if call.q_pos is not None or call.mask is not None or call.kv_start:
        raise ValueError(
            "verify_attention: the causal cap comes from kv_lens and k_tokens; pass a call without "
            "q_pos, mask or kv_start"
        )
    if not isinstance(call.kv_lens, torch.Tensor):
        raise ValueError("verify_attention: kv_lens must be the global count of every row, a [B] tensor")
    page_table = call.page_table
    if page_table is not None and page_table.device.type == "cpu" and page_table.numel() and int(page_table.min()) < 0:
        # checked on CPU only: on a device it would be a host sync per call
        raise ValueError(f"page_table holds a negative page id {int(page_table.min())}")
    q_lat = call.q_lat
    if q_lat.shape[1] != k_tokens:
        raise ValueError(f"q_lat has {q_lat.shape[1]} query tokens, k_tokens={k_tokens}")
    kv_len = call.kv_lens.long().to(q_lat.device)
    # global counts and positions throughout; the kernels take this rank's share (call.stripe)
    call = call.replace(kv_lens=kv_len, q_pos=verify_query_positions(kv_len, k_tokens))
    if page_table is not None and not zero_tail:
        o, lse = attend(call, attn_backend)
    else:
        kv, pe, ks = call.kv, call.pe, call.kv_scale
        if page_table is not None:
            # gather the rank-local view once, then the same dense path
            idx = page_table.long().to(kv.device)
            kv = _rows(call.kv, idx).flatten(1, 2)
            pe = call.pe[idx].flatten(1, 2) if call.pe is not None else None
            ks = ks[idx].flatten(1, 2) if ks is not None else None
            assert kv.shape[1] == idx.shape[1] * call.kv.shape[1]
        if zero_tail:
            local_lens = local_length(kv_len, c, rank)
            kv = _zero_tail(kv, local_lens)
            pe = _zero_tail(pe, local_lens) if pe is not None else None
            ks = _zero_tail(ks, local_lens) if ks is not None else None
        o, lse = attend(call.replace(kv=kv, pe=pe, kv_scale=ks, page_table=None), attn_backend)
    from dcp_pass.runtime.decode import comm

    return comm.exchange_partials(o, lse, exchange, group, c, call.lse_base, out_dtype)
