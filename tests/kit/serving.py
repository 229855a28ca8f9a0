"""An absorbed-MLA decoder written the way serving code writes a ragged batch.

Each request owns one row of the caches. Prefill runs one request at a time and writes
its row, `kv_cache[row:row + 1, :s] = latent`; decode runs the whole batch at once with
per-request positions `pos` ([B] long), writes `kv_cache[arange(B), pos] = latent[:, 0]`
and reads the whole cache under a mask built from each request's length. Rotary angles
come from the positions (a gather per request). `fused`: one latent||rotary cache
instead of two.

`serve(model, prompts, steps)`: per-row prefill of every prompt, then `steps` batched
decode steps; the greedy tokens and every call's logits.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on pairs of the last axis; cos/sin broadcast against x[..., d/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ServingAttention(nn.Module):
    def __init__(self, dim, heads, rank, nope, rope, v_dim, batch, max_seq, fused: bool):
        super().__init__()
        self.heads, self.rank, self.nope, self.rope, self.v_dim, self.fused = heads, rank, nope, rope, v_dim, fused
        self.scale = (nope + rope) ** -0.5
        self.wq = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(dim, rank + rope, bias=False)
        self.kv_norm = _Norm(rank)
        self.wkv_b = nn.Linear(rank, heads * (nope + v_dim), bias=False)
        self.wo = nn.Linear(heads * v_dim, dim, bias=False)
        if fused:
            self.register_buffer("kv_cache", torch.zeros(batch, max_seq, rank + rope), persistent=False)
        else:
            self.register_buffer("kv_cache", torch.zeros(batch, max_seq, rank), persistent=False)
            self.register_buffer("pe_cache", torch.zeros(batch, max_seq, rope), persistent=False)

    def forward(self, x, cos, sin, pos: Optional[torch.Tensor], row: Optional[int]):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = _rotate(q_pe, cos[:, :, None], sin[:, :, None])
        latent, k_pe = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        k_pe = _rotate(k_pe, cos, sin)
        wkv_b = self.wkv_b.weight.view(self.heads, -1, self.rank)
        q_abs = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : self.nope])
        if row is not None:  # prefill of one request: its row, positions 0..s-1, causal
            if self.fused:
                self.kv_cache[row:row + 1, :seqlen] = torch.cat([latent, k_pe], dim=-1)
                kv = self.kv_cache[row:row + 1, :seqlen]
                keys, pes = kv[..., : self.rank], kv[..., self.rank:]
            else:
                self.kv_cache[row:row + 1, :seqlen] = latent
                self.pe_cache[row:row + 1, :seqlen] = k_pe
                keys, pes = self.kv_cache[row:row + 1, :seqlen], self.pe_cache[row:row + 1, :seqlen]
            idx = torch.arange(seqlen, device=x.device)
            hidden = (idx[None, :] > idx[:, None])[None, :, None, :]  # [1, s, 1, t]: keys after each query
        else:  # decode of the whole batch: request b at position pos[b], the whole cache under a mask
            batch = torch.arange(bsz, device=x.device)
            if self.fused:
                self.kv_cache[batch, pos] = torch.cat([latent, k_pe], dim=-1)[:, 0]
                kv = self.kv_cache[:bsz]
                keys, pes = kv[..., : self.rank], kv[..., self.rank:]
            else:
                self.kv_cache[batch, pos] = latent[:, 0]
                self.pe_cache[batch, pos] = k_pe[:, 0]
                keys, pes = self.kv_cache[:bsz], self.pe_cache[:bsz]
            slots = torch.arange(self.kv_cache.shape[1], device=x.device)
            hidden = (slots[None, :] > pos[:, None])[:, None, None, :]  # [b, 1, 1, T]: past each request's end
        scores = (torch.einsum("bshc,btc->bsht", q_abs, keys) + torch.einsum("bshr,btr->bsht", q_pe, pes)) * self.scale
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1, dtype=torch.float32).type_as(q_abs)
        o = torch.einsum("bsht,btc->bshc", probs, keys)
        o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, -self.v_dim:])
        return self.wo(o.flatten(2))


class ServingMLA(nn.Module):
    """`model(tokens [1, s], row=r)`: prefill of request r; `model(tokens [B, 1], pos)`: a decode step.
    Returns the logits of each row's last token, [rows, vocab]."""

    def __init__(self, vocab=64, dim=32, layers=2, heads=4, rank=16, nope=8, rope=8, v_dim=8, batch=4,
                 max_seq=32, fused=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList([ServingAttention(dim, heads, rank, nope, rope, v_dim, batch, max_seq, fused)
                                   for _ in range(layers)])
        self.mlp = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.SiLU(),
                                                nn.Linear(2 * dim, dim, bias=False)) for _ in range(layers)])
        self.norm = _Norm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        half = rope // 2
        freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), freqs)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))

    def forward(self, tokens, pos: Optional[torch.Tensor] = None, row: Optional[int] = None):
        x = self.embed(tokens)
        if row is not None:
            cos, sin = self.rope_cos[None, : tokens.shape[1]], self.rope_sin[None, : tokens.shape[1]]
        else:
            cos, sin = self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]  # [b, 1, d/2]
        for attn, mlp in zip(self.attn, self.mlp):
            x = x + attn(x, cos, sin, pos, row)
            x = x + mlp(x)
        return self.head(self.norm(x)[:, -1])


@torch.no_grad()
def serve(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per-row prefill of each prompt, then `steps` decode steps of the whole batch (greedy)."""
    logits, last = [], []
    for r, prompt in enumerate(prompts):
        out = model(torch.tensor([prompt]), row=r)
        logits.append(out.float().clone())
        last.append(out.argmax(-1))
    tokens = torch.cat(last)[:, None]  # [B, 1]
    pos = torch.tensor([len(p) for p in prompts])
    generated = [[int(t)] for t in tokens[:, 0]]
    for _ in range(steps):
        out = model(tokens, pos)
        logits.append(out.float().clone())
        tokens = out.argmax(-1, keepdim=True)
        pos = pos + 1
        for g, t in zip(generated, tokens[:, 0]):
            g.append(int(t))
    return generated, logits


__all__ = ["ServingMLA", "serve"]
