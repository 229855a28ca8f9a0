"""Hugging Face's caches that grow (generate()'s default DynamicCache, and the QuantizedCache).

A cache that grows has no fixed size: its stripes would differ in length across ranks (every
rank must compile the same graphs) and across calls, and the model reads its length back
(`get_seq_length`) to place the next token. The pass leaves such attention unchanged, exact,
and says so once per attention in the user's terms, by the cache class, with what to pass
instead (`cache_implementation="static"`), whatever op of the model's the recogniser stopped
at (the Llama keys' concatenation itself, or DeepseekV3's kv_b_proj over the grown latent).

The QuantizedCache (backend "quanto", optimum-quanto) dequantizes all of its rows at every
step and concatenates its full-precision residual and the new rows; quanto's quantization
breaks the graph, so only the steps that do not quantize compile whole. Its residual starts
empty (a 1-D tensor, not a cache the recognisers know): the reason is still the cache's. With
nothing rewritten, rank 0 warns once, with that reason.

A DynamicCache's sliding-window layer (Gemma3's layer 0) is bounded by its window: its reason
says so and advises nothing.

`cache_implementation="offloaded"` needs CUDA (transformers calls torch.cuda's streams): off a
GPU the compiled model raises transformers' own error, as the eager one does.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/hf_tiny.py, after the importorskip)

from dcp_pass.testing import run_ranks  # noqa: E402

PROMPTS = torch.tensor([[3, 5, 7, 9, 11, 2], [1, 2, 3, 4, 6, 8]])
# the residual holds 2 rows: the first decode step appends to an empty residual, without quantizing
QUANTIZED = dict(cache_implementation="quantized",
                 cache_config={"backend": "quanto", "nbits": 4, "residual_length": 2, "q_group_size": 16})


def _generate(rank: int, world: int, names: list[str], kwargs: dict, new_tokens: int):
    import warnings

    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    results = []
    for name in names:
        torch._dynamo.reset()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want = hf_tiny.tiny_model(name).generate(PROMPTS, max_new_tokens=new_tokens, do_sample=False, **kwargs)
            model = hf_tiny.tiny_model(name)
            backend = DcpBackend(dcp_size=world, tp_size=1, inner="eager")
            model.compile(backend=backend)
            got = model.generate(PROMPTS, max_new_tokens=new_tokens, do_sample=False, **kwargs)
        results.append(dict(name=name, tokens_equal=torch.equal(got, want), rewritten=backend.report.layers_rewritten,
                            misses=[reason for g in backend.report.graphs for _, reason in g.near_misses],
                            warnings=[str(w.message) for w in caught if str(w.message).startswith("dcp_pass:")],
                            summary=backend.report.summary()))
    return results


def test_default_generate_is_unchanged_with_the_reason():
    from dcp_pass.rewrites.cache_reads import GROWING_CACHE

    for rank_results in run_ranks(_generate, 2, ["llama_gqa", "deepseek_v3"], {}, 4):
        for r in rank_results:
            assert r["tokens_equal"] and r["rewritten"] == 0, r["summary"]
            assert r["misses"] and all(GROWING_CACHE in m for m in r["misses"]), r["summary"]


def _offloaded_off_gpu() -> list:
    """generate(cache_implementation="offloaded") eagerly, then compiled: each one's error."""
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch._dynamo.reset()
    errors = []
    for compiled in (False, True):
        model = hf_tiny.tiny_model("llama_gqa")
        if compiled:
            model.compile(backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
        try:
            with torch.no_grad():
                model.generate(PROMPTS, max_new_tokens=2, do_sample=False, cache_implementation="offloaded")
            errors.append(None)
        except Exception as e:  # transformers' own error, the same with and without the pass
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def _quantized_then_offloaded(rank: int, world: int):
    results = _generate(rank, world, ["deepseek_v3"], QUANTIZED, 2)
    offloaded = None if torch.cuda.is_available() else _offloaded_off_gpu()
    return results, offloaded


def test_quantized_cache_is_unchanged_with_its_reason_and_offloaded_needs_a_gpu():
    """The quantized cache (DeepseekV3; Llama's GQA gives the same two lines), and off a GPU the
    offloaded cache's own error, with or without the pass (one pair of ranks for both)."""
    pytest.importorskip("optimum.quanto")
    from dcp_pass.rewrites.cache_reads import GROWING_QUANTIZED_CACHE

    for rank, (rank_results, offloaded) in enumerate(run_ranks(_quantized_then_offloaded, 2)):
        for r in rank_results:
            assert r["tokens_equal"] and r["rewritten"] == 0, r["summary"]
            # one per attention layer of the decode graph
            assert len(r["misses"]) == 2 and all(GROWING_QUANTIZED_CACHE in m for m in r["misses"]), r["summary"]
            assert all("cache_utils.py" in m and "torch.cat" in m for m in r["misses"]), r["misses"]
            if rank == 0:
                assert len(r["warnings"]) == 1 and GROWING_QUANTIZED_CACHE in r["warnings"][0], r["warnings"]
            else:
                assert not r["warnings"], r["warnings"]
        if offloaded is not None:  # off a GPU (tests/test_hf_offloaded_cache.py runs it on one)
            eager, compiled = offloaded
            assert eager is not None and "CUDA" in eager, eager
            assert compiled is not None and "CUDA" in compiled and "dcp_pass" not in compiled, (eager, compiled)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_dynamic_cache_window_layer_is_said_bounded(name):
    """Gemma3 and gpt-oss under generate()'s default: the sliding-window layer's
    DynamicSlidingWindowLayer keeps the last sliding_window - 1 rows (bounded, nothing to
    stripe), the full layer's DynamicLayer grows; each layer of each decode graph gets its own
    line, and nothing else does (gpt-oss's MoE router, a softmax over its top-k logits, is not
    attention), the recognition alone, no process group."""
    import torch._dynamo

    from dcp_pass.rewrites.cache_reads import GROWING_CACHE, GROWING_WINDOW_CACHE
    from dcp_pass.rewrites.match import find_mla

    found = []

    def record(gm, example_inputs):
        found.append(find_mla(gm.graph))
        return gm.forward

    prompts = torch.tensor([[3, 5, 7, 9, 11, 2, 4, 6], [1, 2, 3, 4, 6, 8, 5, 7]])  # past the window of 4
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = hf_tiny.tiny_model(name, attn_implementation="eager").generate(
                prompts, max_new_tokens=2, do_sample=False)
            model = hf_tiny.tiny_model(name, attn_implementation="eager")
            model.compile(backend=record)
            got = model.generate(prompts, max_new_tokens=2, do_sample=False)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    decode = [f for f in found if f.near_misses]
    assert decode and not any(f.matches for f in found)
    for f in decode:
        reasons = [reason for _, reason in f.near_misses]
        assert len(reasons) == 2, f.near_misses  # layer 0 sliding, layer 1 full
        assert GROWING_WINDOW_CACHE in reasons[0] and "static" not in reasons[0], reasons
        assert GROWING_CACHE in reasons[1], reasons
