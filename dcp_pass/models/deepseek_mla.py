"""A small DeepSeek-V3-style transformer with absorbed MLA attention, in plain PyTorch.

This is the kind of model the DCP compile pass is meant to be run on: it knows nothing
about decode context parallelism. It follows the design of the public DeepSeek-V3
reference inference code:

* tensor parallelism over `tp_size` ranks: vocab-parallel embedding, column/row
  parallel linears (row-parallel all-reduces its output), vocab-parallel head whose
  logits are all-gathered, routed experts split over ranks;
* MLA in its *absorbed* form: one latent row (`kv_lora_rank` dims, RMS-normed) plus one
  rotary row (`qk_rope_head_dim` dims) is cached per token and shared by all heads; the
  key half of `wkv_b` is folded into the query and the value half is applied after
  attention;
* complex-number rotary embeddings (`torch.polar` / `view_as_complex`);
* a dense MLP for the first `n_dense_layers`, then MoE blocks whose expert loop depends
  on data (`bincount(...).tolist()`), which splits a compiled model into several graphs.

Several `ModelArgs` knobs change only *how* the attention is written (einsum or
matmul/bmm, separate or fused cache, softmax spelling, where the scale is applied,
additive or boolean mask). Every variant computes the same function with the same
weights; they exist so the graph matcher can be tested against several spellings.

`build_model(args, rank, seed)` creates deterministic weights that do not depend on
the TP degree: the full tensors are drawn in a fixed order and each rank keeps its shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelArgs",
    "Linear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelEmbedding",
    "RMSNorm",
    "MLA",
    "MLP",
    "Expert",
    "Gate",
    "MoE",
    "Block",
    "Transformer",
    "precompute_freqs_cis",
    "apply_rotary_emb",
    "resolve_tp",
    "build_model",
    "init_weights_",
]


@dataclass
class ModelArgs:
    max_batch_size: int = 4
    max_seq_len: int = 96
    vocab_size: int = 128
    dim: int = 64
    inter_dim: int = 128
    moe_inter_dim: int = 32
    n_layers: int = 3
    n_dense_layers: int = 1
    n_heads: int = 4
    n_routed_experts: int = 4
    n_activated_experts: int = 2
    n_shared_experts: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float32
    # None: the torch.distributed world size when initialized, else 1.
    # 1: unsharded, every rank holds all heads and all weights (no collectives).
    tp_size: Optional[int] = None
    # Optional process group for TP collectives (None: the default group).
    tp_group: Any = field(default=None, repr=False, compare=False)
    # ---- spelling variants of the attention (same function, different graphs) ----
    score_impl: Literal["einsum", "matmul"] = "einsum"
    fused_cache: bool = False
    softmax_style: Literal["method", "functional"] = "method"
    scale_order: Literal["after_mask", "before_mask"] = "after_mask"
    mask_style: Literal["additive", "masked_fill"] = "additive"
    # "tensor": positions travel as a device tensor, caches are written by index and read
    # whole under a mask, so every decode step has the same shapes (CUDA-graph decode).
    positions: Literal["int", "tensor"] = "int"

    def __post_init__(self) -> None:
        if self.positions not in ("int", "tensor"):
            raise ValueError(f"positions must be 'int' or 'tensor', got {self.positions!r}")
        if self.score_impl not in ("einsum", "matmul"):
            raise ValueError(f"score_impl must be 'einsum' or 'matmul', got {self.score_impl!r}")
        if self.softmax_style not in ("method", "functional"):
            raise ValueError(f"softmax_style must be 'method' or 'functional', got {self.softmax_style!r}")
        if self.scale_order not in ("after_mask", "before_mask"):
            raise ValueError(f"scale_order must be 'after_mask' or 'before_mask', got {self.scale_order!r}")
        if self.mask_style not in ("additive", "masked_fill"):
            raise ValueError(f"mask_style must be 'additive' or 'masked_fill', got {self.mask_style!r}")


def resolve_tp(args: ModelArgs, rank: Optional[int] = None) -> tuple[int, int]:
    """Return (tp_size, tp_rank) for a model built from `args`.

    `rank` (if given) is the TP rank whose shard to hold; otherwise it is read from
    torch.distributed (0 when not initialized or when tp_size == 1).
    """
    initialized = dist.is_available() and dist.is_initialized()
    group = args.tp_group
    tp = args.tp_size
    if tp is None:
        tp = dist.get_world_size(group) if initialized else 1
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    if tp == 1:
        return 1, 0
    if initialized:
        group_size = dist.get_world_size(group)
        if group_size != tp:
            raise ValueError(
                f"tp_size={tp} but the TP process group has {group_size} ranks; "
                "pass tp_group=<a group of tp_size ranks> or tp_size=1"
            )
        dist_rank = dist.get_rank(group)
        if rank is None:
            rank = dist_rank
        elif rank != dist_rank:
            raise ValueError(f"rank={rank} does not match this process's TP rank {dist_rank}")
    elif rank is None:
        rank = 0
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} out of range for tp_size={tp}")
    return tp, rank


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tp_size={d}")
    return n // d


# --------------------------------------------------------------------------- layers


class Linear(nn.Module):
    """y = x @ W^T without bias; weight stored as [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(Linear):
    """Output features split over TP ranks (weight rows); no communication."""

    shard_dim = 0

    def __init__(self, in_features: int, out_features: int, tp_size: int, dtype: torch.dtype, group: Any = None):
        super().__init__(in_features, _divide(out_features, tp_size, "out_features"), dtype)
        self.tp_size = tp_size


class RowParallelLinear(Linear):
    """Input features split over TP ranks (weight columns); partial outputs are summed."""

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, tp_size: int, dtype: torch.dtype, group: Any = None):
        super().__init__(_divide(in_features, tp_size, "in_features"), out_features, dtype)
        self.tp_size = tp_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y


class ParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows over TP ranks; lookups are summed."""

    shard_dim = 0

    def __init__(self, vocab_size: int, dim: int, tp_size: int, tp_rank: int, dtype: torch.dtype, group: Any = None):
        super().__init__()
        self.tp_size = tp_size
        self.group = group
        self.part_vocab = _divide(vocab_size, tp_size, "vocab_size")
        self.vocab_start = tp_rank * self.part_vocab
        self.vocab_end = self.vocab_start + self.part_vocab
        self.weight = nn.Parameter(torch.empty(self.part_vocab, dim, dtype=dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = torch.where(outside, torch.zeros_like(tokens), tokens - self.vocab_start)
        y = F.embedding(local, self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(y, group=self.group)
        return y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


def precompute_freqs_cis(rope_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Complex rotations e^{i * pos * theta^(-2j/d)}, shape [max_seq_len, rope_dim // 2]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, h, d] by freqs_cis [s, d // 2] treating pairs of dims as complex."""
    dtype = x.dtype
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rot = freqs_cis.view(1, xc.size(1), 1, xc.size(-1))
    return torch.view_as_real(xc * rot).flatten(3).to(dtype)


# --------------------------------------------------------------------------- attention


class MLA(nn.Module):
    """Multi-head latent attention, absorbed form, with a latent + rotary KV cache.

    Caches (registered, non-persistent buffers, dtype args.dtype):
      separate (default): kv_cache [max_batch, max_seq, kv_lora_rank] (RMS-normed latent)
                          pe_cache [max_batch, max_seq, qk_rope_head_dim] (rotated k_pe)
      fused_cache=True:   kv_cache [max_batch, max_seq, kv_lora_rank + qk_rope_head_dim]
    """

    def __init__(self, args: ModelArgs, tp_size: int = 1, group: Any = None):
        super().__init__()
        self.dim = args.dim
        self.n_heads = args.n_heads
        self.n_local_heads = _divide(args.n_heads, tp_size, "n_heads")
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.score_impl = args.score_impl
        self.fused_cache = args.fused_cache
        self.softmax_style = args.softmax_style
        self.scale_order = args.scale_order
        self.mask_style = args.mask_style
        dt = args.dtype

        if self.q_lora_rank == 0:
            self.wq = ColumnParallelLinear(self.dim, self.n_heads * self.qk_head_dim, tp_size, dt, group)
        else:
            self.wq_a = Linear(self.dim, self.q_lora_rank, dt)
            self.q_norm = RMSNorm(self.q_lora_rank, dtype=dt)
            self.wq_b = ColumnParallelLinear(self.q_lora_rank, self.n_heads * self.qk_head_dim, tp_size, dt, group)
        self.wkv_a = Linear(self.dim, self.kv_lora_rank + self.qk_rope_head_dim, dt)
        self.kv_norm = RMSNorm(self.kv_lora_rank, dtype=dt)
        self.wkv_b = ColumnParallelLinear(
            self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), tp_size, dt, group
        )
        self.wo = RowParallelLinear(self.n_heads * self.v_head_dim, self.dim, tp_size, dt, group)

        rows = (args.max_batch_size, args.max_seq_len)
        if self.fused_cache:
            self.register_buffer(
                "kv_cache", torch.zeros(*rows, self.kv_lora_rank + self.qk_rope_head_dim, dtype=dt), persistent=False
            )
        else:
            self.register_buffer("kv_cache", torch.zeros(*rows, self.kv_lora_rank, dtype=dt), persistent=False)
            self.register_buffer("pe_cache", torch.zeros(*rows, self.qk_rope_head_dim, dtype=dt), persistent=False)

    def forward(
        self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        if isinstance(start_pos, torch.Tensor):  # positions [s] of a static-shape model
            written = start_pos
            end_pos = self.kv_cache.size(1)
        else:
            end_pos = start_pos + seqlen
            written = slice(start_pos, end_pos)
        nope, rope, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        heads = self.n_local_heads

        # queries: [b, s, h, nope + rope]
        if self.q_lora_rank == 0:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)

        # this token's latent row and rotary key
        kv = self.wkv_a(x)
        latent, k_pe = torch.split(kv, [rank, rope], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)

        # kv up-projection per head: [h, nope + v, rank]; key half absorbed into q
        wkv_b = self.wkv_b.weight.view(heads, -1, rank)
        if self.score_impl == "einsum":
            q_lat = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :nope])
        else:
            q_lat = torch.bmm(q_nope.flatten(0, 1).transpose(0, 1), wkv_b[:, :nope])  # [h, b*s, rank]
            q_lat = q_lat.transpose(0, 1).reshape(bsz, seqlen, heads, rank)

        # cache writes (slice assignment into the buffers)
        if self.fused_cache:
            self.kv_cache[:bsz, written] = torch.cat([self.kv_norm(latent), k_pe.squeeze(2)], dim=-1)
        else:
            self.kv_cache[:bsz, written] = self.kv_norm(latent)
            self.pe_cache[:bsz, written] = k_pe.squeeze(2)

        # unscaled scores [b, s, h, t]
        if self.fused_cache:
            cache = self.kv_cache[:bsz, :end_pos]
            q_full = torch.cat([q_lat, q_pe], dim=-1)
            if self.score_impl == "einsum":
                raw = torch.einsum("bshc,btc->bsht", q_full, cache)
            else:
                raw = torch.matmul(q_full.flatten(1, 2), cache.transpose(1, 2)).view(bsz, seqlen, heads, end_pos)
        elif self.score_impl == "einsum":
            raw = torch.einsum("bshc,btc->bsht", q_lat, self.kv_cache[:bsz, :end_pos]) + torch.einsum(
                "bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end_pos]
            )
        else:
            raw = torch.matmul(q_lat.flatten(1, 2), self.kv_cache[:bsz, :end_pos].transpose(1, 2)) + torch.matmul(
                q_pe.flatten(1, 2), self.pe_cache[:bsz, :end_pos].transpose(1, 2)
            )
            raw = raw.view(bsz, seqlen, heads, end_pos)

        # scale and causal mask
        if self.scale_order == "after_mask":
            scores = raw * self.softmax_scale
            if mask is not None:
                if self.mask_style == "additive":
                    scores += mask.unsqueeze(1)
                else:
                    scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
        else:
            scores = raw
            if mask is not None:
                if self.mask_style == "additive":
                    scores = scores + mask.unsqueeze(1)
                else:
                    scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
            scores = scores * self.softmax_scale

        if self.softmax_style == "method":
            probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        else:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).type_as(x)

        # attention over latent rows, then the value half of wkv_b
        if self.fused_cache:
            values = cache[..., :rank]
        else:
            values = self.kv_cache[:bsz, :end_pos]
        if self.score_impl == "einsum":
            o = torch.einsum("bsht,btc->bshc", probs, values)
            o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, -self.v_head_dim :])
            o = o.flatten(2)
        else:
            o = torch.matmul(probs.flatten(1, 2), values).view(bsz, seqlen, heads, rank)
            o = torch.bmm(o.flatten(0, 1).transpose(0, 1), wkv_b[:, -self.v_head_dim :].transpose(1, 2))  # [h, b*s, v]
            o = o.transpose(0, 1).reshape(bsz, seqlen, heads * self.v_head_dim)
        return self.wo(o)


# --------------------------------------------------------------------------- feed-forward


class MLP(nn.Module):
    """SwiGLU MLP, column-parallel up projections and row-parallel down projection."""

    def __init__(self, dim: int, inter_dim: int, tp_size: int, dtype: torch.dtype, group: Any = None):
        super().__init__()
        self.w1 = ColumnParallelLinear(dim, inter_dim, tp_size, dtype, group)
        self.w2 = RowParallelLinear(inter_dim, dim, tp_size, dtype, group)
        self.w3 = ColumnParallelLinear(dim, inter_dim, tp_size, dtype, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Expert(nn.Module):
    """One routed expert: a SwiGLU MLP held whole by the rank that owns it."""

    def __init__(self, dim: int, inter_dim: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype)
        self.w2 = Linear(inter_dim, dim, dtype)
        self.w3 = Linear(dim, inter_dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gate(nn.Module):
    """Softmax router: returns (weights [n, k], expert indices [n, k])."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.topk = args.n_activated_experts
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim, dtype=args.dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        return weights.type_as(x), indices


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, tp_size: int, tp_rank: int, group: Any = None):
        super().__init__()
        self.dim = args.dim
        self.tp_size = tp_size
        self.group = group
        self.n_routed_experts = args.n_routed_experts
        n_local = _divide(args.n_routed_experts, tp_size, "n_routed_experts")
        self.experts_start = tp_rank * n_local
        self.experts_end = self.experts_start + n_local
        self.gate = Gate(args)
        self.experts = nn.ModuleList(
            [
                Expert(args.dim, args.moe_inter_dim, args.dtype) if self.experts_start <= i < self.experts_end else None
                for i in range(args.n_routed_experts)
            ]
        )
        self.shared_experts = MLP(args.dim, args.n_shared_experts * args.moe_inter_dim, tp_size, args.dtype, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.experts_start, self.experts_end):
            if counts[i] == 0:
                continue
            rows, slot = torch.where(indices == i)
            y[rows] += self.experts[i](x[rows]) * weights[rows, slot, None]
        z = self.shared_experts(x)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return (y + z).view(shape)


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs, tp_size: int, tp_rank: int, attn: Optional[nn.Module] = None):
        super().__init__()
        group = args.tp_group
        self.attn = attn if attn is not None else MLA(args, tp_size, group)
        if layer_id < args.n_dense_layers:
            self.ffn = MLP(args.dim, args.inter_dim, tp_size, args.dtype, group)
        else:
            self.ffn = MoE(args, tp_size, tp_rank, group)
        self.attn_norm = RMSNorm(args.dim, dtype=args.dtype)
        self.ffn_norm = RMSNorm(args.dim, dtype=args.dtype)

    def forward(
        self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), start_pos, freqs_cis, mask)
        x = x + self.ffn(self.ffn_norm(x))
        return x


class Transformer(nn.Module):
    """tokens [b, s] (int64), start_pos -> logits of the last position [b, vocab].

    `forward_all` (or `forward(..., all_logits=True)`) returns logits for every position
    [b, s, vocab]. Caches are written at positions [start_pos, start_pos + s).
    """

    def __init__(self, args: ModelArgs, rank: Optional[int] = None):
        super().__init__()
        tp_size, tp_rank = resolve_tp(args, rank)
        self.args = args
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.group = args.tp_group
        self.max_seq_len = args.max_seq_len
        self.mask_style = args.mask_style
        self.embed = ParallelEmbedding(args.vocab_size, args.dim, tp_size, tp_rank, args.dtype, self.group)
        self.layers = nn.ModuleList([self._make_block(i, args, tp_size, tp_rank) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, dtype=args.dtype)
        self.head = ColumnParallelLinear(args.dim, args.vocab_size, tp_size, args.dtype, self.group)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta),
            persistent=False,
        )

    def _make_block(self, layer_id: int, args: ModelArgs, tp_size: int, tp_rank: int) -> nn.Module:
        return Block(layer_id, args, tp_size, tp_rank)

    def _causal_mask(self, seqlen: int, start_pos: int, device: torch.device) -> Optional[torch.Tensor]:
        # query i sits at global position start_pos + i and may see keys <= start_pos + i
        if seqlen <= 1:
            return None
        if self.mask_style == "additive":
            return torch.full((seqlen, start_pos + seqlen), float("-inf"), device=device).triu_(start_pos + 1)
        return torch.ones((seqlen, start_pos + seqlen), dtype=torch.bool, device=device).triu_(start_pos + 1)

    def _static_mask(self, positions: torch.Tensor) -> torch.Tensor:
        # every cache position is read; the ones after each query (unwritten or stale) are hidden
        keys = torch.arange(self.max_seq_len, device=positions.device)
        future = keys[None, :] > positions[:, None]
        if self.mask_style == "additive":
            return torch.zeros(future.shape, device=positions.device).masked_fill(future, float("-inf"))
        return future

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_logits: bool = False) -> torch.Tensor:
        seqlen = tokens.size(1)
        h = self.embed(tokens)
        if self.args.positions == "tensor":
            positions = torch.as_tensor(start_pos, device=tokens.device) + torch.arange(seqlen, device=tokens.device)
            freqs_cis = self.freqs_cis[positions]
            mask = self._static_mask(positions)
            start_pos = positions  # layers write the caches at these positions
        else:
            freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
            mask = self._causal_mask(seqlen, start_pos, tokens.device)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        if not all_logits:
            h = h[:, -1]
        logits = self.head(h)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits, group=self.group)
            logits = torch.cat(parts, dim=-1)
        return logits

    def forward_all(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        return self.forward(tokens, start_pos, all_logits=True)


# --------------------------------------------------------------------------- weights


def _shard_dim(module: nn.Module) -> Optional[int]:
    return getattr(module, "shard_dim", None) if getattr(module, "tp_size", 1) > 1 else None


def init_weights_(model: nn.Module, reference: nn.Module, tp_rank: int, seed: int) -> None:
    """Fill `model` (a TP shard) from full weights drawn in the order of `reference` (tp=1).

    Every full tensor is drawn from one CPU torch.Generator(seed) in float32, in the
    parameter order of the unsharded reference, so all TP degrees see the same numbers.
    Norm weights are 1 + 0.1 * N(0, 1), embeddings N(0, 1), every matrix
    N(0, 1) / sqrt(fan_in) (so activations and logits stay O(1)).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    local_params = dict(model.named_parameters())
    for name, ref_param in reference.named_parameters():
        owner_name = name.rsplit(".", 1)[0]
        ref_owner = reference.get_submodule(owner_name)
        shape = tuple(ref_param.shape)
        full = torch.randn(shape, generator=gen, dtype=torch.float32)
        if isinstance(ref_owner, RMSNorm):
            full = 1.0 + 0.1 * full
        elif isinstance(ref_owner, ParallelEmbedding) or full.dim() < 2:
            pass
        else:
            full = full / math.sqrt(shape[-1])
        if name not in local_params:  # e.g. a routed expert owned by another rank
            continue
        local = local_params[name]
        dim = _shard_dim(model.get_submodule(owner_name))
        if dim is not None:
            size = local.shape[dim]
            full = full.narrow(dim, tp_rank * size, size)
        if tuple(full.shape) != tuple(local.shape):
            raise RuntimeError(f"shape mismatch for {name}: shard {tuple(full.shape)} vs param {tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(full.to(local.dtype))
    missing = set(local_params) - {n for n, _ in reference.named_parameters()}
    if missing:
        raise RuntimeError(f"parameters without a full counterpart: {sorted(missing)}")


def _build(model_cls, args: ModelArgs, rank: Optional[int], seed: int, device=None) -> nn.Module:
    model = model_cls(args, rank)
    with torch.device("meta"):
        reference = model_cls(replace(args, tp_size=1, tp_group=None), 0)
    init_weights_(model, reference, model.tp_rank, seed)
    if device is not None:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def build_model(args: ModelArgs, rank: Optional[int] = None, seed: int = 0, device=None) -> Transformer:
    """A Transformer holding TP rank `rank`'s shard of deterministic, TP-independent weights.

    rank=None reads the TP rank from torch.distributed (0 when not initialized).
    """
    return _build(Transformer, args, rank, seed, device)
