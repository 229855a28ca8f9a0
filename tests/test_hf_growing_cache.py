"""Hugging Face's default generate() (DynamicCache): the caches grow by torch.cat every step.

A cache that grows has no fixed size: its stripes would differ in length across ranks (every
rank must compile the same graphs) and across calls, and the model reads its length back
(`get_seq_length`) to place the next token. The pass leaves such attention unchanged, exact,
and says so once per attention in the user's terms, with what to pass instead
(`cache_implementation="static"`), whatever op of the model's the recogniser stopped at (the
Llama keys' concatenation itself, or DeepseekV3's kv_b_proj over the grown latent).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/hf_tiny.py, after the importorskip)

from dcp_pass.testing import run_ranks  # noqa: E402

PROMPTS = torch.tensor([[3, 5, 7, 9, 11, 2], [1, 2, 3, 4, 6, 8]])


def _default_generate(rank: int, world: int, names: list[str]):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.rewrites.cache_reads import GROWING_CACHE

    results = []
    for name in names:
        torch._dynamo.reset()
        with torch.no_grad():
            want = hf_tiny.tiny_model(name).generate(PROMPTS, max_new_tokens=4, do_sample=False)
            model = hf_tiny.tiny_model(name)
            backend = DcpBackend(dcp_size=world, tp_size=1, inner="eager")
            model.compile(backend=backend)
            got = model.generate(PROMPTS, max_new_tokens=4, do_sample=False)
        misses = [reason for g in backend.report.graphs for _, reason in g.near_misses]
        results.append(dict(name=name, tokens_equal=torch.equal(got, want), rewritten=backend.report.layers_rewritten,
                            misses=len(misses), growing=sum(GROWING_CACHE in r for r in misses),
                            summary=backend.report.summary()))
    return results


def test_default_generate_is_unchanged_with_the_reason():
    for rank_results in run_ranks(_default_generate, 2, ["llama_gqa", "deepseek_v3"]):
        for r in rank_results:
            assert r["tokens_equal"] and r["rewritten"] == 0, r["summary"]
            assert r["misses"] > 0 and r["growing"] == r["misses"], r["summary"]
