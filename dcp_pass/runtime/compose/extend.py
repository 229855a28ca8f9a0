"""Extend (prefill with a cached prefix) on a striped DCP cache.

Extend is outside the decode cost model: its work grows with the prefix length. Two correct ways:

* **gather path** (:func:`extend_attention_gather`): all-gather the cached prefix
  shards of the DCP group, restore token order (:func:`gather_prefix`), append the
  new tokens and run ordinary causal attention; then write the new tokens striped.
  Work and traffic grow with the prefix length; no merge is needed.
* **DCP path** (:func:`extend_attention_dcp`): write the new tokens striped first,
  then every rank attends over its own shard with causality in *global* positions
  (local key ``k`` is global position ``k * c + rank``; query ``i`` of row ``b`` is
  at ``prefix_len[b] + i``) and the partials are merged by the usual DCP exchange.

Both take the attention operands as one :class:`~dcp_pass.runtime.decode.call.AttentionCall`:
the new tokens' queries over this rank's caches, per-sequence striped tensors ``[B, Tl, D]``
(see :class:`~dcp_pass.runtime.decode.layout.EagerStripedCache`; row ``b``'s position ``p`` owned
by this rank sits at local row ``p // c``) with ``stripe=(c, rank)``; a fused cache (latent
+ rope columns) is ``kv`` with ``pe=None``, a split cache passes both. The key counts and
the causal cap are extend's: from ``prefix_lens``, an int or a length-``B`` sequence /
tensor (ragged rows), in global positions.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from dcp_pass.runtime.decode.backends import attend
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.layout import _check_group_size, _check_rank, local_capacity, local_length, striped_write_

__all__ = [
    "gather_prefix",
    "write_new_tokens_",
    "extend_attention_gather",
    "extend_attention_dcp",
    "query_positions",
]

Lens = Union[int, Sequence[int], torch.Tensor]
Group = Union[None, str, dist.ProcessGroup]


def _lens(prefix_lens: Lens, batch: int) -> torch.Tensor:
    if isinstance(prefix_lens, torch.Tensor):
        has_bool = prefix_lens.dtype == torch.bool
        not_int = prefix_lens.dtype.is_floating_point or prefix_lens.dtype.is_complex
    else:
        items = [prefix_lens] if isinstance(prefix_lens, (int, float)) else list(prefix_lens)
        has_bool = any(isinstance(x, bool) for x in items)
        not_int = any(isinstance(x, float) for x in items)
    if has_bool:
        raise ValueError(f"prefix_lens must be ints, got bools: prefix_lens={prefix_lens!r}")
    if not_int:  # a length of 4.7 would be cut to 4 without a word
        raise ValueError(f"prefix_lens must be ints, got floats: prefix_lens={prefix_lens!r}")
    t = torch.as_tensor(prefix_lens, dtype=torch.long).to("cpu")
    if t.dim() == 0:
        t = t.expand(batch).clone()
    if t.shape != (batch,):
        raise ValueError(f"prefix_lens must be an int or have {batch} entries, got shape {tuple(t.shape)}")
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"prefix_lens must be >= 0, got {t.tolist()}")
    return t


def _resolve_group(group: Group) -> Optional[dist.ProcessGroup]:
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

        return _resolve_process_group(GroupName(group))
    return group


def gather_prefix(local_cache: torch.Tensor, prefix_len: Lens, group: Group, c: int) -> torch.Tensor:
    """All-gather the prefix shards of a DCP group and restore token order.

    ``local_cache``: this rank's striped ``[B, Tl, D]`` cache. Returns ``[B, Lmax, D]``
    with ``Lmax = max(prefix_len)``; row ``b`` holds positions ``0 .. prefix_len[b]-1``
    in order and zeros after them. Collective: every rank of ``group`` must call it.
    """
    _check_group_size(c)
    if local_cache.dim() != 3:
        raise ValueError(f"local_cache must be [B, Tl, D], got shape {tuple(local_cache.shape)}")
    B, Tl, Dk = local_cache.shape
    lens = _lens(prefix_len, B)
    lmax = int(lens.max()) if B else 0
    tm = local_capacity(lmax, c)  # rows every rank contributes (rank 0 needs the most)
    if tm > Tl:
        raise ValueError(f"prefix of {lmax} tokens needs {tm} local rows per rank, the cache has {Tl}")
    mine = local_cache[:, :tm].contiguous()
    if c == 1:
        shards = mine.unsqueeze(0)
    else:
        parts = [torch.empty_like(mine) for _ in range(c)]
        dist.all_gather(parts, mine, group=_resolve_group(group))
        shards = torch.stack(parts)  # [c, B, tm, D], slot r from DCP rank r
    # position j * c + r comes from shard r, local row j
    full = shards.permute(1, 2, 0, 3).reshape(B, tm * c, Dk)[:, :lmax]
    valid = torch.arange(lmax).view(1, lmax) < lens.view(B, 1)
    # rows past a prefix hold whatever the local pool had there: never let it through
    return torch.where(valid.to(full.device).unsqueeze(-1), full, torch.zeros((), dtype=full.dtype, device=full.device))


def query_positions(prefix_lens: Lens, batch: int, seq: int, device=None) -> torch.Tensor:
    """Global positions ``[B, S]`` of the new tokens: ``prefix_len[b] + i``."""
    return (_lens(prefix_lens, batch).view(batch, 1) + torch.arange(seq).view(1, seq)).to(device)


def write_new_tokens_(local_cache: torch.Tensor, new: torch.Tensor, prefix_lens: Lens, c: int, rank: int) -> None:
    """Write ``new [B, S, D]`` (row ``b`` at positions ``prefix_len[b] ..``) striped, in place."""
    _check_rank(c, rank)
    B, S = new.shape[:2]
    lens = _lens(prefix_lens, B)
    # rank 0 holds the most rows: checked against its count on every rank, so that all ranks
    # raise together (a rank that went on would wait alone in the next exchange)
    need = int(local_length(lens + S, c, 0).max()) if B else 0
    if need > local_cache.shape[1]:
        raise ValueError(
            f"extending to {int((lens + S).max())} tokens needs {need} local rows on rank 0 of the "
            f"{c} (each rank's cache must hold as many), the cache has {local_cache.shape[1]}"
        )
    for b in range(B):
        striped_write_(local_cache, new[b : b + 1], int(lens[b]), c, rank, batch_start=b)


def _with_new(prefix: torch.Tensor, new: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[B, Lmax, D] prefix + [B, S, D] new -> [B, Lmax + S, D], new at prefix_len[b] + i."""
    B, S, Dk = new.shape
    full = torch.zeros(B, prefix.shape[1] + S, Dk, dtype=new.dtype, device=new.device)
    full[:, : prefix.shape[1]] = prefix.to(new.dtype)
    idx = query_positions(lens, B, S, new.device)
    full.scatter_(1, idx.unsqueeze(-1).expand(B, S, Dk), new)
    return full


def _extend_call(call: AttentionCall, who: str) -> AttentionCall:
    if call.kv_lens is not None or call.q_pos is not None or call.kv_start or call.mask is not None:
        raise ValueError(
            f"{who}: the call's key counts, causal cap and window come from prefix_lens; pass a call "
            f"without kv_lens, q_pos, kv_start or mask"
        )
    if call.paged or call.per_head:
        raise ValueError(f"{who}: the caches must be per-sequence striped MLA tensors [B, Tl, D]")
    return call


def extend_attention_gather(
    call: AttentionCall,
    new_kv,
    new_pe,
    prefix_lens: Lens,
    group: Group,
    write: bool = True,
    *,
    attn_backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gather path: ordinary causal attention over (gathered prefix + new tokens).

    ``call``: an :class:`~dcp_pass.runtime.decode.call.AttentionCall` of the new tokens'
    queries ``q_lat [B, S, H, Dl]`` / ``q_rope`` (any head set: the result is final for those
    heads, no merge) over this rank's striped caches ``kv`` / ``pe`` with ``stripe=(c, rank)``,
    ``v_dim``, ``scale`` and ``lse_base``; the key counts and the causal cap come from
    ``prefix_lens``. Returns ``(out [B, S, H, v_dim], lse [B, S, H])``. With ``write`` the new
    tokens ``new_kv [B, S, Dk]`` / ``new_pe`` are then written striped into the caches.
    Collective over ``group`` when ``c > 1``. ``attn_backend``: a name of
    :data:`~dcp_pass.runtime.decode.backends.ATTENTION_BACKENDS`; None runs the Triton
    kernels on CUDA and the torch reference elsewhere.
    """
    call = _extend_call(call, "extend_attention_gather")
    if call.kv_scale is not None:
        raise ValueError(
            "extend_attention_gather: the gather path restores a 16-bit prefix; an fp8 latent cache "
            "(call.kv_scale) extends through extend_attention_dcp, which writes the new tokens "
            "quantised and attends over the fp8 shards"
        )
    c, rank = call.stripe
    B, S = new_kv.shape[:2]
    lens = _lens(prefix_lens, B)
    kv = _with_new(gather_prefix(call.kv, lens, group, c), new_kv, lens)
    pe = None
    if call.pe is not None:
        pe = _with_new(gather_prefix(call.pe, lens, group, c), new_pe, lens)
    device = call.q_lat.device
    # the gathered prefix is one unstriped sequence: global positions are its rows
    out, lse = attend(
        call.replace(
            kv=kv, pe=pe, kv_lens=(lens + S).to(device), q_pos=query_positions(lens, B, S, device), stripe=(1, 0)
        ),
        attn_backend,
    )
    if write:
        write_new_tokens_(call.kv, new_kv, lens, c, rank)
        if call.pe is not None:
            write_new_tokens_(call.pe, new_pe, lens, c, rank)
    return out, lse


def extend_attention_dcp(
    call: AttentionCall,
    new_kv,
    new_pe,
    prefix_lens: Lens,
    exchange: Optional[str] = None,
    group: Group = None,
    out_dtype: Optional[torch.dtype] = None,
    *,
    attn_backend: Optional[str] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """DCP path: write new tokens striped, shard-local attention with global causality.

    ``call`` as in :func:`extend_attention_gather`, its queries holding all query heads of the
    DCP group. ``exchange=None`` returns the rank-local partial ``(out [B,S,H,v_dim],
    lse [B,S,H])``; ``"a2a"`` / ``"ag_rs"`` merge it with the packed all-to-all /
    reduce-scatter exchange and return this rank's head shard ``[B, S, H/c, v_dim]``;
    ``"replicated"`` returns all heads merged on every rank.
    """
    call = _extend_call(call, "extend_attention_dcp")
    c, rank = call.stripe
    B, S = new_kv.shape[:2]
    lens = _lens(prefix_lens, B)
    if call.kv_scale is not None:  # an fp8 latent: the new tokens quantised, values and scales striped alike
        from dcp_pass.runtime.decode.kv_format import quantize

        new_q, new_scale = quantize(new_kv)
        write_new_tokens_(call.kv, new_q, lens, c, rank)
        write_new_tokens_(call.kv_scale, new_scale, lens, c, rank)
    else:
        write_new_tokens_(call.kv, new_kv, lens, c, rank)
    if call.pe is not None:
        write_new_tokens_(call.pe, new_pe, lens, c, rank)
    device = call.q_lat.device
    # global counts and positions; the kernels take this rank's share (call.stripe)
    o, lse = attend(
        call.replace(kv_lens=(lens + S).to(device), q_pos=query_positions(lens, B, S, device)), attn_backend
    )
    from dcp_pass.runtime.decode import comm

    return comm.exchange_partials(o, lse, exchange, group, c, call.lse_base, out_dtype)
