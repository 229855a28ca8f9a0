"""Attention written so that a rewrite would compute something else: left unchanged, with
the reason in the report, and equal to the model without DCP.

Each form was rewritten before, silently wrong (2 gloo ranks, tp_size=1, prefill of 6 tokens
then 4 decode steps, max difference to the model without DCP in brackets):

* `softmax_over_heads`: scores laid out [b, s, t, h] by the einsum, `softmax(-1)` normalising
  the heads, not the keys (1.5-2.6);
* `paged_skip_page` / `paged_half_page`: a paged read of part of its pages or of its in-page
  slots, which the striped read gathered whole (1.4-2.9);
* `flex_alpha`: a flex `score_mod` returning `torch.add(bias, score, alpha=2)`, taken as
  score + bias (0.8-1.0);
* `fill_then_scale`: `masked_fill(future, -1e4) * 1e-4`, whose masked keys reach the softmax
  at -1, taken as -inf (0.16-1.6);
* `write_between_reads`: the cache written again after the softmax, before the values are
  read (the rewrite attends over the shard as it is before the softmax: 0.15-2.0).

And a form a rewrite would have crashed on inside the pass:

* `slots_into_flat`: a flat cache `[B, T, D]` written through pool slots
  (`cache.view(-1, D)[b * T + pos] = v`, the paged write form) and read as rows by position
  (`cache[:, :end]`): the write and the read disagree about the layout (the paged write's
  rewrite failed on the flat shard with an `index_copy_` dimensionality error).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dcp_pass.testing import run_ranks

HEADS, LAT, ROPE, BATCH, LEN, PAGE = 4, 8, 4, 2, 16, 4
STEPS = [(6, 0)] + [(1, 6 + i) for i in range(4)]


class Forms(nn.Module):
    """A small absorbed-MLA attention over its own caches, in the spelling `form` names."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        if form.startswith("paged"):
            pages = BATCH * LEN // PAGE
            order = torch.randperm(pages, generator=torch.Generator().manual_seed(1))
            self.register_buffer("pool", torch.zeros(pages, PAGE, LAT + ROPE))
            self.register_buffer("table", order.view(BATCH, -1))
        else:
            self.register_buffer("kv_cache", torch.zeros(BATCH, LEN, LAT))
            self.register_buffer("pe_cache", torch.zeros(BATCH, LEN, ROPE))

    def forward(self, q, q_pe, latent, k_pe, start: int):
        end = start + q.shape[1]
        if self.form.startswith("paged"):
            return self._paged(q, q_pe, latent, k_pe, start, end)
        if self.form == "slots_into_flat":
            slots = (torch.arange(BATCH)[:, None] * LEN + torch.arange(start, end)[None, :]).flatten()
            self.kv_cache.view(-1, LAT)[slots] = latent.flatten(0, 1)
        else:
            self.kv_cache[:, start:end] = latent
        self.pe_cache[:, start:end] = k_pe
        kv, pe = self.kv_cache[:, :end], self.pe_cache[:, :end]
        if self.form == "softmax_over_heads":
            scores = (torch.einsum("bshc,btc->bsth", q, kv) + torch.einsum("bshr,btr->bsth", q_pe, pe)) * 0.3
            return torch.einsum("bsth,btc->bshc", scores.softmax(-1), kv)
        if self.form == "slots_into_flat":
            scores = torch.einsum("bshc,btc->bsht", q, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)
            future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
            probs = (scores * 0.3).masked_fill(future[None, :, None, :], float("-inf")).softmax(-1)
            return torch.einsum("bsht,btc->bshc", probs, kv)
        if self.form == "write_between_reads":
            scores = torch.einsum("bshc,btc->bsht", q, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)
            probs = (scores * 0.3).softmax(-1)
            self.kv_cache[:, start:end] = latent * 2.0
            return torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:, :end])
        if self.form == "fill_then_scale":
            scores = torch.einsum("bshc,btc->bsht", q, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)
            future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
            scores = scores.masked_fill(future[None, :, None, :], -1e4) * 1e-4
            return torch.einsum("bsht,btc->bshc", scores.softmax(-1), kv)
        from torch.nn.attention.flex_attention import flex_attention

        def twice_the_score(score, b, h, q_idx, kv_idx):
            return torch.add((kv_idx - q_idx).float() * 0.01, score, alpha=2)

        keys = torch.cat([kv, pe], -1).unsqueeze(1)
        out = flex_attention(torch.cat([q, q_pe], -1).transpose(1, 2), keys, kv.unsqueeze(1),
                             score_mod=twice_the_score, enable_gqa=True)
        return out.transpose(1, 2)

    def _paged(self, q, q_pe, latent, k_pe, start, end):
        pos = torch.arange(start, end)
        slots = (self.table[:, pos // PAGE] * PAGE + pos % PAGE).flatten()
        self.pool.view(-1, LAT + ROPE)[slots] = torch.cat([latent, k_pe], -1).flatten(0, 1)
        if self.form == "paged_skip_page":  # from the second page on
            kv = self.pool[self.table][:, 1:].flatten(1, 2)[:, :end - PAGE]
        else:  # the first half of each page
            kv = self.pool[self.table][:, :, :PAGE // 2].flatten(1, 2)[:, :(end + 1) // 2]
        probs = (torch.einsum("bshd,btd->bsht", torch.cat([q, q_pe], -1), kv) * 0.3).softmax(-1)
        return torch.einsum("bsht,btc->bshc", probs, kv[..., :LAT])


def _inputs(length, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, length, HEADS, LAT, generator=g), torch.randn(BATCH, length, HEADS, ROPE, generator=g),
            torch.randn(BATCH, length, LAT, generator=g), torch.randn(BATCH, length, ROPE, generator=g))


def _run(model):
    return [model(*_inputs(length, i), start) for i, (length, start) in enumerate(STEPS)]


def _rank(rank, world, form):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    want = _run(Forms(form))
    backend = DcpBackend(dcp_size=world, tp_size=1, inner="eager")
    got = _run(torch.compile(Forms(form), backend=backend, dynamic=False))
    rewritten = sum(g.rewritten for g in backend.report.graphs)
    return max((a - b).abs().max().item() for a, b in zip(got, want)), rewritten, backend.report.summary()


@pytest.mark.parametrize("form, reason", [
    ("softmax_over_heads", "which is not the key axis"),
    ("paged_skip_page", ""),
    ("paged_half_page", ""),
    ("flex_alpha", "score_mod applies `add` to the score"),
    ("fill_then_scale", "scaled by 0.0001 before the softmax"),
    ("write_between_reads", "kv_cache is written between its reads by this attention"),
    ("slots_into_flat", "kv_cache is written as a paged pool read through a block table (pool slots "
                        "(`pool.view(-1, D)[slots] = v`)) but read as rows by position"),
])
def test_forms_a_rewrite_would_change_are_left_unchanged(form, reason):
    for distance, rewritten, summary in run_ranks(_rank, 2, form, timeout=300):
        assert rewritten == 0, summary
        assert distance == 0.0
        assert reason in summary, summary
