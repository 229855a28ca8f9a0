"""Small absorbed-MLA decoders written the ways researchers write attention today.

One model, one set of weights, several spellings of the same attention (`form`): the
compile pass must give each of them DCP, and each must compute what the others compute.
It knows nothing about DCP; like the DeepSeek reference it takes `(tokens, start_pos)`
with an int position, writes a latent cache (kv_lora_rank) and a rotary cache per
token, folds the key half of `wkv_b` into the query and applies the value half after
attention.

Forms:
  "einsum"          the reference: einsum scores over two caches, softmax, einsum values
  "sdpa"            F.scaled_dot_product_attention; q = cat(q_abs, q_pe), k = cat(kv, pe)
                    expanded over heads, v = kv expanded, a boolean attn_mask
  "sdpa_gqa"        the same with the one latent head unexpanded and enable_gqa=True, an
                    additive mask, the default scale
  "sdpa_causal"     is_causal=True for a prefill from position 0 (a mask for later chunks)
  "mqa_matmul"      one fused cache [B, T, 1, D] as a single kv head, torch.matmul broadcast
                    over the query heads
  "fused_unsqueeze" one fused cache [B, T, D] read as `cache[:b, :end].unsqueeze(1)`, values
                    `kv[..., :rank]` (views in the other order than the reference)
  "window"          the reference with a sliding window: `cache[:b, lo:end]`
  "paged"           a pool [pages, P, D] and a block table (pages handed out in a shuffled
                    order), slot-mapping writes `pool.view(-1, D)[slots] = kv`, reads
                    `pool[table[:b]].flatten(1, 2)[:, :end]`
  "flex"            flex_attention with a score_mod masking keys after each query's global
                    position, enable_gqa over the one latent head
  "sink"            the reference with a learned sink logit per head, as gpt-oss writes it:
                    softmax over cat([scores, sinks], -1) minus its row max, the sink's
                    column dropped from the probabilities
  "flex_sink"       the "flex" form asking for the LSE (return_aux lse) and folding a sink
                    logit per head in afterwards: o * sigmoid(lse - sink)

`build_forms_model(args, seed)` draws the same weights for every form.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FormArgs", "FORMS", "FormsModel", "build_forms_model"]

FORMS = ("einsum", "sdpa", "sdpa_gqa", "sdpa_causal", "mqa_matmul", "fused_unsqueeze", "window", "paged", "flex",
         "sink", "flex_sink")
SINK_FORMS = ("sink", "flex_sink")  # forms with a learned sink logit per head (`Attention.sinks`)


@dataclass
class FormArgs:
    form: str = "einsum"
    vocab_size: int = 96
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 8
    v_head_dim: int = 8
    max_batch_size: int = 4
    max_seq_len: int = 48
    window: int = 8  # the "window" form: each query sees its last `window` positions
    page_size: int = 8  # the "paged" form
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {self.form!r}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on pairs of the last axis (x [b, s, ..., d], cos/sin [s, d/2])."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    shape = (1, cos.shape[0]) + (1,) * (x.dim() - 3) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: FormArgs):
        super().__init__()
        self.args = args
        self.form = args.form
        h, r, v = args.n_heads, args.kv_lora_rank, args.v_head_dim
        nope, rope = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.n_heads, self.rank, self.rope = h, r, rope
        self.softmax_scale = (nope + rope) ** -0.5
        self.wq = nn.Linear(args.dim, h * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(args.dim, r + rope, bias=False)
        self.kv_norm = RMSNorm(r)
        self.wkv_b = nn.Linear(r, h * (nope + v), bias=False)
        self.wo = nn.Linear(h * v, args.dim, bias=False)
        b, t = args.max_batch_size, args.max_seq_len
        if self.form == "mqa_matmul":
            self.register_buffer("kv_cache", torch.zeros(b, t, 1, r + rope), persistent=False)
        elif self.form == "fused_unsqueeze":
            self.register_buffer("kv_cache", torch.zeros(b, t, r + rope), persistent=False)
        elif self.form == "paged":
            per_request = -(-t // args.page_size)
            order = torch.randperm(b * per_request, generator=torch.Generator().manual_seed(11))
            self.register_buffer("kv_pool", torch.zeros(b * per_request, args.page_size, r + rope), persistent=False)
            self.register_buffer("block_table", order.view(b, per_request), persistent=False)
        else:
            self.register_buffer("kv_cache", torch.zeros(b, t, r), persistent=False)
            self.register_buffer("pe_cache", torch.zeros(b, t, rope), persistent=False)
        if self.form in SINK_FORMS:  # drawn by build_forms_model after every other weight
            self.sinks = nn.Parameter(torch.zeros(h))

    def forward(self, x, start_pos: int, cos, sin, mask: Optional[torch.Tensor]):
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        a = self.args
        h, r = self.n_heads, self.rank
        q = self.wq(x).view(bsz, seqlen, h, a.qk_nope_head_dim + a.qk_rope_head_dim)
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        q_pe = rotate(q_pe, cos, sin)
        kv = self.wkv_a(x)
        latent, k_pe = kv.split([r, a.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_pe = rotate(k_pe.unsqueeze(2), cos, sin).squeeze(2)
        wkv_b = self.wkv_b.weight.view(h, -1, r)
        q_abs = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : a.qk_nope_head_dim])
        o = getattr(self, f"_{self.form}")(q_abs, q_pe, latent, k_pe, start_pos, end, mask)  # [b, s, h, r]
        o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, -a.v_head_dim:])
        return self.wo(o.flatten(2))

    # -- the forms -------------------------------------------------------------

    def _write_split(self, latent, k_pe, start_pos, end):
        bsz = latent.shape[0]
        self.kv_cache[:bsz, start_pos:end] = latent
        self.pe_cache[:bsz, start_pos:end] = k_pe

    def _einsum(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        bsz = q_abs.shape[0]
        self._write_split(latent, k_pe, start_pos, end)
        scores = (torch.einsum("bshc,btc->bsht", q_abs, self.kv_cache[:bsz, :end])
                  + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end])) * self.softmax_scale
        if mask is not None:
            scores = scores + mask.unsqueeze(1)
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_abs)
        return torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:bsz, :end])

    def _sink(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        bsz, seqlen = q_abs.shape[:2]
        self._write_split(latent, k_pe, start_pos, end)
        scores = (torch.einsum("bshc,btc->bsht", q_abs, self.kv_cache[:bsz, :end])
                  + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end])) * self.softmax_scale
        if mask is not None:
            scores = scores + mask.unsqueeze(1)
        sinks = self.sinks.view(1, 1, -1, 1).expand(bsz, seqlen, -1, 1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = combined.softmax(dim=-1, dtype=torch.float32)[..., :-1].type_as(q_abs)
        return torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:bsz, :end])

    def _window(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        bsz = q_abs.shape[0]
        self._write_split(latent, k_pe, start_pos, end)
        lo = max(0, end - self.args.window - q_abs.shape[1] + 1)
        scores = (torch.einsum("bshc,btc->bsht", q_abs, self.kv_cache[:bsz, lo:end])
                  + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, lo:end])) * self.softmax_scale
        if mask is not None:
            scores = scores + mask[:, lo:].unsqueeze(1)
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_abs)
        return torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:bsz, lo:end])

    def _sdpa_operands(self, q_abs, q_pe, start_pos, end, expand: bool):
        bsz, _, h, _ = q_abs.shape
        q = torch.cat([q_abs, q_pe], dim=-1).transpose(1, 2)  # [b, h, s, r + rope]
        k = torch.cat([self.kv_cache[:bsz, :end], self.pe_cache[:bsz, :end]], dim=-1).unsqueeze(1)
        v = self.kv_cache[:bsz, :end].unsqueeze(1)
        if expand:
            k = k.expand(bsz, h, end, k.shape[-1])
            v = v.expand(bsz, h, end, self.rank)
        return q, k, v

    def _sdpa(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        self._write_split(latent, k_pe, start_pos, end)
        q, k, v = self._sdpa_operands(q_abs, q_pe, start_pos, end, expand=True)
        keep = None if mask is None else mask.isfinite()  # True where a key is visible
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        return o.transpose(1, 2)

    def _sdpa_gqa(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        self._write_split(latent, k_pe, start_pos, end)
        q, k, v = self._sdpa_operands(q_abs, q_pe, start_pos, end, expand=False)
        # the default scale, 1/sqrt(r + rope): a different (but fixed) function of the weights
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2)

    def _sdpa_causal(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        self._write_split(latent, k_pe, start_pos, end)
        q, k, v = self._sdpa_operands(q_abs, q_pe, start_pos, end, expand=True)
        if start_pos == 0 and q.shape[2] > 1:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return o.transpose(1, 2)

    def _mqa_matmul(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        bsz = q_abs.shape[0]
        self.kv_cache[:bsz, start_pos:end] = torch.cat([latent, k_pe], dim=-1).unsqueeze(2)
        q = torch.cat([q_abs, q_pe], dim=-1).transpose(1, 2)  # [b, h, s, d]
        kv = self.kv_cache[:bsz, :end].transpose(1, 2)  # [b, 1, t, d]: one kv head
        scores = torch.matmul(q, kv.transpose(-1, -2)) * self.softmax_scale  # broadcast over heads
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores.float(), dim=-1).type_as(q)
        return torch.matmul(probs, kv[..., : self.rank]).transpose(1, 2)

    def _paged(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        bsz, seqlen = q_abs.shape[:2]
        page = self.args.page_size
        table = self.block_table[:bsz]
        pos = torch.arange(start_pos, end, device=q_abs.device)
        slots = (table[:, pos // page] * page + pos % page).flatten()  # [b * s] pool slots
        self.kv_pool.view(-1, self.kv_pool.shape[-1])[slots] = torch.cat([latent, k_pe], dim=-1).flatten(0, 1)
        kv = self.kv_pool[table].flatten(1, 2)[:, :end]  # the request's pages in order: [b, end, d]
        q = torch.cat([q_abs, q_pe], dim=-1)
        scores = torch.einsum("bshd,btd->bsht", q, kv) * self.softmax_scale
        if mask is not None:
            scores = scores + mask.unsqueeze(1)
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q)
        return torch.einsum("bsht,btc->bshc", probs, kv[..., : self.rank])

    def _flex(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        from torch.nn.attention.flex_attention import flex_attention

        self._write_split(latent, k_pe, start_pos, end)
        q, k, v = self._sdpa_operands(q_abs, q_pe, start_pos, end, expand=False)

        def causal(score, b, h, q_idx, kv_idx):  # query i sits at global position start_pos + i
            return torch.where(q_idx + start_pos >= kv_idx, score, -float("inf"))

        o = flex_attention(q, k, v, score_mod=causal, scale=self.softmax_scale, enable_gqa=True)
        return o.transpose(1, 2)

    def _flex_sink(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        self._write_split(latent, k_pe, start_pos, end)
        q, k, v = self._sdpa_operands(q_abs, q_pe, start_pos, end, expand=False)

        def causal(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx + start_pos >= kv_idx, score, -float("inf"))

        o, aux = flex_attention(q, k, v, score_mod=causal, scale=self.softmax_scale, enable_gqa=True,
                                return_aux=AuxRequest(lse=True))
        # the sink joins the denominator: o * e^lse / (e^lse + e^sink) = o * sigmoid(lse - sink)
        keep = torch.sigmoid(aux.lse - self.sinks.view(1, -1, 1))  # [b, h, s]
        return (o * keep.unsqueeze(-1)).transpose(1, 2)

    def _fused_unsqueeze(self, q_abs, q_pe, latent, k_pe, start_pos, end, mask):
        bsz = q_abs.shape[0]
        self.kv_cache[:bsz, start_pos:end] = torch.cat([latent, k_pe], dim=-1)
        kv = self.kv_cache[:bsz, :end].unsqueeze(1)  # [b, 1, t, d]
        q = torch.cat([q_abs, q_pe], dim=-1)  # [b, s, h, d]
        scores = torch.einsum("bshd,bxtd->bsht", q, kv) * self.softmax_scale
        if mask is not None:
            scores = scores.masked_fill(~mask.isfinite().unsqueeze(1), float("-inf"))
        probs = F.softmax(scores, dim=-1)
        return torch.einsum("bsht,bxtc->bshc", probs, kv[..., : self.rank])


class Block(nn.Module):
    def __init__(self, args: FormArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim)
        self.attn = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.w1 = nn.Linear(args.dim, 2 * args.dim, bias=False)
        self.w2 = nn.Linear(2 * args.dim, args.dim, bias=False)

    def forward(self, x, start_pos: int, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), start_pos, cos, sin, mask)
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class FormsModel(nn.Module):
    """tokens [b, s], start_pos -> logits of the last position [b, vocab]."""

    def __init__(self, args: FormArgs):
        super().__init__()
        self.args = args
        self.max_seq_len = args.max_seq_len
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([Block(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        half = args.qk_rope_head_dim // 2
        freqs = 1.0 / (args.rope_theta ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def _mask(self, seqlen: int, start_pos: int, device) -> Optional[torch.Tensor]:
        if seqlen <= 1:
            return None
        mask = torch.full((seqlen, start_pos + seqlen), float("-inf"), device=device).triu_(start_pos + 1)
        if self.args.form == "window":  # each query sees its last `window` positions
            keys = torch.arange(start_pos + seqlen, device=device)
            rows = torch.arange(start_pos, start_pos + seqlen, device=device)
            mask = mask.masked_fill(keys[None, :] <= rows[:, None] - self.args.window, float("-inf"))
        return mask

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        seqlen = tokens.size(1)
        x = self.embed(tokens)
        cos, sin = self.rope_cos[start_pos:start_pos + seqlen], self.rope_sin[start_pos:start_pos + seqlen]
        mask = self._mask(seqlen, start_pos, tokens.device)
        for layer in self.layers:
            x = layer(x, start_pos, cos, sin, mask)
        return self.head(self.norm(x)[:, -1])


def build_forms_model(args: FormArgs, seed: int = 0, device=None) -> FormsModel:
    """The same weights for every form (drawn from the same generator in the same order)."""
    torch.manual_seed(seed)
    model = FormsModel(replace(args))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        for name, p in model.named_parameters():  # after the rest: every other weight is the same
            if name.endswith(".sinks"):
                p.normal_()
    return model.to(device=device, dtype=args.dtype) if device is not None else model.to(dtype=args.dtype)
