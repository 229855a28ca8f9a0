"""Hugging Face models that interleave sliding-window and full-attention layers, and
attention sinks, through generate(cache_implementation="static") under backend "dcp".

Tiny random GptOss (sinks: a learned logit per head in the softmax's denominator) and
Gemma3 (text), each with its real layer pattern: layer 0 slides over a 4-position window
(transformers' rolling cache: `roll`, `copy_`, a bounded tensor), layer 1 attends over the
whole context. The full layer is rewritten and its cache striped (ceil(T / c) + 1 positions a
rank); the window layer is left as it is, whole on every rank, and the report says so per
layer. Greedy fp32 tokens equal the uncompiled model's over 10 steps, logits within 1e-5
relative, with 6-token prompts (longer than the window, so the window rolls). CI runs c=2;
DCP_TEST_FULL=1 also runs c=4 under aot_eager.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/hf_tiny.py, after the importorskip)
from kit import hf  # noqa: E402

from dcp_pass.testing import run_ranks  # noqa: E402

FULL = os.environ.get("DCP_TEST_FULL") == "1"
MODELS = ["gpt_oss", "gemma3"]


def _generate(rank: int, world: int, names: list, inner: str):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.rewrites.cache import StripedCache

    results = []
    for name in names:
        torch._dynamo.reset()
        ref = hf.generate(hf_tiny.tiny_model(name, "eager"))
        model = hf_tiny.tiny_model(name, "eager")
        backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner)
        model.compile(backend=backend)
        out = hf.generate(model)
        caches = {}
        for (label, t), (_, r) in zip(hf.cache_tensors(out.cache), hf.cache_tensors(ref.cache)):
            own, shard = hf.held_bytes(t)
            caches[label] = dict(own=own, shard=shard, full=r.untyped_storage().nbytes(),
                                 striped=type(t) is StripedCache, positions=t.shape[2])
        layers = [(layer.layer, layer.rewritten, layer.detail) for g in backend.report.graphs for layer in g.layers]
        results.append(dict(name=name, tokens_equal=torch.equal(out.sequences, ref.sequences),
                            logits_err=hf.logits_error(out, ref), graphs=len(backend.graphs),
                            rewritten=[g.rewritten for g in backend.report.graphs], layers=layers, caches=caches))
    return results


def _check(results, c: int):
    assert [r["name"] for r in results] == MODELS
    for r in results:
        assert r["tokens_equal"], r
        assert r["logits_err"] < 1e-5, r
        assert r["graphs"] == 3 and r["rewritten"] == [0, 1, 1], r  # prefill, decode, decode striped
        for layer, rewritten, detail in r["layers"]:
            if layer == "cache.layers.0":  # the sliding-window layer
                assert not rewritten and "rolling (sliding-window) cache" in detail and "roll" in detail, detail
            else:
                assert layer == "cache.layers.1" and rewritten, (layer, detail)
                assert ("sink after the merge" in detail) == (r["name"] == "gpt_oss"), detail
        for label, entry in r["caches"].items():
            if label.startswith("layers.0."):  # whole on every rank, its own storage
                assert not entry["striped"] and entry["shard"] == 0 and entry["own"] == entry["full"], entry
            else:
                positions = entry["positions"]
                assert entry["striped"] and entry["own"] == 0, entry
                assert entry["shard"] * positions == entry["full"] * (math.ceil(positions / c) + 1), entry


@pytest.mark.slow
def test_window_and_full_layers_c2():
    for results in run_ranks(_generate, 2, MODELS, "eager"):
        _check(results, 2)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="DCP_TEST_FULL=1 runs c=4")
def test_window_and_full_layers_c4():
    for results in run_ranks(_generate, 4, MODELS, "aot_eager"):
        _check(results, 4)
