"""Hugging Face models through `flex_attention` over per-head K/V, under backend "dcp" on 2 gloo ranks.

* Llama (GQA) with `attn_implementation="flex_attention"`, Hugging Face's own flex path (a
  BlockMask whose mask_mod holds the causal and padding conditions): both layers rewritten
  as the per-head flex form, exact.
* gpt-oss (sinks, layer 0 sliding-window, layer 1 full) through a flex path that returns the
  LSE and folds the sink in afterwards (`o * exp(lse - logaddexp(lse, s))`). Hugging Face's
  own flex path refuses sinks on CPU ("Attention sinks cannot be run on CPU with flex
  attention": it asks flex for the LSE only off the CPU), so the test registers that path
  under another name, with Hugging Face's flex mask. The full layer is rewritten and the
  model's sink fold reads the merged LSE, so the sink counts once, after the merge; the
  window layer keeps its rolling cache whole.

Greedy fp32 tokens equal the uncompiled model's over 8 steps, logits within 1e-5.
"""
from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/hf_tiny.py, after the importorskip)
from kit import hf  # noqa: E402

from dcp_pass import env  # noqa: E402
from dcp_pass.testing import run_ranks  # noqa: E402

FLEX_LSE = "flex_lse_sinks"  # the attention implementation registered below


def flex_with_sinks(module, query, key, value, attention_mask, scaling=None, s_aux=None, **_):
    """flex_attention with the LSE returned, the sink (one logit per head) folded in after the call."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations.flex_attention import get_flex_attention_lse_kwargs

    out = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True,
                         **get_flex_attention_lse_kwargs(True))
    out, lse = out if not hasattr(out[1], "lse") else (out[0], out[1].lse)
    if s_aux is not None:
        total = torch.logaddexp(lse, s_aux.view(1, -1, 1).to(lse.dtype))
        out = out * torch.exp(lse - total).unsqueeze(-1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(FLEX_LSE, flex_with_sinks)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FLEX_LSE, ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"])


def _run(rank: int, world: int, runs: list):
    import torch
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.state.guards import StripedCacheTensor

    _register()
    results = []
    for name, impl in runs:
        torch._dynamo.reset()
        ref = hf.generate(hf_tiny.tiny_model(name, impl), new_tokens=8)
        model = hf_tiny.tiny_model(name, impl)
        backend = DcpBackend(dcp_size=world, tp_size=1, inner="eager")
        model.compile(backend=backend)
        out = hf.generate(model, new_tokens=8)
        caches = {}
        for (label, t), (_, r) in zip(hf.cache_tensors(out.cache), hf.cache_tensors(ref.cache)):
            own, shard = hf.held_bytes(t)
            caches[label] = dict(own=own, shard=shard, full=r.untyped_storage().nbytes(),
                                 striped=type(t) is StripedCacheTensor, positions=t.shape[2])
        results.append(dict(
            run=(name, impl), tokens_equal=torch.equal(out.sequences, ref.sequences),
            logits_err=hf.logits_error(out, ref), graphs=len(backend.graphs),
            rewritten=[g.rewritten for g in backend.report.graphs],
            layers=[(layer.layer, layer.rewritten, layer.detail) for g in backend.report.graphs for layer in g.layers],
            caches=caches))
    return results


# CI runs gpt-oss (the per-head flex rewrite with the model reading the merged LSE, a sink and a
# window layer kept); Llama through HF's own flex path under DCP_TEST_FULL=1 (its match is pinned
# without ranks below)
RUNS = ([("llama_gqa", "flex_attention")] if env.full_tests() else []) + [("gpt_oss", FLEX_LSE)]


@pytest.mark.slow
def test_per_head_flex_c2():
    for results in run_ranks(_run, 2, RUNS):
        assert [r["run"] for r in results] == RUNS
        for r in results:
            name = r["run"][0]
            window = ["cache.layers.0"] if name == "gpt_oss" else []
            full = hf_tiny.LAYERS - len(window)
            assert r["tokens_equal"] and r["logits_err"] < 1e-5, r
            assert r["graphs"] == 2 and r["rewritten"] == [full, full], r
            for layer, rewritten, detail in r["layers"]:
                if layer in window:
                    assert not rewritten and "rolling (sliding-window) cache" in detail, detail
                else:
                    assert rewritten and "per-head flex form" in detail, detail
            for label, entry in r["caches"].items():
                if "cache." + label.rsplit(".", 1)[0] in window:  # whole, its own storage
                    assert not entry["striped"] and entry["shard"] == 0 and entry["own"] == entry["full"], entry
                else:
                    positions = entry["positions"]
                    assert entry["striped"] and entry["own"] == 0, entry
                    assert entry["shard"] * positions == entry["full"] * (math.ceil(positions / 2) + 1), entry


def test_per_head_flex_matches():
    """The decode graph of Llama's flex path: both layers match the per-head flex form, no near miss."""
    from dcp_pass.rewrites.match import find_mla

    found = [find_mla(gm.graph) for gm, _ in hf.capture_graphs(hf_tiny.tiny_model("llama_gqa", "flex_attention"))]
    assert [[m.family for m in f.matches] for f in found] == [[], ["per-head flex"] * hf_tiny.LAYERS], found
    assert not [m for f in found for m in f.near_misses], found
