"""torch.library custom ops emitted by the compile pass.

Custom ops (not plain Python calls) because the inner compilers must treat the
shard-local attention and the striped write as opaque kernels: they have fake
implementations for tracing, and their real implementations choose the Triton
kernel or the torch reference at run time.
"""
from __future__ import annotations

from typing import Optional

import torch

from dcp_pass.runtime import layout

LIB = "dcp"


@torch.library.custom_op(f"{LIB}::mla_local_attention", mutates_args=())
def mla_local_attention(
    q_lat: torch.Tensor,
    q_rope: Optional[torch.Tensor],
    kv: torch.Tensor,
    pe: Optional[torch.Tensor],
    v_dim: int,
    scale: float,
    mask: Optional[torch.Tensor],
    lse_base: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of all query heads over this rank's KV shard only.

    q_lat [B,S,H,Dl], q_rope [B,S,H,Dr] or None (fused cache), kv [B,T,Dk] and pe [B,T,Dr]
    are the rank-local cache rows, values are kv[..., :v_dim]; mask is additive and already
    striped like the keys. Returns the partial output [B,S,H,v_dim] (q dtype) and its fp32
    log-sum-exp [B,S,H] in `lse_base`; an empty shard gives zeros and -inf.
    """
    from dcp_pass.runtime.kernels import mla_attention as kernels

    fn = kernels.mla_attention_reference
    if backend in ("auto", "triton") and q_lat.is_cuda:
        fn = kernels.mla_attention
    out, lse = fn(q_lat, q_rope, kv, pe, v_dim, scale, mask, None, lse_base, None)
    return out.contiguous(), lse.contiguous()


@mla_local_attention.register_fake
def _(q_lat, q_rope, kv, pe, v_dim, scale, mask, lse_base, backend):
    B, S, H, _ = q_lat.shape
    out = q_lat.new_empty((B, S, H, v_dim))
    lse = q_lat.new_empty((B, S, H), dtype=torch.float32)
    return out, lse


@torch.library.custom_op(f"{LIB}::striped_write", mutates_args=("cache",))
def striped_write(
    cache: torch.Tensor,
    values: torch.Tensor,
    start_pos: int,
    c: int,
    rank: int,
    virtual_capacity: int,
    feat_start: int,
) -> None:
    """Write `values` [b, s, D] at global positions [start_pos, start_pos+s) into columns
    [feat_start, feat_start+D) of this rank's compacted shard `cache` [B, ceil(capacity/c), W],
    keeping only positions p % c == rank."""
    end = start_pos + values.shape[1]
    if start_pos < 0 or end > virtual_capacity or values.shape[0] > cache.shape[0]:
        raise IndexError(
            f"dcp_pass: cache write of positions [{start_pos}, {end}) for batch {values.shape[0]} is past "
            f"the cache capacity ({virtual_capacity} positions, batch {cache.shape[0]}); raise the model's "
            f"max sequence length / batch size"
        )
    columns = cache[..., feat_start : feat_start + values.shape[-1]]
    layout.striped_write_(columns, values.to(cache.dtype), start_pos, c, rank)


@striped_write.register_fake
def _(cache, values, start_pos, c, rank, virtual_capacity, feat_start):
    return None
