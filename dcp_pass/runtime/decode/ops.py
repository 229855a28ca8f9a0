"""The torch.library op emitted by the compile pass.

An op (not a plain Python call) because the inner compilers must treat the
shard-local attention as an opaque kernel: it has a fake implementation for
tracing, and its real implementation chooses its attention backend (the Triton
kernel or the torch reference, runtime/decode/backends.py) at run time. (Striped cache
writes need no op: they are one strided slice copy in the graph, see
rewrites/cache.py.)
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from dcp_pass.runtime.decode import replay


LIB = "dcp"

# Defined with torch.library.Library rather than the torch.library.custom_op decorator: the
# decorator's Python layers (autograd wrapper, redispatch, alias checks) cost ~30 us of
# host time per call on the H200 machines, more than a replayed launch (replay.py). The
# op has no autograd formula (the pass refuses graphs that need gradients) and no aliasing.
_LIBRARY = torch.library.Library(LIB, "FRAGMENT")
_LIBRARY.define(
    "mla_local_attention(Tensor q_lat, Tensor? q_rope, Tensor kv, Tensor? pe, SymInt kv_len, int c, int rank, "
    "int v_dim, float scale, Tensor? mask, str lse_base, str backend, Tensor? kv_lens=None, SymInt kv_start=0) "
    "-> (Tensor, Tensor)"
)
_LIBRARY.define(
    "local_attention(Tensor q, Tensor k, Tensor v, SymInt kv_len, int c, int rank, float scale, Tensor? mask, "
    "str lse_base, str backend, SymInt kv_start=0) -> (Tensor, Tensor)"
)


def mla_local_attention(
    q_lat: torch.Tensor,
    q_rope: Optional[torch.Tensor],
    kv: torch.Tensor,
    pe: Optional[torch.Tensor],
    kv_len: int,
    c: int,
    rank: int,
    v_dim: int,
    scale: float,
    mask: Optional[torch.Tensor],
    lse_base: str,
    backend: str,
    kv_lens: Optional[torch.Tensor] = None,
    kv_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of all query heads over this rank's KV shard only.

    q_lat [B,S,H,Dl], q_rope [B,S,H,Dr] or None (fused cache), kv [B,T,Dk] and pe [B,T,Dr]
    are the rank-local cache shards; values are kv[..., :v_dim]. `kv_len` is the GLOBAL
    key count and `mask` the model's additive mask over GLOBAL key positions
    [B,S,H,kv_len] (or broadcastable): the op keeps rank `rank`'s stripe of both itself.

    Why global: every shape and symbolic expression the graph holds must be the same on
    every rank. A rank-local count or a striped mask has a rank-dependent size, and a
    guard on it (a size-1 check, say) would make one rank recompile where another does
    not; compile-time collectives would then pair with the wrong peer. And an int, not
    a sliced view: a symbolic tensor size would specialise (size 1 vs more) as the
    context grows. Returns the partial output [B,S,H,v_dim] (q dtype) and its fp32
    log-sum-exp [B,S,H] in `lse_base`; an empty shard gives zeros and -inf.

    `kv_lens` (int64 [1] or [B], on the device) replaces `kv_len` when the global key
    count is device data (static-shape decode, see rewrites/positions.py): the shards
    are passed whole and the kernel's work follows the counts, with no host sync.

    `kv_start` (global, default 0) is the first visible key position (a sliding window): the
    rank attends its owned positions p (p % c == rank) with kv_start <= p < kv_len, and
    `mask` then covers the window's positions [kv_start, kv_len) (last dim kv_len - kv_start,
    or 1 to broadcast). Device counts take no window (kv_start must be 0).
    """
    if kv_lens is not None and kv_start != 0:
        raise ValueError(f"dcp.mla_local_attention: kv_start={kv_start} with device key counts (kv_lens); a "
                         f"window start needs a host kv_len (pass kv_lens=None)")
    if kv_lens is not None and q_lat.is_cuda:
        # The decode path: one signature per layer shape for the whole run, so after its
        # first call the launches replay without this Python (runtime/decode/replay.py).
        inputs = (q_lat, q_rope, kv, pe, mask, kv_lens)
        # the kernel switches are part of the key: a recording is only replayed under the
        # routing it was made with
        key = replay.signature(backend, c, rank, v_dim, scale, lse_base, os.environ.get("DCP_MLA_WIDE"),
                               os.environ.get("DCP_MLA_GLUON"), tensors=inputs)
        return replay.run(key, inputs, lambda: _local_attention(*inputs[:5], None, kv_lens, c, rank, v_dim, scale,
                                                                lse_base, backend))
    return _local_attention(q_lat, q_rope, kv, pe, mask, kv_len, kv_lens, c, rank, v_dim, scale, lse_base, backend,
                            kv_start)[0]


def _local_attention(q_lat, q_rope, kv, pe, mask, kv_len, kv_lens, c, rank, v_dim, scale, lse_base, backend,
                     kv_start=0):
    """((partial output, lse), whether the kernel that ran may be replayed)."""
    from dcp_pass.runtime.decode.backends import attend_with_kernel
    from dcp_pass.runtime.decode.call import AttentionCall

    if kv_lens is None:
        rows = window_rows(kv_len, kv_start, c, rank, kv.shape[1], "kv")
        kv = kv[:, rows]
        pe = pe[:, rows] if pe is not None else None
        mask = window_mask(mask, kv_len, kv_start, c, rank)
    elif mask is not None and mask.shape[-1] != 1:
        mask = mask[..., rank::c]
    # with device counts the shards are whole and the kernels take this rank's share of
    # the global counts themselves (lens_stripe): no torch ops on the counts per call
    call = AttentionCall(q_lat, q_rope, kv, pe, v_dim, scale, mask, kv_lens, lse_base, lens_stripe=(c, rank))
    # "auto": the Triton kernels on CUDA for 16-bit caches, the torch reference for fp32
    # caches (a checking mode) and off CUDA; a named backend that cannot run here (refused
    # at compile) falls back to the reference, as it always did
    (out, lse), kernel = attend_with_kernel(call, backend, strict=False)
    return (out.contiguous(), lse.contiguous()), kernel.replayable


_LIBRARY.impl("mla_local_attention", mla_local_attention, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{LIB}::mla_local_attention")
def _(q_lat, q_rope, kv, pe, kv_len, c, rank, v_dim, scale, mask, lse_base, backend, kv_lens=None, kv_start=0):
    B, S, H, _ = q_lat.shape
    out = q_lat.new_empty((B, S, H, v_dim))
    lse = q_lat.new_empty((B, S, H), dtype=torch.float64 if q_lat.dtype == torch.float64 else torch.float32)
    return out, lse


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: int,
    c: int,
    rank: int,
    scale: float,
    mask: Optional[torch.Tensor],
    lse_base: str,
    backend: str,
    kv_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of all query heads over this rank's rows of per-head keys and values.

    For grouped-query and multi-head attention, and MLA models that re-expand the latent per
    head. ``q [B,S,H,D]``; ``k [B,T_loc,Hk,D]`` and ``v [B,T_loc,Hk,Dv]`` are rank-local rows
    laid out like the striped shards (local row i = global position i * c + rank; rows past
    the rank's share are not read); ``H % Hk == 0`` and query head h reads kv head
    ``h // (H // Hk)``. ``kv_len``, ``kv_start`` and ``mask`` are global, as in
    :func:`mla_local_attention` (mask: additive fp32, broadcastable to
    ``[B,S,H,kv_len - kv_start]``; the op keeps its stripe). Returns ``out [B,S,H,Dv]`` (q's
    dtype) and ``lse [B,S,H]`` (fp32, fp64 for fp64 inputs) in ``lse_base``; a rank with no
    visible key gives 0 and -inf. Every backend name runs the torch reference here (no
    kernel takes per-head caches yet).
    """
    from dcp_pass.runtime.decode.kernels.reference import heads_attention_reference

    rows = window_rows(kv_len, kv_start, c, rank, k.shape[1], "k")
    if v.shape[1] < rows.stop:
        raise ValueError(f"dcp.local_attention: v has {v.shape[1]} local rows, rank {rank} of {c} needs "
                         f"{rows.stop} for kv_len={kv_len}")
    mask = window_mask(mask, kv_len, kv_start, c, rank)
    out, lse = heads_attention_reference(q, k[:, rows], v[:, rows], scale, mask, lse_base)
    return out.contiguous(), lse.contiguous()


_LIBRARY.impl("local_attention", local_attention, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{LIB}::local_attention")
def _(q, k, v, kv_len, c, rank, scale, mask, lse_base, backend, kv_start=0):
    B, S, H, _ = q.shape
    out = q.new_empty((B, S, H, v.shape[-1]))
    lse = q.new_empty((B, S, H), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse


def window_rows(kv_len: int, kv_start: int, c: int, rank: int, shard_rows: int, what: str) -> slice:
    """The local rows of rank `rank`'s owned positions in [kv_start, kv_len): the positions of
    rank r below n are local rows [0, local_length(n, c, r)), so the window is the difference."""
    from dcp_pass.runtime.decode.layout import local_length

    if not 0 <= kv_start <= kv_len:
        raise ValueError(f"the window must satisfy 0 <= kv_start <= kv_len, got kv_start={kv_start}, kv_len={kv_len}")
    first, end = local_length(kv_start, c, rank), local_length(kv_len, c, rank)
    if shard_rows < end:
        raise ValueError(f"{what} has {shard_rows} local rows, rank {rank} of {c} owns {end} positions below "
                         f"kv_len={kv_len}")
    return slice(first, end)


def window_mask(mask: Optional[torch.Tensor], kv_len: int, kv_start: int, c: int, rank: int):
    """Rank `rank`'s columns of a mask over the window's global positions [kv_start, kv_len):
    column j is position kv_start + j, so the rank's first owned position is column
    (rank - kv_start) mod c and every c-th after it."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    if mask.shape[-1] != kv_len - kv_start:
        raise ValueError(f"the mask's last dim is {mask.shape[-1]}; it must cover the visible global key positions "
                         f"[kv_start, kv_len) = [{kv_start}, {kv_len}) ({kv_len - kv_start}), or be 1 to broadcast")
    return mask[..., (rank - kv_start) % c::c]
