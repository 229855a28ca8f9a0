"""torch.library custom ops emitted by the compile pass.

A custom op (not a plain Python call) because the inner compilers must treat the
shard-local attention as an opaque kernel: it has a fake implementation for
tracing, and its real implementation chooses its attention backend (the Triton
kernel or the torch reference, runtime/decode/backends.py) at run time. (Striped cache
writes need no op: they are one strided slice copy in the graph, see
rewrites/cache.py.)
"""
from __future__ import annotations

from typing import Optional

import torch


LIB = "dcp"


@torch.library.custom_op(f"{LIB}::mla_local_attention", mutates_args=())
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
    from dcp_pass.runtime.decode.backends import resolve_attention_backend
    from dcp_pass.runtime.decode.layout import local_length

    # "auto": Triton on CUDA for 16-bit caches, the torch reference for fp32 caches (a
    # checking mode) and off CUDA; a named backend that cannot run here (refused at
    # compile) falls back to the reference, as it always did
    fn = resolve_attention_backend(backend, q_lat.device, kv.dtype, strict=False).run
    local_lens = None
    if kv_lens is not None:
        local_lens = local_length(kv_lens, c, rank).expand(q_lat.shape[0]).contiguous()
    else:
        n_local = local_length(kv_len, c, rank)
        kv = kv[:, :n_local]
        pe = pe[:, :n_local] if pe is not None else None
    if mask is not None and mask.shape[-1] != 1:
        mask = mask[..., rank::c]
    out, lse = fn(q_lat, q_rope, kv, pe, v_dim, scale, mask, local_lens, lse_base, None)
    return out.contiguous(), lse.contiguous()


@mla_local_attention.register_fake
def _(q_lat, q_rope, kv, pe, kv_len, c, rank, v_dim, scale, mask, lse_base, backend, kv_lens=None):
    B, S, H, _ = q_lat.shape
    out = q_lat.new_empty((B, S, H, v_dim))
    lse = q_lat.new_empty((B, S, H), dtype=torch.float64 if q_lat.dtype == torch.float64 else torch.float32)
    return out, lse
