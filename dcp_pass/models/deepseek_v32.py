"""A tiny DeepSeek-V3.2-Exp-style model (MLA + lightning indexer, top-k sparse attention), pure PyTorch.

It mirrors the structure of DeepSeek's public V3.2-Exp inference code (``inference/model.py``
of deepseek-ai/DeepSeek-V3.2-Exp): the same module and function names, the same branches in
``forward``, the same in-place ops, ``torch.distributed`` calls and asserts, so that
``torch.compile`` sees what it sees on the official model. It is written here, not copied.

What the official code does, and this module does the same way:

* tensor parallelism read from module globals ``world_size`` / ``rank`` (set when a
  ``Transformer`` is built): vocab-parallel embedding (``x[mask] = 0`` and
  ``dist.all_reduce``), column/row-parallel linears (the row-parallel one all-reduces in
  fp32), routed experts split over ranks, logits gathered with the list ``dist.all_gather``;
* MLA with a latent cache (``kv_cache``) and a rotary cache (``pe_cache``). Prefill
  (``mask`` given) runs in MHA form: the cache is written, but attention is over the
  chunk's own per-head keys and values expanded through ``wkv_b``. Decode (``mask`` is
  None) runs absorbed: the key half of ``wkv_b`` is folded into the query, scores are taken
  against the cached latent and rotary rows, and the value half is applied after attention;
* the lightning indexer: its own key cache (``k_cache``, fp8, with ``k_scale_cache``),
  Hadamard-rotated queries and keys quantised by ``act_quant``, scored by ``fp8_index``;
  the top ``index_topk`` keys of each query are broadcast from rank 0 and checked with
  ``assert torch.all(...)``. The attention adds an index mask (0 on the chosen keys,
  -inf elsewhere) to its scores with ``scores += index_mask.unsqueeze(2)``;
* ``Transformer.forward`` is decorated with ``@torch.inference_mode()``.

What differs, and why:

* the GPU kernels (tilelang ``act_quant``, ``fp8_gemm``, ``fp8_index``; the
  ``fast_hadamard_transform`` package behind ``rotate_activation``) are pure-torch
  functions with the same signatures and semantics, so the model runs on CPU. The fp8
  cast is real (``torch.float8_e4m3fn``, supported by CPU torch); the fp8 products are
  taken in fp32 after an exact up-cast, so only the summation order differs from the
  kernels;
* ``einops.rearrange(q, 'b s (h d) -> b s h d')`` is written as the equivalent ``view``
  (einops is not a dependency of this package);
* ``block_size`` (the quantisation block) is 32, not 128, so that the tiny
  ``index_head_dim`` (32) is one block as in the official config (128 = 128): the
  indexer's ``k_scale_cache`` and ``fp8_index`` hold one scale per key;
* ``ModelArgs.dtype`` also accepts ``"fp32"`` (the default here): every linear weight,
  cache and activation is then fp32;
* ``Transformer(args, world=(world_size, rank))`` may name the TP degree explicitly
  instead of reading it from ``torch.distributed`` (so a TP=1 reference can be built
  inside a process group).

Because the TP degree lives in module globals (as in the official code), only the most
recently built ``Transformer``'s degree is in effect: build and run a TP=1 reference
before building a TP>1 model in the same process, or run it in another process. The
indexer calls ``dist.broadcast`` at every world size, as the official code does, so a
process group must be initialized even for world size 1 (a 1-rank gloo group will do).

``build_model(args, rank=None, seed=0)`` creates deterministic weights that do not depend
on the TP degree: the full tensors are drawn in a fixed order and each rank keeps its shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelArgs",
    "ParallelEmbedding",
    "Linear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "RMSNorm",
    "LayerNorm",
    "Indexer",
    "MLA",
    "MLP",
    "Gate",
    "Expert",
    "MoE",
    "Block",
    "Transformer",
    "act_quant",
    "fp8_gemm",
    "fp8_index",
    "hadamard_transform",
    "weight_dequant",
    "linear",
    "precompute_freqs_cis",
    "apply_rotary_emb",
    "rotate_activation",
    "build_model",
]


world_size = 1
rank = 0
block_size = 32

FP8_MAX = 448.0  # largest finite float8_e4m3fn


# --------------------------------------------------------------------------- kernels (pure torch)


def act_quant(x: torch.Tensor, block_size: int = 128,
              scale_fmt: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-wise fp8 quantisation of the last dimension.

    Each run of ``block_size`` values gets one fp32 scale ``s = max(amax, 1e-4) / 448``
    (with ``scale_fmt`` set, ``s`` is rounded up to a power of two, the ue8m0 format);
    ``y = clamp(x / s, -448, 448)`` cast to ``torch.float8_e4m3fn``.
    Returns ``y`` (x's shape, fp8) and the scales (``x.shape[:-1] + (N // block_size,)``, fp32).
    """
    assert x.is_contiguous(), "act_quant needs a contiguous input"
    assert x.size(-1) % block_size == 0, f"the last dimension must be a multiple of block_size={block_size}"
    n = x.size(-1)
    blocks = x.float().view(*x.size()[:-1], n // block_size, block_size)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    s = amax / FP8_MAX
    if scale_fmt is not None:
        # 2 ** ceil(log2(s)), exact: frexp gives s = m * 2**e with m in [0.5, 1)
        m, e = torch.frexp(s)
        s = torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))
    y = (blocks / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return y.view(x.size()), s


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` of fp8 operands with block scales, accumulated in fp32.

    a: [..., K] fp8 with a_s [..., K // block_size]; b: [N, K] fp8 with
    b_s [ceil(N / block_size), ceil(K / block_size)]. The result has the default dtype.
    """
    assert a.is_contiguous() and b.is_contiguous(), "fp8_gemm needs contiguous operands"
    assert a_s.is_contiguous() and b_s.is_contiguous(), "fp8_gemm needs contiguous scales"
    k = a.size(-1)
    bs = k // a_s.size(-1)
    a_full = (a.float().view(*a.size()[:-1], -1, bs) * a_s.unsqueeze(-1)).view(a.size())
    b_full = weight_dequant(b, b_s, torch.float32)
    return (a_full @ b_full.T).to(torch.get_default_dtype())


def fp8_index(q: torch.Tensor, q_s: torch.Tensor, k: torch.Tensor, k_s: torch.Tensor) -> torch.Tensor:
    """Index scores of the lightning indexer.

    q: [b, m, h, d] fp8; q_s: per-head weights [b, m, h] (a trailing 1 allowed);
    k: [b, n, d] fp8; k_s: per-key scale [b, n] (a trailing 1 allowed).
    score[b, m, n] = k_s[b, n] * sum_h q_s[b, m, h] * relu(q[b, m, h] . k[b, n]), in fp32.
    """
    b, m, h, _ = q.size()
    n = k.size(1)
    logits = torch.einsum("bmhd,bnd->bmnh", q.float(), k.float())
    logits = logits.relu() * q_s.reshape(b, m, 1, h)
    return logits.sum(dim=-1) * k_s.reshape(b, 1, n)


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * x @ H`` over the last dimension, H the Sylvester Hadamard matrix (size a power of 2)."""
    d = x.size(-1)
    assert d > 0 and d & (d - 1) == 0, f"the Hadamard transform needs a power-of-2 size, got {d}"
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        # butterflies between entries h apart inside blocks of 2h
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], dim=2)
        h *= 2
    return (y.view(x.size()) * scale).to(x.dtype)


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An fp8 weight [N, K] times its [ceil(N / bs), ceil(K / bs)] block scales, as ``dtype``
    (the default dtype when None)."""
    assert weight.dim() == 2
    n, k = weight.size()
    rows = scale.repeat_interleave(block_size, dim=0)[:n]
    full = rows.repeat_interleave(block_size, dim=1)[:, :k]
    return (weight.float() * full.float()).to(dtype or torch.get_default_dtype())


# --------------------------------------------------------------------------- model


@dataclass
class ModelArgs:
    """Hyperparameters; the defaults are a tiny CPU configuration (one dense and one MoE layer)."""

    max_batch_size: int = 4
    max_seq_len: int = 64
    dtype: Literal["bf16", "fp8", "fp32"] = "fp32"
    scale_fmt: Optional[str] = None
    vocab_size: int = 128
    dim: int = 64
    inter_dim: int = 128
    moe_inter_dim: int = 32
    n_layers: int = 2
    n_dense_layers: int = 1
    n_heads: int = 4
    # moe
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_scale: float = 1.0
    # mla
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    # yarn (active only when max_seq_len > original_seq_len)
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    # index
    index_n_heads: int = 2
    index_head_dim: int = 32
    index_topk: int = 8


class ParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rows owned elsewhere give 0, then all-reduced."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.dim = dim
        assert vocab_size % world_size == 0, f"vocab_size must be divisible by world_size={world_size}"
        self.part_vocab_size = vocab_size // world_size
        self.vocab_start_idx = rank * self.part_vocab_size
        self.vocab_end_idx = self.vocab_start_idx + self.part_vocab_size
        self.weight = nn.Parameter(torch.empty(self.part_vocab_size, self.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if world_size > 1:
            mask = (x < self.vocab_start_idx) | (x >= self.vocab_end_idx)
            x = x - self.vocab_start_idx
            x[mask] = 0
        y = F.embedding(x, self.weight)
        if world_size > 1:
            y[mask] = 0
            dist.all_reduce(y)
        return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           scale_fmt: Optional[str] = None) -> torch.Tensor:
    """x @ weight.T; an fp8 weight (with its ``.scale``) takes the quantised-activation GEMM."""
    assert bias is None
    if weight.dtype != torch.float8_e4m3fn:
        return F.linear(x, weight)
    else:
        x, scale = act_quant(x, block_size, scale_fmt)
        return fp8_gemm(x, scale, weight, weight.scale)  # type: ignore[attr-defined]  # set by Linear


class Linear(nn.Module):
    """A bias-free linear layer whose weight may be fp8 with per-block scales."""

    dtype = torch.bfloat16
    scale_fmt: Optional[str] = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype or Linear.dtype))
        if self.weight.element_size() == 1:
            scale_rows = (out_features + block_size - 1) // block_size
            scale_cols = (in_features + block_size - 1) // block_size
            # the fp8 GEMM finds the weight's block scales on the weight itself
            self.weight.scale = self.scale = nn.Parameter(  # type: ignore[attr-defined]
                torch.empty(scale_rows, scale_cols, dtype=torch.float32))
        else:
            self.register_parameter("scale", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.scale_fmt)


class ColumnParallelLinear(Linear):
    """Output features split over the TP ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        assert out_features % world_size == 0, f"out_features must be divisible by world_size={world_size}"
        self.part_out_features = out_features // world_size
        super().__init__(in_features, self.part_out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.scale_fmt)
        return y


class RowParallelLinear(Linear):
    """Input features split over the TP ranks; the partial outputs are summed in fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_output=True, dtype=None):
        assert in_features % world_size == 0, f"in_features must be divisible by world_size={world_size}"
        self.part_in_features = in_features // world_size
        self.reduce_output = reduce_output
        super().__init__(self.part_in_features, out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.scale_fmt)
        if self.reduce_output and world_size > 1:
            y = y.float()
            dist.all_reduce(y)
        if self.bias is not None:
            y += self.bias
        return y.type_as(x)


class RMSNorm(nn.Module):
    """RMS norm in fp32; with ``residual`` it first adds it and also returns the sum."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        dtype = x.dtype
        if residual is None:
            x = x.float()
            var = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(var + self.eps)
            return (self.weight * x).to(dtype)
        else:
            x = residual = x.float() + residual.float()
            var = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(var + self.eps)
            return (self.weight * x).to(dtype), residual.to(dtype)


class LayerNorm(nn.Module):
    """Layer norm in fp32 (the indexer's key norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        return F.layer_norm(x.float(), (self.dim,), self.weight, self.bias, self.eps).type_as(x)


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    """Complex rotations [max_seq_len, qk_rope_head_dim // 2], YaRN-corrected beyond original_seq_len."""
    dim = args.qk_rope_head_dim
    seqlen = args.max_seq_len
    base = args.rope_theta

    def correction_dim(rotations: float) -> float:
        # the rotary dimension whose wavelength fits `rotations` times in original_seq_len
        return dim * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    def ramp(lo: float, hi: float, n: int) -> torch.Tensor:
        if lo == hi:
            hi += 0.001
        return ((torch.arange(n, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if seqlen > args.original_seq_len:
        lo = max(math.floor(correction_dim(args.beta_fast)), 0)
        hi = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
        keep = 1 - ramp(lo, hi, dim // 2)
        freqs = freqs / args.rope_factor * (1 - keep) + freqs * keep
    angles = torch.outer(torch.arange(seqlen), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, h, d] by freqs_cis [s, d // 2], pairs of dims taken as complex numbers."""
    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    return y.to(dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """Normalised Hadamard rotation of the last dimension (spreads outliers before fp8)."""
    assert x.dtype in (torch.bfloat16, torch.float32)
    hidden_size = x.size(-1)
    return hadamard_transform(x, scale=hidden_size ** -0.5)


class Indexer(torch.nn.Module):
    """Lightning indexer: picks the top ``index_topk`` keys of every query from fp8 scores.

    Replicated on every TP rank (its weights are not sharded); rank 0's choice is broadcast
    and every rank asserts that it made the same one.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim: int = args.dim
        self.n_heads: int = args.index_n_heads
        self.n_local_heads = args.index_n_heads // world_size
        self.head_dim: int = args.index_head_dim
        self.rope_head_dim: int = args.qk_rope_head_dim
        self.index_topk: int = args.index_topk
        self.q_lora_rank: int = args.q_lora_rank
        self.wq_b = Linear(self.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(self.dim, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim)
        self.weights_proj = Linear(self.dim, self.n_heads, dtype=torch.get_default_dtype())
        self.softmax_scale = self.head_dim ** -0.5
        self.scale_fmt = args.scale_fmt

        self.register_buffer("k_cache", torch.zeros(args.max_batch_size, args.max_seq_len, self.head_dim,
                                                    dtype=torch.float8_e4m3fn), persistent=False)
        self.register_buffer("k_scale_cache", torch.zeros(args.max_batch_size, args.max_seq_len,
                                                          self.head_dim // block_size, dtype=torch.float32),
                             persistent=False)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor,
                mask: Optional[torch.Tensor]):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q = self.wq_b(qr)
        q = q.view(bsz, seqlen, -1, self.head_dim)  # einops 'b s (h d) -> b s h d'
        q_pe, q_nope = torch.split(q, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        q = torch.cat([q_pe, q_nope], dim=-1)
        k = self.wk(x)
        k = self.k_norm(k)
        k_pe, k_nope = torch.split(k, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis).squeeze(2)
        k = torch.cat([k_pe, k_nope], dim=-1)
        q = rotate_activation(q)
        k = rotate_activation(k)
        q_fp8, q_scale = act_quant(q, block_size, self.scale_fmt)
        k_fp8, k_scale = act_quant(k, block_size, self.scale_fmt)
        self.k_cache[:bsz, start_pos:end_pos] = k_fp8
        self.k_scale_cache[:bsz, start_pos:end_pos] = k_scale
        weights = self.weights_proj(x) * self.n_heads ** -0.5
        weights = weights.unsqueeze(-1) * q_scale * self.softmax_scale
        index_score = fp8_index(q_fp8.contiguous(), weights, self.k_cache[:bsz, :end_pos].contiguous(),
                                self.k_scale_cache[:bsz, :end_pos].contiguous())
        if mask is not None:
            index_score += mask
        topk_indices = index_score.topk(min(self.index_topk, end_pos), dim=-1)[1]
        topk_indices_ = topk_indices.clone()
        dist.broadcast(topk_indices_, src=0)
        assert torch.all(topk_indices == topk_indices_), f"{topk_indices=} {topk_indices_=}"
        return topk_indices


class MLA(nn.Module):
    """Multi-head latent attention with the indexer's top-k mask.

    Caches (non-persistent buffers, default dtype): ``kv_cache`` [max_batch, max_seq,
    kv_lora_rank] (normed latent) and ``pe_cache`` [max_batch, max_seq, qk_rope_head_dim]
    (rotated rotary key). Prefill (``mask`` given) attends in MHA form over the chunk's own
    keys, so it is only right from ``start_pos`` 0; decode is absorbed, one token a step.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim = args.dim
        self.n_heads = args.n_heads
        self.n_local_heads = args.n_heads // world_size
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim

        self.wq_a = Linear(self.dim, self.q_lora_rank)
        self.q_norm = RMSNorm(self.q_lora_rank)
        self.wq_b = ColumnParallelLinear(self.q_lora_rank, self.n_heads * self.qk_head_dim)
        self.wkv_a = Linear(self.dim, self.kv_lora_rank + self.qk_rope_head_dim)
        self.kv_norm = RMSNorm(self.kv_lora_rank)
        self.wkv_b = ColumnParallelLinear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.wo = RowParallelLinear(self.n_heads * self.v_head_dim, self.dim)
        self.softmax_scale = self.qk_head_dim ** -0.5
        if args.max_seq_len > args.original_seq_len:
            mscale = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
            self.softmax_scale = self.softmax_scale * mscale * mscale

        self.indexer = Indexer(args)

        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size, args.max_seq_len, self.kv_lora_rank),
                             persistent=False)
        self.register_buffer("pe_cache", torch.zeros(args.max_batch_size, args.max_seq_len, self.qk_rope_head_dim),
                             persistent=False)
        self.dequant_wkv_b = None

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr)
        q = q.view(bsz, seqlen, self.n_local_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_norm(kv)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
        self.kv_cache[:bsz, start_pos:end_pos] = kv
        self.pe_cache[:bsz, start_pos:end_pos] = k_pe.squeeze(2)
        if mask is not None:    # prefill: MHA over the chunk's own per-head keys and values
            q = torch.cat([q_nope, q_pe], dim=-1)
            kv = self.wkv_b(kv)
            kv = kv.view(bsz, seqlen, self.n_local_heads, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_local_heads, -1)], dim=-1)
            scores = torch.einsum("bshd,bthd->bsht", q.float(), k.float()) * self.softmax_scale

            # indexer
            topk_indices = self.indexer(x, qr, start_pos, freqs_cis, mask)
            index_mask = torch.full((bsz, seqlen, seqlen), float("-inf"), device=x.device).scatter_(-1, topk_indices, 0)
            index_mask += mask
            scores += index_mask.unsqueeze(2)

            scores = scores.softmax(dim=-1, dtype=torch.float32)
            x = torch.einsum("bsht,bthd->bshd", scores.type_as(x), v)
        else:                   # decode: absorbed attention over the latent cache
            if self.dequant_wkv_b is None and self.wkv_b.scale is not None:
                self.dequant_wkv_b = weight_dequant(self.wkv_b.weight, self.wkv_b.scale)
            wkv_b = self.wkv_b.weight if self.dequant_wkv_b is None else self.dequant_wkv_b
            wkv_b = wkv_b.view(self.n_local_heads, -1, self.kv_lora_rank)
            q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :self.qk_nope_head_dim])
            scores = (torch.einsum("bshc,btc->bsht", q_nope.float(), self.kv_cache[:bsz, :end_pos].float()) +
                      torch.einsum("bshr,btr->bsht", q_pe.float(), self.pe_cache[:bsz, :end_pos].float())
                      ) * self.softmax_scale

            # indexer
            topk_indices = self.indexer(x, qr, start_pos, freqs_cis, mask)
            index_mask = torch.full((bsz, 1, end_pos), float("-inf"), device=x.device).scatter_(-1, topk_indices, 0)
            scores += index_mask.unsqueeze(2)

            scores = scores.softmax(dim=-1, dtype=torch.float32)
            x = torch.einsum("bsht,btc->bshc", scores.type_as(x), self.kv_cache[:bsz, :end_pos])
            x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -self.v_head_dim:])
        x = self.wo(x.flatten(2))
        return x


class MLP(nn.Module):
    """SwiGLU feed-forward: column-parallel w1/w3, row-parallel w2."""

    def __init__(self, dim: int, inter_dim: int, reduce_output: bool = True):
        super().__init__()
        self.w1 = ColumnParallelLinear(dim, inter_dim)
        self.w2 = RowParallelLinear(inter_dim, dim, reduce_output=reduce_output)
        self.w3 = ColumnParallelLinear(dim, inter_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2((F.silu(self.w1(x).float()) * self.w3(x).float()).type_as(x))


class Gate(nn.Module):
    """Router: softmax or sigmoid scores, optional group-limited choice, top-k experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim = args.dim
        self.topk = args.n_activated_experts
        self.n_groups = args.n_expert_groups
        self.topk_groups = args.n_limited_groups
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        # the full-size model (dim 7168) carries a routing bias
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32)) if self.dim == 7168 else None

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        scores = linear(x.float(), self.weight.float())
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        else:
            scores = scores.sigmoid()
        original_scores = scores
        if self.bias is not None:
            scores = scores + self.bias
        if self.n_groups > 1:
            scores = scores.view(x.size(0), self.n_groups, -1)
            if self.bias is None:
                group_scores = scores.amax(dim=-1)
            else:
                group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
            indices = group_scores.topk(self.topk_groups, dim=-1)[1]
            mask = scores.new_ones(x.size(0), self.n_groups, dtype=bool).scatter_(1, indices, False)
            scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = scores.topk(self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        if self.score_func == "sigmoid":
            weights /= weights.sum(dim=-1, keepdim=True)
        weights *= self.route_scale
        return weights, indices


class Expert(nn.Module):
    """One routed expert, held whole by the rank that owns it."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = Linear(dim, inter_dim)
        self.w2 = Linear(inter_dim, dim)
        self.w3 = Linear(dim, inter_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2((F.silu(self.w1(x).float()) * self.w3(x).float()).type_as(x))


class MoE(nn.Module):
    """Routed experts split over the TP ranks plus shared experts; summed by one all-reduce."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim = args.dim
        assert args.n_routed_experts % world_size == 0, f"n_routed_experts must be divisible by world_size={world_size}"
        self.n_routed_experts = args.n_routed_experts
        self.n_local_experts = args.n_routed_experts // world_size
        self.n_activated_experts = args.n_activated_experts
        self.experts_start_idx = rank * self.n_local_experts
        self.experts_end_idx = self.experts_start_idx + self.n_local_experts
        self.gate = Gate(args)
        self.experts = nn.ModuleList([Expert(args.dim, args.moe_inter_dim)
                                      if self.experts_start_idx <= i < self.experts_end_idx else None
                                      for i in range(self.n_routed_experts)])
        self.shared_experts = MLP(args.dim, args.n_shared_experts * args.moe_inter_dim, reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.experts_start_idx, self.experts_end_idx):
            if counts[i] == 0:
                continue
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        y += self.shared_experts(x)
        if world_size > 1:
            dist.all_reduce(y)
        return y.type_as(x).view(shape)


class Block(nn.Module):
    """Attention then feed-forward (dense MLP for the first n_dense_layers, MoE after), pre-norm
    with the residual carried through the norms."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attn = MLA(args)
        self.ffn = MLP(args.dim, args.inter_dim) if layer_id < args.n_dense_layers else MoE(args)
        self.attn_norm = RMSNorm(args.dim)
        self.ffn_norm = RMSNorm(args.dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        if residual is None:
            x, residual = self.attn_norm(x), x
        else:
            x, residual = self.attn_norm(x, residual)
        x = self.attn(x, start_pos, freqs_cis, mask)
        x, residual = self.ffn_norm(x, residual)
        x = self.ffn(x)
        return x, residual


_LINEAR_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


class Transformer(nn.Module):
    """tokens [b, s] (int64), start_pos -> logits of the last position [b, vocab] (fp32).

    A call with s > 1 is a prefill (from start_pos 0), s == 1 a decode step at start_pos.
    ``world=(world_size, rank)`` sets the TP degree; None reads torch.distributed.
    """

    def __init__(self, args: ModelArgs, world: Optional[Tuple[int, int]] = None):
        global world_size, rank
        if world is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            rank = dist.get_rank() if dist.is_initialized() else 0
        else:
            world_size, rank = world
        Linear.dtype = _LINEAR_DTYPES[args.dtype]
        Linear.scale_fmt = args.scale_fmt
        super().__init__()
        self.world = (world_size, rank)
        self.max_seq_len = args.max_seq_len
        self.embed = ParallelEmbedding(args.vocab_size, args.dim)
        self.layers = torch.nn.ModuleList()
        for layer_id in range(args.n_layers):
            self.layers.append(Block(layer_id, args))
        self.norm = RMSNorm(args.dim)
        # the head is kept in fp32 for the logits
        self.head = ColumnParallelLinear(args.dim, args.vocab_size, dtype=torch.float32)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0):
        seqlen = tokens.size(1)
        freqs_cis = self.freqs_cis[start_pos:start_pos + seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device).triu_(1) if seqlen > 1 else None
        h, residual = self.embed(tokens), None
        for layer in self.layers:
            h, residual = layer(h, residual, start_pos, freqs_cis, mask)
        h, _ = self.norm(h, residual)
        logits = self.head(h[:, -1].float())
        if world_size > 1:
            all_logits = [torch.empty_like(logits) for _ in range(world_size)]
            dist.all_gather(all_logits, logits)
            logits = torch.cat(all_logits, dim=-1)
        return logits


# --------------------------------------------------------------------------- weights


def _shard_dim(module: nn.Module) -> Optional[int]:
    if isinstance(module, (ColumnParallelLinear, ParallelEmbedding)):
        return 0
    if isinstance(module, RowParallelLinear):
        return 1
    return None


def build_model(args: ModelArgs, rank: Optional[int] = None, seed: int = 0,
                world_size: Optional[int] = None) -> Transformer:
    """A Transformer holding TP rank ``rank``'s shard of deterministic, TP-independent weights.

    ``world_size`` None reads the TP degree from torch.distributed (1 when not initialized);
    ``rank`` None reads this process's rank (0 at world_size 1). A TP>1 model runs its
    collectives on the default process group, so world_size must then be its size.
    Every full tensor is drawn from one CPU ``torch.Generator(seed)`` in fp32, in the parameter
    order of an unsharded model: norm weights 1 + 0.1 N(0, 1), norm biases 0.1 N(0, 1),
    embeddings N(0, 1), matrices N(0, 1) / sqrt(fan_in). fp32 and bf16 weights only.
    """
    if args.dtype == "fp8":
        raise ValueError("build_model draws fp32/bf16 weights; use dtype='fp32' or 'bf16' "
                         "(fp8 weights need their block scales from a checkpoint)")
    initialized = dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if world_size > 1:
        if not initialized or dist.get_world_size() != world_size:
            raise ValueError(f"world_size={world_size} needs an initialized default process group of that size")
        if rank is None:
            rank = dist.get_rank()
        elif rank != dist.get_rank():
            raise ValueError(f"rank={rank} does not match this process's rank {dist.get_rank()}")
    else:
        world_size, rank = 1, 0
    with torch.device("meta"):
        reference = Transformer(args, world=(1, 0))
    model = Transformer(args, world=(world_size, rank))  # sets the module globals last

    gen = torch.Generator(device="cpu").manual_seed(seed)
    local = dict(model.named_parameters())
    for name, ref_param in reference.named_parameters():
        owner_name = name.rsplit(".", 1)[0]
        owner = reference.get_submodule(owner_name)
        shape = tuple(ref_param.shape)
        full = torch.randn(shape, generator=gen, dtype=torch.float32)
        if isinstance(owner, (RMSNorm, LayerNorm)):
            full = 1.0 + 0.1 * full if name.endswith("weight") else 0.1 * full
        elif isinstance(owner, ParallelEmbedding) or full.dim() < 2:
            pass
        else:
            full = full / math.sqrt(shape[-1])
        if name not in local:  # a routed expert owned by another rank
            continue
        param = local[name]
        dim = _shard_dim(model.get_submodule(owner_name))
        if dim is not None and world_size > 1:
            size = param.shape[dim]
            full = full.narrow(dim, rank * size, size)
        if tuple(full.shape) != tuple(param.shape):
            raise RuntimeError(
                f"shape mismatch for {name}: shard {tuple(full.shape)} vs parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(full.to(param.dtype))
    model.eval()
    model.requires_grad_(False)
    return model
