"""The recognisers on their own (no process group): what each records for each form of
dcp_pass.models.mla_forms, and that a match does not depend on the order of views.

Graphs come from a recording backend (plain Dynamo capture, nothing rewritten); `find_mla`
runs inside it, as in the pass.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from dcp_pass.models.mla_forms import FORMS, FormArgs, build_forms_model
from dcp_pass.rewrites.cache_kinds import FLAT, PAGED
from dcp_pass.rewrites.axes import B, F, H, S, T
from dcp_pass.rewrites.match import GraphMatches
from kit.graphs import matches_of as capture


def form_matches(form: str, start: int = 12) -> list[GraphMatches]:
    model = build_forms_model(FormArgs(form=form, n_layers=1), seed=0)
    tokens = torch.randint(0, 96, (2, start + 1), generator=torch.Generator().manual_seed(0))
    return capture(model, [(tokens[:, :start], 0), (tokens[:, start:], start)])


EXPECTED = {  # form -> (recogniser, score terms, cache kind, windowed, causal in prefill)
    "einsum": ("softmax", 2, "flat", False, False),
    "sdpa": ("sdpa", 2, "flat", False, False),
    "sdpa_gqa": ("sdpa", 2, "flat", False, False),
    "sdpa_causal": ("sdpa", 2, "flat", False, True),
    "mqa_matmul": ("softmax", 1, "flat", False, False),
    "fused_unsqueeze": ("softmax", 1, "flat", False, False),
    "window": ("softmax", 2, "flat", True, False),
    "paged": ("softmax", 1, "paged", False, False),
    "flex": ("flex", 2, "flex", False, False),
    "sink": ("softmax", 2, "flat", False, False),
    "flex_sink": ("flex", 2, "flex", False, False),
}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_matches_prefill_and_decode(form):
    family, n_terms, kind, windowed, causal = EXPECTED[form]
    prefill, decode = form_matches(form)
    for found, is_prefill in ((prefill, True), (decode, False)):
        assert found.near_misses == [], found.near_misses
        (match,) = found.matches
        assert match.family == family
        assert len(match.terms) == n_terms
        # every read and write holds its kind's record (compared by identity, not by name)
        assert match.value_cache.kind is (PAGED if kind == "paged" else FLAT)
        assert all(t.cache.kind is match.value_cache.kind for t in match.terms)
        assert all(w.kind is match.value_cache.kind for w in match.writes)
        assert (match.mask_builder is not None) == (kind == "flex")  # flex's score_mod becomes a mask
        assert match.value_cache.windowed == (windowed and not is_prefill)  # the window starts past 0 in decode
        assert match.causal == (causal and is_prefill)
        assert match.v_dim == 16 and match.out_dtype == torch.float32
        assert sorted(map(str, match.out_roles)) == sorted([B, S, H, F])
        assert sorted(map(str, match.score_roles)) == sorted([B, S, H, T])
        assert match.layer == "layers.0.attn"
        assert len(match.writes) == (2 if n_terms == 2 else 1)
        # the concatenated sink is the match's; flex_sink's model folds its sink in from the LSE
        assert (match.sink is not None) == (form == "sink")
        assert len(match.lse_outputs) == (form == "flex_sink")


def test_sdpa_masks_are_keep_or_additive():
    prefill, _ = form_matches("sdpa")
    assert [m.kind for m in prefill.matches[0].masks] == ["keep"]  # a boolean attn_mask keeps where True
    prefill, _ = form_matches("sdpa_gqa")
    assert [m.kind for m in prefill.matches[0].masks] == ["additive"]
    assert prefill.matches[0].scale == pytest.approx(24 ** -0.5)  # SDPA's default: 1/sqrt(query features)


class ViewOrderMLA(nn.Module):
    """Fused-cache MQA attention whose key operand is built by `order`'s views in that order."""

    def __init__(self, order: tuple[str, ...], values_from_keys: bool):
        super().__init__()
        self.order, self.values_from_keys = order, values_from_keys
        self.register_buffer("kv_cache", torch.zeros(3, 16, 12))

    def forward(self, q, kv, start: int):
        b, s = q.shape[0], q.shape[2]
        end = start + s
        self.kv_cache[:b, start:end] = kv
        x, roles = self.kv_cache, [B, T, F]
        for op in self.order:
            if op == "batch":
                x = x[(slice(None),) * roles.index(B) + (slice(None, b),)]
            elif op == "positions":
                x = x[(slice(None),) * roles.index(T) + (slice(None, end),)]
            elif op == "head":
                x = x.unsqueeze(1)
                roles.insert(1, "h")
            elif op == "transpose":
                i, j = roles.index(T), roles.index(F)
                x = x.transpose(i, j)
                roles[i], roles[j] = roles[j], roles[i]
            elif op == "cast":
                x = x.float()
        if "head" not in self.order:
            x = x.unsqueeze(1)
            roles.insert(1, "h")
        keys = x.permute(*[roles.index(r) for r in (B, "h", F, T)])  # [b, 1, d, t]
        scores = torch.matmul(q, keys) * 0.3
        probs = scores.softmax(dim=-1)
        k_rows = keys.transpose(-1, -2)
        values = k_rows[..., :8] if self.values_from_keys else self.kv_cache[:b, :end, :8].unsqueeze(1)
        return torch.matmul(probs, values)


def test_match_does_not_depend_on_view_order():
    q = torch.randn(2, 4, 1, 12)
    kv = torch.randn(2, 1, 12)
    records = set()
    orders = list(itertools.permutations(("batch", "positions", "head", "transpose")))
    for i, order in enumerate(orders):
        order = order[:i % 5] + ("cast",) + order[i % 5:]  # a dtype cast somewhere in every chain
        for values_from_keys in (False, True):
            (found,) = capture(ViewOrderMLA(order, values_from_keys), [(q, kv, 5)])
            assert found.near_misses == [], (order, found.near_misses)
            (match,) = found.matches
            key, value = match.terms[0].cache, match.value_cache
            records.add((len(match.terms), key.bsz, key.start, key.end, key.feat, value.feat, match.v_dim,
                         tuple(match.out_roles)))
    assert records == {(1, 2, 0, 6, None, (0, 8), 8, (B, H, S, F))}, records


class SoftCapFlex(nn.Module):
    """flex_attention with tanh soft-capping: not a bias, so not a mask."""

    def __init__(self):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(2, 16, 12))

    def forward(self, q, kv, start: int):
        from torch.nn.attention.flex_attention import flex_attention

        b, end = q.shape[0], start + q.shape[2]
        self.kv_cache[:b, start:end] = kv
        k = self.kv_cache[:b, :end].unsqueeze(1)

        def soft_cap(score, b, h, q_idx, kv_idx):
            return 30.0 * torch.tanh(score / 30.0)

        return flex_attention(q, k, k[..., :8], score_mod=soft_cap, enable_gqa=True)


def test_flex_score_mod_that_is_not_a_bias_is_a_near_miss_naming_the_op():
    (found,) = capture(SoftCapFlex(), [(torch.randn(2, 4, 1, 12), torch.randn(2, 1, 12), 5)])
    assert found.matches == []
    (where, reason), = found.near_misses
    assert "score_mod applies `truediv` to the score (at test_match_forms.py:" in reason, reason


class SinkSpellings(nn.Module):
    """Single-latent-head attention with a sink logit per head, in one of several spellings."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.register_buffer("kv_cache", torch.zeros(2, 16, 12))
        self.sinks = nn.Parameter(torch.randn(4))

    def forward(self, q, kv, start: int):
        b, end = q.shape[0], start + q.shape[1]
        self.kv_cache[:b, start:end] = kv
        scores = torch.einsum("bshc,btc->bsht", q, self.kv_cache[:b, :end]) * 0.25
        sink = self.sinks.view(1, 1, 4, 1).expand(b, q.shape[1], 4, 1)
        if self.spelling == "first":  # the sink column first, dropped as probs[..., 1:]
            combined = torch.cat([sink, scores], dim=-1)
            probs = combined.softmax(-1)[..., 1:]
        elif self.spelling == "max_values_detached":
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values.detach()
            probs = torch.softmax(combined, dim=-1)[:, :, :, :-1]
        elif self.spelling == "kept_column":  # the sink's column is not dropped: not a sink
            combined = torch.cat([scores, sink], dim=-1)
            probs = combined.softmax(-1)
            return torch.einsum("bsht,btc->bshc", probs[..., 1:], self.kv_cache[:b, :end, :8])
        elif self.spelling == "from_the_cache":  # a "sink" computed from the cache: not a sink
            sink = self.kv_cache[:b, :1, :4].unsqueeze(-1).expand(b, q.shape[1], 4, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:b, :end, :8])


@pytest.mark.parametrize("spelling", ["first", "max_values_detached"])
def test_sink_spellings_match(spelling):
    (found,) = capture(SinkSpellings(spelling), [(torch.randn(2, 1, 4, 12), torch.randn(2, 1, 12), 5)])
    assert found.near_misses == [], found.near_misses
    (match,) = found.matches
    assert match.sink is not None and match.sink.roles == match.score_roles
    assert match.sink.node.name.startswith("sink") or "expand" in match.sink.node.name


@pytest.mark.parametrize("spelling, reason", [
    ("kept_column", "not followed by dropping that column"),
    ("from_the_cache", "computed from a cache"),
])
def test_sink_lookalikes_are_near_misses(spelling, reason):
    (found,) = capture(SinkSpellings(spelling), [(torch.randn(2, 1, 4, 12), torch.randn(2, 1, 12), 5)])
    assert found.matches == []
    (where, why), = found.near_misses
    assert reason in why and "test_match_forms.py:" in why, why
