"""A softmax that contracts no cache rows through its scores is not an attention near miss.

After an attention layer every hidden state depends on the cache, so an MoE router
(`softmax(linear(h))`), a Sinkhorn normalisation of a small mixing matrix (softmax over
dim -2 and -1 in turn) and pooling weights over a state's slots (a buffer read with no
product) all depend on it too; none of them is attention and none is listed as a near
miss. The attention itself still matches.
"""
from __future__ import annotations

import torch
from kit.graphs import matches_of
from torch import nn


class AttentionThenRouters(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(2, 16, 8))
        self.register_buffer("pe_cache", torch.zeros(2, 16, 4))
        self.register_buffer("slot_state", torch.zeros(2, 4, 6))
        self.gate = nn.Linear(24, 5, bias=False)
        self.mix = nn.Parameter(torch.randn(24, 16))
        self.w_uv = nn.Parameter(torch.randn(4, 6, 8))

    def forward(self, q, q_pe, latent, k_pe, start: int):
        end = start + q.shape[1]
        self.kv_cache[:, start:end] = latent
        self.pe_cache[:, start:end] = k_pe
        kv, pe = self.kv_cache[:, :end], self.pe_cache[:, :end]
        scores = (torch.einsum("bshc,btc->bsht", q, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)) * 0.3
        o = torch.einsum("bsht,btc->bshc", scores.softmax(-1), kv)
        h = torch.einsum("bshc,hdc->bshd", o, self.w_uv).flatten(2)
        router = self.gate(h).softmax(-1)
        mixing = (h @ self.mix).view(*h.shape[:2], 4, 4)
        for _ in range(2):
            mixing = mixing.softmax(-1).log().softmax(-2).log()
        pool = (self.slot_state + h[:, -1:, :6]).softmax(dim=1)
        return h * router.sum(-1, keepdim=True) + mixing.exp().sum() + (pool * self.slot_state).sum()


def test_router_sinkhorn_and_pooling_softmaxes_are_not_near_misses():
    g = torch.Generator().manual_seed(0)
    calls = [(torch.randn(2, s, 4, 8, generator=g), torch.randn(2, s, 4, 4, generator=g),
              torch.randn(2, s, 8, generator=g), torch.randn(2, s, 4, generator=g), start)
             for s, start in [(5, 0), (1, 5)]]
    for found in matches_of(AttentionThenRouters(), calls):
        assert len(found.matches) == 1 and found.near_misses == [], found.near_misses


class AttentionThenHyperConnections(nn.Module):
    """DeepSeek-V4's spellings after an attention: a mixing matrix from a linear map scaled by the
    hidden state's RMS statistic (`rsqrt(x.square().mean(-1, keepdim=True))`) through sigmoid and
    a softmax, and pooling weights concatenated from two halves of a state buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(2, 16, 8))
        self.register_buffer("pe_cache", torch.zeros(2, 16, 4))
        self.register_buffer("score_state", torch.zeros(2, 8, 12))
        self.fn = nn.Parameter(torch.randn(8, 24))
        self.w_uv = nn.Parameter(torch.randn(4, 6, 8))

    def forward(self, q, q_pe, latent, k_pe, start: int):
        end = start + q.shape[1]
        self.kv_cache[:, start:end] = latent
        self.pe_cache[:, start:end] = k_pe
        kv, pe = self.kv_cache[:, :end], self.pe_cache[:, :end]
        scores = (torch.einsum("bshc,btc->bsht", q, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)) * 0.3
        o = torch.einsum("bsht,btc->bshc", scores.softmax(-1), kv)
        h = torch.einsum("bshc,hdc->bshd", o, self.w_uv).flatten(2)
        mixes = torch.nn.functional.linear(h, self.fn) * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6)
        gate = torch.sigmoid(mixes[..., :4])
        comb = mixes[..., 4:].unflatten(-1, (2, 2)).softmax(-1)
        halves = torch.cat([self.score_state[:, :4, :6], self.score_state[:, 4:, 6:]], dim=1)
        pool = halves.softmax(dim=1)
        return h * gate.sum(-1, keepdim=True) + comb.sum() + pool.sum()


def test_norm_statistics_and_state_halves_are_not_near_misses():
    g = torch.Generator().manual_seed(1)
    calls = [(torch.randn(2, s, 4, 8, generator=g), torch.randn(2, s, 4, 4, generator=g),
              torch.randn(2, s, 8, generator=g), torch.randn(2, s, 4, generator=g), start)
             for s, start in [(5, 0), (1, 5)]]
    for found in matches_of(AttentionThenHyperConnections(), calls):
        assert len(found.matches) == 1 and found.near_misses == [], found.near_misses
