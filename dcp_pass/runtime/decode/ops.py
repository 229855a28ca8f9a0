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
    "int v_dim, float scale, Tensor? mask, str lse_base, str backend, Tensor? kv_lens=None) -> (Tensor, Tensor)"
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
    """
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
    return _local_attention(q_lat, q_rope, kv, pe, mask, kv_len, kv_lens, c, rank, v_dim, scale, lse_base, backend)[0]


def _local_attention(q_lat, q_rope, kv, pe, mask, kv_len, kv_lens, c, rank, v_dim, scale, lse_base, backend):
    """((partial output, lse), whether the backend that ran may be replayed)."""
    from dcp_pass.runtime.decode.backends import resolve_attention_backend
    from dcp_pass.runtime.decode.layout import local_length

    # "auto": Triton on CUDA for 16-bit caches, the torch reference for fp32 caches (a
    # checking mode) and off CUDA; a named backend that cannot run here (refused at
    # compile) falls back to the reference, as it always did
    entry = resolve_attention_backend(backend, q_lat.device, kv.dtype, strict=False)
    fn = entry.run
    if kv_lens is None:
        n_local = local_length(kv_len, c, rank)
        kv = kv[:, :n_local]
        pe = pe[:, :n_local] if pe is not None else None
    if mask is not None and mask.shape[-1] != 1:
        mask = mask[..., rank::c]
    # with device counts the shards are whole and the kernels take this rank's share of
    # the global counts themselves (lens_stripe): no torch ops on the counts per call
    out, lse = fn(q_lat, q_rope, kv, pe, v_dim, scale, mask, kv_lens, lse_base, None, lens_stripe=(c, rank))
    return (out.contiguous(), lse.contiguous()), entry.replayable


_LIBRARY.impl("mla_local_attention", mla_local_attention, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{LIB}::mla_local_attention")
def _(q_lat, q_rope, kv, pe, kv_len, c, rank, v_dim, scale, mask, lse_base, backend, kv_lens=None):
    B, S, H, _ = q_lat.shape
    out = q_lat.new_empty((B, S, H, v_dim))
    lse = q_lat.new_empty((B, S, H), dtype=torch.float64 if q_lat.dtype == torch.float64 else torch.float32)
    return out, lse
