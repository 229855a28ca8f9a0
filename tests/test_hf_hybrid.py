"""Hugging Face models with attention sinks, and models that interleave sliding-window and
full-attention layers, through generate(cache_implementation="static") under backend "dcp".

Tiny random GptOss (sinks: a learned logit per head in the softmax's denominator) and
Gemma3 (text), each with its real layer pattern: layer 0 slides over a 4-position window
(transformers' rolling cache: `roll`, `copy_`, a bounded tensor), layer 1 attends over the
whole context. The full layer is rewritten and its cache striped (ceil(T / c) + 1 positions a
rank); the window layer is left as it is, whole on every rank, and the report says so per
layer. HY-V4 (sinks, MLA re-expanded per head, DSA top-k 8 below the context) runs with
absorb_kv_b_proj, so the sink is folded after the projected merge. Greedy fp32 tokens equal
the uncompiled model's over 10 steps, logits within 1e-5 relative, with 6-token prompts
(longer than the window, so the window rolls). CI runs GptOss and HY-V4 at c=2;
DCP_TEST_FULL=1 adds Gemma3 and runs every model at c=4 under aot_eager too.
"""
from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/hf_tiny.py, after the importorskip)
from kit import hf  # noqa: E402

from dcp_pass import env  # noqa: E402
from dcp_pass.testing import run_ranks  # noqa: E402

FULL = env.full_tests()
# model -> (option absorb_kv_b_proj, the window layers, whether it has sinks)
MODELS = {"gpt_oss": (False, ["cache.layers.0"], True), "gemma3": (False, ["cache.layers.0"], False),
          "hy_v4": (True, [], True)}
CI_MODELS = list(MODELS) if FULL else ["gpt_oss", "hy_v4"]


def _generate(rank: int, world: int, names: list, inner: str):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.state.guards import StripedCacheTensor

    results = []
    for name in names:
        torch._dynamo.reset()
        ref = hf.generate(hf_tiny.tiny_model(name, "eager"))
        model = hf_tiny.tiny_model(name, "eager")
        backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner, absorb_kv_b_proj=MODELS[name][0])
        model.compile(backend=backend)
        out = hf.generate(model)
        caches = {}
        for (label, t), (_, r) in zip(hf.cache_tensors(out.cache), hf.cache_tensors(ref.cache)):
            own, shard = hf.held_bytes(t)
            caches[label] = dict(own=own, shard=shard, full=r.untyped_storage().nbytes(),
                                 striped=type(t) is StripedCacheTensor, positions=t.shape[2])
        layers = [(layer.layer, layer.rewritten, layer.detail) for g in backend.report.graphs for layer in g.layers]
        results.append(dict(name=name, tokens_equal=torch.equal(out.sequences, ref.sequences),
                            logits_err=hf.logits_error(out, ref), graphs=len(backend.graphs),
                            rewritten=[g.rewritten for g in backend.report.graphs], layers=layers, caches=caches))
    return results


def _check(results, c: int, names: list):
    assert [r["name"] for r in results] == names
    for r in results:
        absorb, window, sinks = MODELS[r["name"]]
        assert r["tokens_equal"], r
        assert r["logits_err"] < 1e-5, r
        full = hf_tiny.LAYERS - len(window)
        assert r["graphs"] == 2 and r["rewritten"] == [full, full], r  # prefill (allocating stripes), decode
        for layer, rewritten, detail in r["layers"]:
            if layer in window:
                assert not rewritten and "rolling (sliding-window) cache" in detail and "roll" in detail, detail
            else:
                assert rewritten, (layer, detail)
                assert ("sink after the merge" in detail) == sinks, detail
                assert ("v-projection before merge" in detail) == absorb, detail
        for label, entry in r["caches"].items():
            if label.rsplit(".", 1)[0] in {w.replace("cache.", "") for w in window}:  # whole, its own storage
                assert not entry["striped"] and entry["shard"] == 0 and entry["own"] == entry["full"], entry
            else:
                positions = entry["positions"]
                assert entry["striped"] and entry["own"] == 0, entry
                assert entry["shard"] * positions == entry["full"] * (math.ceil(positions / c) + 1), entry


@pytest.mark.slow
def test_window_and_full_layers_c2():
    for results in run_ranks(_generate, 2, CI_MODELS, "eager"):
        _check(results, 2, CI_MODELS)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="DCP_TEST_FULL=1 runs c=4")
def test_window_and_full_layers_c4():
    for results in run_ranks(_generate, 4, list(MODELS), "aot_eager"):
        _check(results, 4, list(MODELS))
