"""The torch.library op emitted by the compile pass.

An op (not a plain Python call) because the inner compilers must treat the
shard-local attention as an opaque kernel: it has a fake implementation for
tracing, and its real implementation chooses its attention backend (the Triton
kernel the registry chooses for the call, runtime/decode/backends.py) at run time. (Striped cache
writes need no op: they are one strided slice copy in the graph, see
layout.write_owned_tokens_.)
"""

from __future__ import annotations

from typing import Optional

import torch

from dcp_pass import env
from dcp_pass.runtime.decode import replay, step_count

LIB = "dcp"

# Defined with torch.library.Library rather than the torch.library.custom_op decorator: the
# decorator's Python layers (autograd wrapper, redispatch, alias checks) cost ~30 us of
# host time per call on the H200 machines, more than a replayed launch (replay.py). The
# op has no autograd formula (the pass refuses graphs that need gradients) and no aliasing.
_LIBRARY = torch.library.Library(LIB, "FRAGMENT")
_LIBRARY.define(
    "mla_local_attention(Tensor q_lat, Tensor? q_rope, Tensor kv, Tensor? pe, SymInt kv_len, int c, int rank, "
    "int v_dim, float scale, Tensor? mask, str lse_base, str backend, Tensor? kv_lens=None, SymInt kv_start=0, "
    "str kv_format='', Tensor? q_pos=None) -> (Tensor, Tensor)"
)
_LIBRARY.define(
    "local_attention(Tensor q, Tensor k, Tensor v, SymInt kv_len, int c, int rank, float scale, Tensor? mask, "
    "str lse_base, str backend, SymInt kv_start=0, Tensor? q_pos=None) -> (Tensor, Tensor)"
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
    kv_format: str = "",
    q_pos: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of all query heads over this rank's KV shard only.

    q_lat [B,S,H,Dl], q_rope [B,S,H,Dr] or None (fused cache), kv [B,T,Dk] and pe [B,T,Dr]
    are the rank-local cache shards; values are kv[..., :v_dim]. `kv_len` is the GLOBAL
    key count and `mask` the model's mask over GLOBAL key positions [B,S,H,kv_len] (or
    broadcastable; additive, or boolean with True for a visible key): the op keeps rank
    `rank`'s stripe of both itself.

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
    `kv_len=STEP_COUNT` (-1) with it says `kv_lens` is the step's count buffer, whose value
    the backend holds on the host (runtime/decode/step_count.py; FlashInfer plans from it).

    `kv_start` (global, default 0) is the first visible key position (a sliding window): the
    rank attends its owned positions p (p % c == rank) with kv_start <= p < kv_len, and
    `mask` then covers the window's positions [kv_start, kv_len) (last dim kv_len - kv_start,
    or 1 to broadcast). Device counts take no window (kv_start must be 0).

    `kv_format` (runtime/decode/kv_format.py; "" for a cache in the model's dtype): `kv` holds
    packed fp8 rows of that layout, read as the fp8 latent, its scales and (if the layout
    has them) the rotary columns, which then stand for `pe`; a query that carries both parts
    (q_rope None) is split at the latent width.

    `q_pos` (int, broadcastable to [B, S], global): the causal cap, a key at global position p
    visible to query s only when p <= q_pos[b, s] (SDPA's `is_causal` over keys from 0 is
    q_pos = arange(S)). A cap costs no memory; the same cap as an additive mask would be an
    [S, kv_len] fp32 tensor, 16 GiB for a 64K-token prefill.
    """
    if kv_lens is not None and kv_start != 0:
        raise ValueError(
            f"dcp.mla_local_attention: kv_start={kv_start} with device key counts (kv_lens); a "
            f"window start needs a host kv_len (pass kv_lens=None)"
        )
    # kv_len=STEP_COUNT: kv_lens is the step's key count buffer, whose value the backend holds
    host_lens = step_count.current_count() if kv_lens is not None and kv_len == step_count.STEP_COUNT else None
    if kv_lens is not None and q_pos is None and q_lat.is_cuda:
        # The decode path: one signature per layer shape for the whole run, so after its
        # first call the launches replay without this Python (runtime/decode/replay.py).
        inputs = (q_lat, q_rope, kv, pe, mask, kv_lens)
        # the kernel switches (and the split kernel's tiles file, the fp8 read) are part of the
        # key: a recording is only replayed under the routing it was made with
        key = replay.signature(
            backend,
            c,
            rank,
            v_dim,
            scale,
            lse_base,
            env.mla_wide(),
            env.mla_gluon(),
            env.mla_tuned(),
            env.fp8_read(),
            kv_format,
            host_lens is not None,
            tensors=inputs,
        )
        return replay.run(
            key,
            inputs,
            lambda: _local_attention(
                *inputs[:5], None, kv_lens, c, rank, v_dim, scale, lse_base, backend, 0, kv_format, None, host_lens
            ),
        )
    return _local_attention(
        q_lat,
        q_rope,
        kv,
        pe,
        mask,
        kv_len,
        kv_lens,
        c,
        rank,
        v_dim,
        scale,
        lse_base,
        backend,
        kv_start,
        kv_format,
        q_pos,
        host_lens,
    )[0]


def unpack_fp8_operands(q_lat, q_rope, kv, pe, kv_format: str):
    """(q_lat, q_rope, fp8 latent, pe, scales) of a call on packed fp8 cache rows."""
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, views

    layout = Fp8Layout.parse(kv_format)
    latent, scales, rope = views(kv, layout)
    if rope is not None:
        if pe is not None:
            raise ValueError(f"kv_format {kv_format!r} holds the rotary columns in the packed rows; pe must be None")
        pe = rope
        if q_rope is None:
            q_lat, q_rope = q_lat[..., : layout.latent], q_lat[..., layout.latent :]
    return q_lat, q_rope, latent, pe, scales


def _local_attention(
    q_lat,
    q_rope,
    kv,
    pe,
    mask,
    kv_len,
    kv_lens,
    c,
    rank,
    v_dim,
    scale,
    lse_base,
    backend,
    kv_start=0,
    kv_format="",
    q_pos=None,
    host_lens=None,
):
    """((partial output, lse), whether the kernel that ran may be replayed)."""
    from dcp_pass.runtime.decode.backends import attend_with_kernel
    from dcp_pass.runtime.decode.call import AttentionCall

    kv_scale = None
    if kv_format:
        q_lat, q_rope, kv, pe, kv_scale = unpack_fp8_operands(q_lat, q_rope, kv, pe, kv_format)
    # the graph's global count and mask as they are: the call takes the rank's rows and
    # columns, and with device counts the kernels take its share (no torch op per call)
    call = AttentionCall(
        q_lat,
        q_rope,
        kv,
        pe,
        v_dim,
        scale,
        mask=mask,
        kv_lens=kv_len if kv_lens is None else kv_lens,
        kv_start=kv_start,
        stripe=(c, rank),
        lse_base=lse_base,
        kv_scale=kv_scale,
        host_lens=host_lens,
        q_pos=q_pos,
    )
    # "auto": the Triton kernels on CUDA for 16-bit caches, the torch reference for fp32
    # caches (a checking mode) and off CUDA; a named backend that cannot run here (refused
    # at compile) falls back to the reference, as it always did
    (out, lse), kernel = attend_with_kernel(call, backend, strict=False)
    return (out.contiguous(), lse.contiguous()), kernel.replayable


_LIBRARY.impl("mla_local_attention", mla_local_attention, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{LIB}::mla_local_attention")
def _(
    q_lat,
    q_rope,
    kv,
    pe,
    kv_len,
    c,
    rank,
    v_dim,
    scale,
    mask,
    lse_base,
    backend,
    kv_lens=None,
    kv_start=0,
    kv_format="",
    q_pos=None,
):
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
    q_pos: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of all query heads over this rank's rows of per-head keys and values.

    For grouped-query and multi-head attention, and MLA models that re-expand the latent per
    head. ``q [B,S,H,D]``; ``k [B,T_loc,Hk,D]`` and ``v [B,T_loc,Hk,Dv]`` are rank-local rows
    laid out like the striped shards (local row i = global position i * c + rank; rows past
    the rank's share are not read); ``H % Hk == 0`` and query head h reads kv head
    ``h // (H // Hk)``. ``kv_len``, ``kv_start`` and ``mask`` are global, as in
    :func:`mla_local_attention` (mask: additive fp32 or boolean keep, broadcastable to
    ``[B,S,H,kv_len - kv_start]``; the op keeps its stripe), and ``q_pos`` the causal cap
    as in :func:`mla_local_attention`. Returns ``out [B,S,H,Dv]`` (q's
    dtype) and ``lse [B,S,H]`` (fp32, fp64 for fp64 inputs) in ``lse_base``; a rank with no
    visible key gives 0 and -inf. On CUDA, "auto" and "triton" run the per-head split-KV Triton
    kernel (kernels/per_head_attention.py) for 16-bit caches; "auto" keeps the torch reference
    for fp32 caches (the checking mode) and off CUDA, and "torch" always runs it.
    """
    from dcp_pass.runtime.decode.backends import attend
    from dcp_pass.runtime.decode.call import AttentionCall

    call = AttentionCall(
        q,
        None,
        k,
        None,
        v.shape[-1],
        scale,
        mask=mask,
        kv_lens=kv_len,
        kv_start=kv_start,
        stripe=(c, rank),
        lse_base=lse_base,
        v=v,
        q_pos=q_pos,
    )
    out, lse = attend(call, backend, strict=False)
    return out.contiguous(), lse.contiguous()


_LIBRARY.impl("local_attention", local_attention, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{LIB}::local_attention")
def _(q, k, v, kv_len, c, rank, scale, mask, lse_base, backend, kv_start=0, q_pos=None):
    B, S, H, _ = q.shape
    out = q.new_empty((B, S, H, v.shape[-1]))
    lse = q.new_empty((B, S, H), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse
