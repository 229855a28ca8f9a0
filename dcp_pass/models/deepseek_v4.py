"""A tiny DeepSeek-V4-style model (sliding window + compressed entries + indexer + sinks), pure PyTorch.

It follows the structure of DeepSeek's public V4 inference code (``inference/model.py`` of the
DeepSeek-V4 checkpoints) as the paper and transformers' ``deepseek_v4`` describe it, so that
``torch.compile`` sees the graph a user of that code would give it. It is written here, not
copied.

Each attention layer has a compression ratio ``m`` (``ModelArgs.compress_ratios``): 0 is a
sliding-window layer, 4 is Compressed Sparse Attention (CSA, with a lightning indexer), any
other ratio Heavily Compressed Attention (HCA). What the official code does, and this module
does the same way:

* one shared key-value head (MQA, keys are values) of ``head_dim`` columns, the trailing
  ``rope_head_dim`` of them rotated (complex ``freqs_cis``, in place); queries are RMS-normalised
  per head without a weight; the output's rotary columns are rotated back (the conjugate) at the
  query's position before the grouped low-rank output projection (``wo_a`` per head group, then
  ``wo_b``);
* **one cache buffer per layer**, ``kv_cache [max_batch, window_size + max_seq_len // m,
  head_dim]``: rows ``[0, window_size)`` are a ring holding the last ``window_size`` tokens
  (position ``p`` at row ``p % window_size``), rows from ``window_size`` on are the compressed
  entries, entry ``i`` at row ``window_size + i``. The compressor writes them through a view of
  the same buffer (``compressor.kv_cache = kv_cache[:, window_size:]``), a plain attribute;
* the compressor pools every ``m`` tokens into one entry: ``wkv`` and ``wgate`` project each
  token, ``ape`` (one row per slot of the window) is added to the gate, and the entry is the
  softmax-over-slots-weighted sum, RMS-normalised and rotated at the window's first position.
  At ``m = 4`` it overlaps: both projections are twice as wide, and entry ``w`` pools the
  previous window's first half of the columns with window ``w``'s second half (``2 m`` slots).
  Decoding keeps the tokens of the open window in ``kv_state`` / ``score_state`` (bounded:
  ``(1 + overlap) m`` rows) and writes an entry when a window closes;
* the lightning indexer (CSA only) runs its own compressor at ``index_head_dim`` into its own
  ``kv_cache``, Hadamard-rotates queries and compressed keys, scores every visible entry with
  ``sum_h w_h relu(q_h . k)`` and keeps the top ``index_topk``. HCA layers attend to every
  visible entry;
* attention takes index lists (``topk_idxs``): the window's rows, then the compressed entries
  (offset by the window), ``-1`` for none; each head has a learned sink logit (``attn_sink``)
  in the softmax's denominator. A prefill (``start_pos == 0``) attends over the chunk's own keys
  followed by the entries it compressed, then fills the ring with its last ``window_size`` keys;
  a decode step writes its key into the ring, lets the compressor close a window, and attends
  over the layer's whole buffer;
* hyper-connections: the residual is ``hc_mult`` streams; before each sub-block a small linear
  map gives the streams' input weights (sigmoid), output weights (2 sigmoid) and a stream mixing
  matrix made doubly stochastic by Sinkhorn iterations.

What differs, and why:

* the GPU kernels are pure-torch functions with the same semantics: ``sparse_attn`` builds an
  additive mask from the index lists (0 on the chosen rows, -inf elsewhere) and runs dense
  attention with the sink (the same keys and weights as the gathering kernel); the Hadamard
  transform is ``deepseek_v32.hadamard_transform``; ``hc_split_sinkhorn`` is plain torch;
* every weight, cache and activation is fp32 (no fp8 cache or fp4 experts): token identity is
  then testable;
* the feed-forward is a dense SwiGLU in every layer (no hash-routed or top-k MoE: the routers'
  softmaxes and the experts' graph breaks have nothing to do with attention), no tensor
  parallelism (one process holds the whole model), no multi-token-prediction layer;
* ``Transformer.forward`` is not under ``torch.inference_mode()``: one-graph forwards under it
  fail in AOT autograd with torch's own backends (pytorch issue 180823); run it under
  ``torch.no_grad()``.

``build_model(args, seed)`` gives deterministic weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dcp_pass.models.deepseek_v32 import hadamard_transform

__all__ = [
    "ModelArgs", "RMSNorm", "Compressor", "Indexer", "Attention", "MLP", "Block", "Transformer",
    "precompute_freqs_cis", "apply_rotary_emb", "rotate_activation", "sparse_attn", "hc_split_sinkhorn",
    "get_window_topk_idxs", "get_compress_topk_idxs", "build_model", "cache_bytes_per_token",
]


@dataclass
class ModelArgs:
    """Hyperparameters; the defaults are a tiny CPU configuration with one layer of each kind."""

    max_batch_size: int = 4
    max_seq_len: int = 64
    vocab_size: int = 128
    dim: int = 64
    inter_dim: int = 128
    n_layers: int = 3
    # per layer: 0 sliding window only, 4 CSA (overlapping windows, indexer), else HCA
    compress_ratios: tuple[int, ...] = (0, 4, 16)
    n_heads: int = 4
    head_dim: int = 32
    rope_head_dim: int = 8
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    window_size: int = 8
    norm_eps: float = 1e-6
    # rotary: sliding layers use rope_theta, compressed layers compress_rope_theta with YaRN
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 4096
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # hyper-connections
    hc_mult: int = 2
    hc_sinkhorn_iters: int = 4
    hc_eps: float = 1e-6
    # lightning indexer (CSA layers)
    index_n_heads: int = 8  # with few heads, relu(q.k) is often 0 for every head: top-k ties
    index_head_dim: int = 16
    index_topk: int = 4


# --------------------------------------------------------------------------- kernels (pure torch)


def precompute_freqs_cis(dim: int, seqlen: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                         beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """Complex rotations [seqlen, dim // 2]; YaRN-interpolated when seqlen > original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if 0 < original_seq_len < seqlen:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(correction_dim(beta_fast)), 0)
        hi = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / factor * (1 - keep) + freqs * keep
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x [b, s, (h,) d] in place by freqs_cis [s, d // 2] (its conjugate when `inverse`),
    pairs of columns taken as complex numbers; returns x."""
    y = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    if inverse:
        freqs_cis = freqs_cis.conj()
    shape = [1, y.size(1)] + [1] * (y.dim() - 3) + [y.size(-1)]
    y = torch.view_as_real(y * freqs_cis.view(shape)).flatten(-2)
    x.copy_(y.to(x.dtype))
    return x


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """Normalised Hadamard rotation of the last dimension (the indexer's queries and keys)."""
    return hadamard_transform(x, scale=x.size(-1) ** -0.5)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """Attention of q [b, s, h, d] over the rows `topk_idxs` [b, s, k] of kv [b, n, d] (keys are
    values; -1 chooses nothing), with one sink logit per head in the softmax's denominator.

    The kernel gathers the chosen rows; this builds an additive mask over all n rows instead
    (0 on a chosen row, -inf elsewhere): the same keys, weights and output.
    """
    bsz, seqlen, n_heads, _ = q.size()
    n = kv.size(1)
    idxs = torch.where(topk_idxs < 0, n, topk_idxs)  # -1 -> a column past the rows, cut off below
    index_mask = torch.full((bsz, seqlen, n + 1), float("-inf"), device=q.device).scatter_(-1, idxs, 0)[..., :n]
    scores = torch.einsum("bshd,btd->bsht", q.float(), kv.float()) * softmax_scale
    scores = scores + index_mask.unsqueeze(2)
    sinks = attn_sink.view(1, 1, n_heads, 1).expand(bsz, seqlen, n_heads, 1)
    combined = torch.cat([scores, sinks.float()], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.einsum("bsht,btd->bshd", probs, kv.float()).type_as(q)


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int,
                      iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2 + hc) hc] -> the streams' input weights [..., hc], output weights [..., hc]
    and a doubly stochastic mixing matrix [..., hc, hc] (Sinkhorn-Knopp from a row softmax)."""
    hc = hc_mult
    pre = torch.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * hc_scale[2] + hc_base[2 * hc:].view(hc, hc)
    comb = comb.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def get_window_topk_idxs(window_size: int, bsz: int, seqlen: int, start_pos: int) -> torch.Tensor:
    """The window's rows each query reads [bsz, seqlen, window_size], -1 for none.

    A prefill reads the chunk's own keys (query i: keys i - window_size + 1 .. i); a decode
    step reads the ring, whose rows hold positions start_pos - window_size + 1 .. start_pos."""
    if start_pos == 0:
        idxs = torch.arange(seqlen).unsqueeze(1) - window_size + 1 + torch.arange(window_size)
        idxs = torch.where(idxs < 0, -1, idxs)
    else:
        idxs = torch.arange(window_size)
        if start_pos < window_size - 1:
            idxs = torch.where(idxs > start_pos, -1, idxs)
        idxs = idxs.expand(seqlen, window_size)
    return idxs.unsqueeze(0).expand(bsz, -1, -1)


def get_compress_topk_idxs(ratio: int, bsz: int, seqlen: int, start_pos: int, offset: int) -> torch.Tensor:
    """Every compressed entry each query may see (HCA) [bsz, seqlen, n], offset, -1 for none.

    Query position t sees entry w when its window has closed: w < (t + 1) // ratio."""
    end_pos = start_pos + seqlen
    if start_pos == 0:
        idxs = torch.arange(seqlen // ratio).expand(seqlen, -1)
        visible = (torch.arange(1, seqlen + 1) // ratio).unsqueeze(1)
        idxs = torch.where(idxs >= visible, -1, idxs + offset)
    else:
        idxs = (torch.arange(end_pos // ratio) + offset).expand(seqlen, -1)
    return idxs.unsqueeze(0).expand(bsz, -1, -1)


# --------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


class Compressor(nn.Module):
    """Pools every `compress_ratio` tokens into one entry written to `kv_cache` (set by the owner:
    a view of the attention's buffer past its window, or the indexer's own buffer)."""

    def __init__(self, args: ModelArgs, compress_ratio: int, head_dim: int, rotate: bool = False):
        super().__init__()
        self.compress_ratio = compress_ratio
        self.head_dim = head_dim
        self.rope_head_dim = args.rope_head_dim
        self.overlap = compress_ratio == 4
        self.rotate = rotate
        coff = 1 + self.overlap
        self.ape = nn.Parameter(torch.empty(compress_ratio, coff * head_dim, dtype=torch.float32))
        self.wkv = nn.Linear(args.dim, coff * head_dim, bias=False)
        self.wgate = nn.Linear(args.dim, coff * head_dim, bias=False)
        self.norm = RMSNorm(head_dim, args.norm_eps)
        # the open window's tokens (with overlap: the previous window's, then the open one's)
        self.register_buffer("kv_state", torch.zeros(args.max_batch_size, coff * compress_ratio, coff * head_dim),
                             persistent=False)
        self.register_buffer("score_state", torch.full((args.max_batch_size, coff * compress_ratio, coff * head_dim),
                                                       float("-inf")), persistent=False)
        self.kv_cache: Optional[torch.Tensor] = None
        self.freqs_cis: Optional[torch.Tensor] = None

    def overlap_transform(self, tensor: torch.Tensor, value: float) -> torch.Tensor:
        """[b, n, m, 2d] -> [b, n, 2m, d]: window w's slots are window w-1's first-half columns,
        then its own second-half columns; window 0 has no previous window (`value`)."""
        bsz, n, ratio, _ = tensor.size()
        d = self.head_dim
        out = tensor.new_full((bsz, n, 2 * ratio, d), value)
        out[:, :, ratio:] = tensor[:, :, :, d:]
        out[:, 1:, :ratio] = tensor[:, :-1, :, :d]
        return out

    def forward(self, x: torch.Tensor, start_pos: int) -> Optional[torch.Tensor]:
        bsz, seqlen, _ = x.size()
        ratio, overlap, d, rd = self.compress_ratio, self.overlap, self.head_dim, self.rope_head_dim
        dtype = x.dtype
        x = x.float()
        kv = self.wkv(x)
        score = self.wgate(x)
        if start_pos == 0:
            should_compress = seqlen >= ratio
            remainder = seqlen % ratio
            cutoff = seqlen - remainder
            offset = ratio if overlap else 0
            if overlap:
                if cutoff >= ratio:  # the last closed window overlaps the next entry
                    self.kv_state[:bsz, :ratio] = kv[:, cutoff - ratio:cutoff]
                    self.score_state[:bsz, :ratio] = score[:, cutoff - ratio:cutoff] + self.ape
                else:  # no closed window: the next entry has no previous one (a new request)
                    self.score_state[:bsz, :ratio] = float("-inf")
            if remainder > 0:
                kv, self.kv_state[:bsz, offset:offset + remainder] = kv.split([cutoff, remainder], dim=1)
                self.score_state[:bsz, offset:offset + remainder] = score[:, cutoff:] + self.ape[:remainder]
                score = score[:, :cutoff]
            if should_compress:
                kv = kv.unflatten(1, (-1, ratio))
                score = score.unflatten(1, (-1, ratio)) + self.ape
                if overlap:
                    kv = self.overlap_transform(kv, 0.0)
                    score = self.overlap_transform(score, float("-inf"))
                kv = (kv * score.softmax(dim=2)).sum(dim=2)
        else:
            should_compress = (start_pos + 1) % ratio == 0
            score = score + self.ape[start_pos % ratio]
            if overlap:
                self.kv_state[:bsz, ratio + start_pos % ratio] = kv.squeeze(1)
                self.score_state[:bsz, ratio + start_pos % ratio] = score.squeeze(1)
                if should_compress:
                    kv_state = torch.cat([self.kv_state[:bsz, :ratio, :d], self.kv_state[:bsz, ratio:, d:]], dim=1)
                    score_state = torch.cat([self.score_state[:bsz, :ratio, :d],
                                             self.score_state[:bsz, ratio:, d:]], dim=1)
                    kv = (kv_state * score_state.softmax(dim=1)).sum(dim=1, keepdim=True)
                    self.kv_state[:bsz, :ratio] = self.kv_state[:bsz, ratio:]
                    self.score_state[:bsz, :ratio] = self.score_state[:bsz, ratio:]
            else:
                self.kv_state[:bsz, start_pos % ratio] = kv.squeeze(1)
                self.score_state[:bsz, start_pos % ratio] = score.squeeze(1)
                if should_compress:
                    kv = (self.kv_state[:bsz] * self.score_state[:bsz].softmax(dim=1)).sum(dim=1, keepdim=True)
        if not should_compress:
            return None
        kv = self.norm(kv.to(dtype))
        if start_pos == 0:
            freqs_cis = self.freqs_cis[:cutoff:ratio]
        else:
            freqs_cis = self.freqs_cis[start_pos + 1 - ratio].unsqueeze(0)
        apply_rotary_emb(kv[..., -rd:], freqs_cis)
        if self.rotate:
            kv = rotate_activation(kv)
        if start_pos == 0:
            self.kv_cache[:bsz, :seqlen // ratio] = kv
        else:
            self.kv_cache[:bsz, start_pos // ratio] = kv.squeeze(1)
        return kv


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: the top `index_topk` compressed entries of each query."""

    def __init__(self, args: ModelArgs, compress_ratio: int = 4):
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.rope_head_dim = args.rope_head_dim
        self.index_topk = args.index_topk
        self.compress_ratio = compress_ratio
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        self.compressor = Compressor(args, compress_ratio, self.head_dim, rotate=True)
        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size, args.max_seq_len // compress_ratio,
                                                     self.head_dim), persistent=False)
        self.compressor.kv_cache = self.kv_cache
        self.freqs_cis: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, qr: torch.Tensor, start_pos: int, offset: int) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        ratio, rd = self.compress_ratio, self.rope_head_dim
        freqs_cis = self.freqs_cis[start_pos:end_pos]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        apply_rotary_emb(q[..., -rd:], freqs_cis)
        q = rotate_activation(q)
        self.compressor(x, start_pos)
        weights = self.weights_proj(x.float()) * (self.softmax_scale * self.n_heads ** -0.5)
        index_score = torch.einsum("bshd,btd->bsht", q.float(), self.kv_cache[:bsz, :end_pos // ratio].float())
        index_score = (index_score.relu() * weights.unsqueeze(-1)).sum(dim=2)
        topk = min(self.index_topk, end_pos // ratio)
        if start_pos == 0:
            visible = (torch.arange(1, seqlen + 1, device=x.device) // ratio).view(1, seqlen, 1)
            future = torch.arange(end_pos // ratio, device=x.device).view(1, 1, -1) >= visible
            index_score = index_score.masked_fill(future, float("-inf"))
            topk_idxs = index_score.topk(topk, dim=-1)[1]
            return torch.where(topk_idxs >= visible, -1, topk_idxs + offset)
        return index_score.topk(topk, dim=-1)[1] + offset


class Attention(nn.Module):
    """Shared-KV attention over a sliding window and, at compress ratio m > 0, compressed entries."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.rope_head_dim = args.rope_head_dim
        self.window_size = args.window_size
        self.n_groups = args.o_groups
        self.o_lora_rank = args.o_lora_rank
        self.eps = args.norm_eps
        self.compress_ratio = args.compress_ratios[layer_id]
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, args.norm_eps)
        self.wo_a = nn.Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank,
                              bias=False)
        self.wo_b = nn.Linear(self.n_groups * self.o_lora_rank, args.dim, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        ratio = self.compress_ratio
        if ratio:
            freqs_cis = precompute_freqs_cis(self.rope_head_dim, args.max_seq_len, args.compress_rope_theta,
                                             args.original_seq_len, args.rope_factor, args.beta_fast, args.beta_slow)
        else:
            freqs_cis = precompute_freqs_cis(self.rope_head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)
        rows = self.window_size + (args.max_seq_len // ratio if ratio else 0)
        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size, rows, self.head_dim), persistent=False)
        self.compressor = Compressor(args, ratio, self.head_dim) if ratio else None
        self.indexer = Indexer(args, ratio) if ratio == 4 else None
        if self.compressor is not None:
            self.compressor.kv_cache = self.kv_cache[:, self.window_size:]
            self.compressor.freqs_cis = self.freqs_cis
        if self.indexer is not None:
            self.indexer.freqs_cis = self.freqs_cis
            self.indexer.compressor.freqs_cis = self.freqs_cis

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        win, ratio, rd = self.window_size, self.compress_ratio, self.rope_head_dim
        freqs_cis = self.freqs_cis[start_pos:end_pos]
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)
        apply_rotary_emb(q[..., -rd:], freqs_cis)
        kv = self.kv_norm(self.wkv(x))
        apply_rotary_emb(kv[..., -rd:], freqs_cis)

        topk_idxs = get_window_topk_idxs(win, bsz, seqlen, start_pos).to(x.device)
        if ratio:
            offset = seqlen if start_pos == 0 else win
            if self.indexer is not None:
                compress_topk_idxs = self.indexer(x, qr, start_pos, offset)
            else:
                compress_topk_idxs = get_compress_topk_idxs(ratio, bsz, seqlen, start_pos, offset).to(x.device)
            topk_idxs = torch.cat([topk_idxs, compress_topk_idxs], dim=-1)

        if start_pos == 0:
            if seqlen <= win:
                self.kv_cache[:bsz, :seqlen] = kv
            else:
                cutoff = seqlen % win
                self.kv_cache[:bsz, cutoff:win], self.kv_cache[:bsz, :cutoff] = kv[:, -win:].split(
                    [win - cutoff, cutoff], dim=1)
            if ratio:
                kv_compress = self.compressor(x, start_pos)
                if kv_compress is not None:
                    kv = torch.cat([kv, kv_compress], dim=1)
            o = sparse_attn(q, kv, self.attn_sink, topk_idxs, self.softmax_scale)
        else:
            self.kv_cache[:bsz, start_pos % win] = kv.squeeze(1)
            if ratio:
                self.compressor(x, start_pos)
            o = sparse_attn(q, self.kv_cache[:bsz], self.attn_sink, topk_idxs, self.softmax_scale)
        apply_rotary_emb(o[..., -rd:], freqs_cis, inverse=True)

        o = o.reshape(bsz, seqlen, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(o.flatten(2))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2((F.silu(self.w1(x).float()) * self.w3(x).float()).type_as(x))


class Block(nn.Module):
    """Attention then feed-forward, each between a hyper-connection's collapse and expansion."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.norm_eps = args.norm_eps
        self.hc_mult = hc = args.hc_mult
        self.hc_sinkhorn_iters = args.hc_sinkhorn_iters
        self.hc_eps = args.hc_eps
        self.attn = Attention(layer_id, args)
        self.ffn = MLP(args.dim, args.inter_dim)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        mix_hc = (2 + hc) * hc
        self.hc_attn_fn = nn.Parameter(torch.empty(mix_hc, hc * args.dim, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix_hc, hc * args.dim, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.empty(mix_hc, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.empty(mix_hc, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def hc_pre(self, x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor):
        """[b, s, hc, d] streams -> the sub-block's input [b, s, d], its output weights and the mixing."""
        shape, dtype = x.size(), x.dtype
        x = x.flatten(2).float()
        rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        mixes = F.linear(x, hc_fn) * rsqrt
        pre, post, comb = hc_split_sinkhorn(mixes, hc_scale, hc_base, self.hc_mult, self.hc_sinkhorn_iters,
                                            self.hc_eps)
        y = torch.sum(pre.unsqueeze(-1) * x.view(shape), dim=2)
        return y.to(dtype), post, comb

    def hc_post(self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """The sub-block's output [b, s, d] spread over the streams, plus the mixed residual streams."""
        y = post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
        return y.type_as(x)

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        residual = x
        x, post, comb = self.hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        x = self.attn(self.attn_norm(x), start_pos)
        x = self.hc_post(x, residual, post, comb)
        residual = x
        x, post, comb = self.hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        x = self.ffn(self.ffn_norm(x))
        return self.hc_post(x, residual, post, comb)


class Transformer(nn.Module):
    """tokens [b, s] (int64), start_pos -> logits of the last position [b, vocab] (fp32).

    A call at start_pos 0 is a prefill (a new request), any other a decode step of one token.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        if len(args.compress_ratios) != args.n_layers:
            raise ValueError(f"compress_ratios has {len(args.compress_ratios)} entries for n_layers={args.n_layers}")
        for ratio in args.compress_ratios:
            if ratio and args.max_seq_len % ratio:
                raise ValueError(f"max_seq_len={args.max_seq_len} is not a multiple of compress ratio {ratio}")
        self.max_seq_len = args.max_seq_len
        self.norm_eps = args.norm_eps
        self.hc_mult = args.hc_mult
        self.hc_eps = args.hc_eps
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.empty(args.hc_mult, args.hc_mult * args.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.empty(args.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def hc_head(self, x: torch.Tensor) -> torch.Tensor:
        """The streams [b, s, hc, d] collapsed into one [b, s, d]."""
        flat = x.flatten(2).float()
        mixes = F.linear(flat, self.hc_head_fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_head_scale + self.hc_head_base) + self.hc_eps
        return torch.sum(pre.unsqueeze(-1) * x, dim=2).type_as(x)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        h = self.embed(tokens)
        h = h.unsqueeze(2).repeat(1, 1, self.hc_mult, 1)
        for layer in self.layers:
            h = layer(h, start_pos)
        h = self.norm(self.hc_head(h))
        return self.head(h[:, -1].float())


# --------------------------------------------------------------------------- weights and sizes


def build_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """A Transformer with deterministic weights, in eval mode without gradients.

    Every parameter is drawn from one CPU ``torch.Generator(seed)`` in fp32 in parameter order:
    norm weights 1 + 0.1 N(0, 1), other vectors N(0, 1), embeddings N(0, 1), matrices
    N(0, 1) / sqrt(fan_in)."""
    model = Transformer(args)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = torch.randn(tuple(param.shape), generator=gen, dtype=torch.float32)
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            if isinstance(owner, RMSNorm):
                full = 1.0 + 0.1 * full
            elif full.dim() >= 2 and not isinstance(owner, nn.Embedding):
                full = full / math.sqrt(param.shape[-1])
            param.copy_(full.to(param.dtype))
    model.eval()
    model.requires_grad_(False)
    return model


def cache_bytes_per_token(compress_ratio: int, head_dim: int, index_head_dim: int, dcp_size: int = 1,
                          element_size: int = 2, indexer: str = "replicated") -> float:
    """Cache bytes one layer adds per token of context, on one rank.

    What grows with the context is the compressed entries (one `head_dim`-wide row per
    `compress_ratio` tokens) and, in a CSA layer (ratio 4), the indexer's compressed keys
    (`index_head_dim` wide); the window ring and the compressor's open-window state are
    bounded and add nothing per token. With DCP the entries are striped over `dcp_size`
    ranks; the indexer's keys are striped too with `indexer="striped"`, or kept whole on
    every rank with `indexer="replicated"`.
    """
    if indexer not in ("replicated", "striped"):
        raise ValueError(f"indexer must be 'replicated' or 'striped', got {indexer!r}")
    if not compress_ratio:
        return 0.0
    entries = head_dim * element_size / compress_ratio / dcp_size
    if compress_ratio != 4:
        return entries
    index_keys = index_head_dim * element_size / compress_ratio
    return entries + (index_keys / dcp_size if indexer == "striped" else index_keys)
