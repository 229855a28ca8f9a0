"""The matcher on its own: `find_mla` over graphs Dynamo captures, no rewrite, no process group.

As inductor's pattern tests count matches, these count matches per spelling variant and
check what each match records: the axis roles of the queries, scores and output, which
cache buffer holds the values, the scale, the masks, and the reasons of near misses.
Graphs come from a recording backend (plain Dynamo capture, nothing rewritten).
"""
from __future__ import annotations

import itertools
import unittest

import torch
import torch.fx as fx
from torch import nn

from dcp_pass.rewrites.axes import B, F, H, S, T
from dcp_pass.rewrites.match import GraphMatches, MlaMatch, find_mla
from kit.graphs import TinyMLA, TinyMLP, matches_of, tiny_inputs


def capture(model: nn.Module, *args) -> list[GraphMatches]:
    """`find_mla` of each graph Dynamo captures for one call of `model`."""
    return matches_of(model, [args])


def buffer_name(node: fx.Node) -> str:
    """`kv_cache` for Dynamo's `l_self_..._buffers_kv_cache_` placeholder (its source is gone by now)."""
    return node.name.rsplit("_buffers_", 1)[1].rstrip("_")


def example_model(seqlen: int = 1, start_pos: int = 4, **kw) -> list[GraphMatches]:
    """One attention block of dcp_pass/models/deepseek_mla.py (unsharded, one dense layer)."""
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    kw.setdefault("n_layers", 1)
    kw.setdefault("n_dense_layers", kw["n_layers"])
    model = build_model(ModelArgs(tp_size=1, **kw), rank=0)
    return capture(model, torch.zeros(2, seqlen, dtype=torch.long), start_pos)


class NearMissMLA(TinyMLA):
    """TinyMLA (split caches, additive mask) with one thing the pass cannot rewrite exactly."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q_lat, q_pe, latent, k_pe, start_pos: int, mask):
        bsz, seqlen = q_lat.shape[:2]
        end = start_pos + seqlen
        self.kv_cache[:bsz, start_pos:end] = latent
        self.pe_cache[:bsz, start_pos:end] = k_pe
        lat = torch.einsum("bshc,btc->bsht", q_lat, self.kv_cache[:bsz, :end])
        rope = torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end])
        kind = self.kind
        scores = (lat * 0.25 + rope * 0.5) if kind == "scaled_apart" else (lat + rope)
        if kind == "tensor_scale":
            scores = scores * self.w_uv.abs().mean()
        elif kind not in ("scaled_apart", "negative_mask"):
            scores = scores * 0.25
        if kind == "finite_fill":
            scores = scores.masked_fill(mask.unsqueeze(1) < 0, -1.0)
        else:
            scores = scores + mask.unsqueeze(1)
        if kind == "negative_mask":  # a negative scale after the mask flips it
            scores = scores * -0.25
        probs = scores.softmax(dim=1 if kind == "softmax_dim" else -1, dtype=torch.float32).type_as(q_lat)
        values = self.pe_cache[:bsz, :end] if kind == "values_from_pe" else self.kv_cache[:bsz, :end]
        o = torch.einsum("bsht,btc->bshc", probs, values)
        return o.flatten(2)


class MatcherTest(unittest.TestCase):
    def find(self, graphs: list[GraphMatches]) -> GraphMatches:
        self.assertEqual(len(graphs), 1)
        return graphs[0]

    def assertCanonical(self, match: MlaMatch) -> None:
        """Every spelling here builds queries [b, s, h, d] and scores [b, s, h, t]."""
        self.assertEqual(match.score_roles, [B, S, H, T])
        self.assertEqual(match.out_roles, [B, S, H, F])
        for term in match.terms:
            self.assertEqual(sorted(map(str, term.query_roles)), sorted([B, S, H, F]))

    def assertSplitCaches(self, match: MlaMatch) -> None:
        """Latent scores and values read kv_cache, the rotary term reads pe_cache."""
        self.assertEqual(len(match.terms), 2)
        latent, rope = match.terms
        self.assertIs(match.value_cache.buffer, latent.cache.buffer)
        self.assertEqual(buffer_name(match.value_cache.buffer), "kv_cache")
        self.assertEqual(buffer_name(rope.cache.buffer), "pe_cache")
        self.assertIsNot(rope.cache.buffer, match.value_cache.buffer)
        self.assertEqual(match.buffers, [latent.cache.buffer, rope.cache.buffer])

    def assertFusedCache(self, match: MlaMatch, rank: int) -> None:
        """One latent||rotary cache: one score term; values are its first `rank` columns."""
        self.assertEqual(len(match.terms), 1)
        self.assertIs(match.value_cache.buffer, match.terms[0].cache.buffer)
        self.assertEqual(buffer_name(match.value_cache.buffer), "kv_cache")
        self.assertEqual(match.value_cache.feat, (0, rank))
        self.assertEqual(match.buffers, [match.value_cache.buffer])

    # ------------------------------------------------------------------ TinyMLA

    def test_tiny_variants(self):
        for fused, mask in itertools.product((False, True), (None, "additive", "bool")):
            with self.subTest(fused=fused, mask=mask):
                seqlen, start = (1, 5) if mask is None else (3, 2)
                found = self.find(capture(TinyMLA(fused=fused, mask_fill=mask == "bool"),
                                          *tiny_inputs(seqlen, start, mask)))
                self.assertEqual(len(found.matches), 1)
                self.assertEqual(found.near_misses, [])
                match = found.matches[0]
                self.assertCanonical(match)
                self.assertEqual(match.scale, 0.25)
                self.assertEqual(match.v_dim, 8)
                self.assertEqual(match.out_dtype, torch.float32)
                if fused:
                    self.assertFusedCache(match, rank=8)
                else:
                    self.assertSplitCaches(match)
                for term in match.terms:
                    self.assertEqual(term.query_roles, [B, S, H, F])
                # the writes of the matched buffers: one per cache buffer
                self.assertEqual(len(match.writes), 1 if fused else 2)
                self.assertEqual(sorted(found.writes, key=lambda n: n.name), sorted(match.buffers, key=lambda n: n.name))
                if mask is None:
                    self.assertEqual(match.masks, [])
                else:
                    self.assertEqual(len(match.masks), 1)
                    self.assertEqual(match.masks[0].kind, "bool" if mask == "bool" else "additive")
                    self.assertEqual(match.masks[0].multiplier, 1.0)
                    # [s, t] mask unsqueezed at 1: [s, 1, t], right-aligned with [b, s, h, t] (a head-broadcast axis)
                    self.assertEqual(match.masks[0].roles, [S, H, T])

    def test_near_miss_probs_leak(self):
        found = self.find(capture(TinyMLA(leak_probs=True), *tiny_inputs(1, 5)))
        self.assertEqual(found.matches, [])
        self.assertEqual(len(found.near_misses), 1)
        where, reason = found.near_misses[0]
        self.assertIn("softmax", where)
        self.assertEqual(reason, "attention probabilities are used outside the value product")
        self.assertEqual(len(found.writes), 2)  # the writes are still found (the pass refuses them later)

    def test_near_miss_reasons(self):
        # one near miss per stage of match_softmax: scores, score layout, value contraction, masks
        cases = {
            "finite_fill": "masked_fill with value -1.0 on the attention scores (only -inf-like fills are exact) "
                           "(at test_match.py:",
            "tensor_scale": "the attention scores are scaled by a tensor; only constant scales are supported",
            "softmax_dim": "the softmax runs over dim 1 of rank-4 scores; only the last (key) axis is supported",
            "scaled_apart": "the score terms are scaled differently ([0.25, 0.5])",
            "negative_mask": "a mask is multiplied by a non-positive scale (at test_match.py:",
        }
        for kind, reason in cases.items():
            with self.subTest(kind=kind):
                seqlen, start = (3, 2)
                found = self.find(capture(NearMissMLA(kind), *tiny_inputs(seqlen, start, "additive")))
                self.assertEqual(found.matches, [])
                self.assertEqual(len(found.near_misses), 1, found.near_misses)
                self.assertIn(reason, found.near_misses[0][1])

    def test_values_from_the_rotary_cache_match_with_that_cache_as_latent(self):
        # scores are a sum, so which cache holds the values only decides which term is "latent"
        found = self.find(capture(NearMissMLA("values_from_pe"), *tiny_inputs(3, 2, "additive")))
        self.assertEqual(found.near_misses, [])
        (match,) = found.matches
        self.assertEqual(buffer_name(match.value_cache.buffer), "pe_cache")
        self.assertEqual(match.v_dim, 4)

    def test_no_cache_no_match(self):
        found = self.find(capture(TinyMLP(), torch.randn(3, 8)))
        self.assertEqual((found.matches, found.near_misses, found.writes), ([], [], {}))

    def test_softmax_without_cache_is_ignored(self):
        class Gate(nn.Module):  # an MoE-style gate: a softmax that touches no cache
            def forward(self, x):
                return x.softmax(dim=-1) @ x.transpose(0, 1)

        found = self.find(capture(Gate(), torch.randn(4, 4)))
        self.assertEqual((found.matches, found.near_misses), ([], []))

    # ------------------------------------------------------------------ dcp_pass/models/deepseek_mla.py

    def test_example_variants(self):
        axes_ = itertools.product(("einsum", "matmul"), (False, True), ("additive", "masked_fill"),
                                  ("after_mask", "before_mask"))
        for score_impl, fused, mask_style, scale_order in axes_:
            kw = dict(score_impl=score_impl, fused_cache=fused, mask_style=mask_style, scale_order=scale_order)
            with self.subTest(**kw):
                found = self.find(example_model(seqlen=4, start_pos=0, **kw))  # prefill: with a mask
                self.assertEqual(found.near_misses, [])
                self.assertEqual(len(found.matches), 1)
                match = found.matches[0]
                self.assertEqual(match.layer, "layers.0.attn")
                self.assertCanonical(match)
                self.assertAlmostEqual(match.scale, (16 + 8) ** -0.5)
                self.assertEqual(match.v_dim, 32)
                if fused:
                    self.assertFusedCache(match, rank=32)
                else:
                    self.assertSplitCaches(match)
                self.assertEqual(len(match.masks), 1)
                self.assertEqual(match.masks[0].kind, "additive" if mask_style == "additive" else "bool")
                self.assertEqual(match.masks[0].roles, [S, H, T])

    def test_example_decode_without_mask(self):
        for score_impl, fused in itertools.product(("einsum", "matmul"), (False, True)):
            with self.subTest(score_impl=score_impl, fused=fused):
                found = self.find(example_model(score_impl=score_impl, fused_cache=fused))
                self.assertEqual(len(found.matches), 1)
                self.assertEqual(found.matches[0].masks, [])
                self.assertCanonical(found.matches[0])

    def test_example_layers_each_match(self):
        # two dense layers in one graph: one match per layer, each with its own caches
        found = self.find(example_model(n_layers=2))
        self.assertEqual(len(found.matches), 2)
        self.assertEqual([m.layer for m in found.matches], ["layers.0.attn", "layers.1.attn"])
        first, second = found.matches
        self.assertFalse(set(first.buffers) & set(second.buffers))
        self.assertEqual(len(found.writes), 4)


if __name__ == "__main__":
    unittest.main()
