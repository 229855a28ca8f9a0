"""The DeepSeek-V4-style model (window ring + compressed entries + indexer + sinks in one buffer per
layer): its pure-torch kernels, decode against one prefill, the cache bytes per token, torch.compile
against eager, and what the pass does with it under DCP; transformers' DeepseekV4ForCausalLM with
its dynamic caches."""
from __future__ import annotations

import sys
import warnings
from dataclasses import replace

import pytest
import torch

from dcp_pass import env
from dcp_pass.models import deepseek_v4 as v4
from dcp_pass.models.deepseek_v4 import ModelArgs, build_model
from dcp_pass.testing import run_ranks

RTOL = 1e-5
VOCAB = ModelArgs().vocab_size


def _tokens(bsz: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (bsz, seqlen), generator=torch.Generator().manual_seed(seed))


def _generate(model, tokens: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """Logits of a prefill of `prompt` tokens, then of one decode step per remaining token."""
    outs = [model(tokens[:, :prompt], 0)]
    for p in range(prompt, tokens.size(1)):
        outs.append(model(tokens[:, p:p + 1], p))
    return outs


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# --------------------------------------------------------------------------- kernels


def test_sparse_attn_equals_gathering_the_chosen_rows():
    g = torch.Generator().manual_seed(0)
    b, s, h, d, n, k = 2, 3, 4, 8, 10, 5
    q, kv = torch.randn(b, s, h, d, generator=g), torch.randn(b, n, d, generator=g)
    sink = torch.randn(h, generator=g)
    idxs = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b * s)]).view(b, s, k)
    idxs[0, 0, :2] = -1  # nothing chosen in two slots
    idxs[1, 2, :] = -1  # a query that sees no row: the sink alone, the output 0
    got = v4.sparse_attn(q, kv, sink, idxs, 0.3)
    want = torch.zeros_like(got)
    for i in range(b):
        for j in range(s):
            rows = idxs[i, j][idxs[i, j] >= 0]
            scores = torch.cat([q[i, j] @ kv[i, rows].T * 0.3, sink[:, None]], dim=-1)
            want[i, j] = scores.softmax(-1)[:, :-1] @ kv[i, rows]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not bool(got[1, 2].any())


def test_sinkhorn_mixing_is_doubly_stochastic():
    g = torch.Generator().manual_seed(1)
    hc = 3
    pre, post, comb = v4.hc_split_sinkhorn(torch.randn(2, 5, (2 + hc) * hc, generator=g), torch.rand(3, generator=g),
                                           torch.randn((2 + hc) * hc, generator=g), hc, 30, 1e-6)
    assert pre.shape == post.shape == (2, 5, hc) and comb.shape == (2, 5, hc, hc)
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, 5, hc), rtol=0, atol=1e-4)
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, hc), rtol=0, atol=1e-4)
    assert bool((post > 0).all() and (post < 2).all() and (pre > 0).all())


def test_window_and_compressed_index_lists():
    # decode at position 5 (window 8): ring rows 0..5 hold positions 0..5, the rest nothing yet
    assert v4.get_window_topk_idxs(8, 1, 1, 5).tolist() == [[[0, 1, 2, 3, 4, 5, -1, -1]]]
    # prefill of 3 with window 2: query i reads keys i - 1 and i
    assert v4.get_window_topk_idxs(2, 1, 3, 0).tolist() == [[[-1, 0], [0, 1], [1, 2]]]
    # HCA at ratio 2, prefill of 5 (2 entries), offset 5: query t sees entries w < (t + 1) // 2
    assert v4.get_compress_topk_idxs(2, 1, 5, 0, 5).tolist() == [[[-1, -1], [5, -1], [5, -1], [5, 6], [5, 6]]]
    assert v4.get_compress_topk_idxs(2, 1, 1, 6, 8).tolist() == [[[8, 9, 10]]]


# --------------------------------------------------------------------------- eager model


@pytest.mark.parametrize("prompt", [1, 6, 17])
def test_decode_equals_one_prefill(prompt):
    """A prefill of `prompt` tokens then decode steps to 21 tokens gives the last position the same
    logits as one prefill of all 21: the ring, the compressors' open windows (shorter than a
    window, across the window's end, the CSA overlap) and the indexer's cache agree with the
    prefill's own keys and entries. (21 tokens: 5 CSA entries for a top-4 indexer, 1 HCA entry.)"""
    torch.set_grad_enabled(False)
    try:
        model = build_model(ModelArgs())
        tokens = _tokens(2, 21)
        want = model(tokens, 0)
        got = _generate(model, tokens, prompt)[-1]
    finally:
        torch.set_grad_enabled(True)
    assert _rel(got, want) < RTOL, _rel(got, want)


def test_buffers_hold_the_ring_then_the_entries():
    args = ModelArgs()
    with torch.no_grad():
        model = build_model(args)
        _generate(model, _tokens(2, 22), 13)
    win = args.window_size
    for layer, ratio in zip(model.layers, args.compress_ratios):
        rows = layer.attn.kv_cache[:2].abs().sum(-1) > 0
        entries = 22 // ratio if ratio else 0
        assert bool(rows[:, :win + entries].all()) and not bool(rows[:, win + entries:].any()), (ratio, rows)
        assert not bool(layer.attn.kv_cache[2:].any())  # rows of the batch not used
    index_rows = model.layers[1].attn.indexer.kv_cache[:2].abs().sum(-1) > 0
    assert bool(index_rows[:, :5].all()) and not bool(index_rows[:, 5:].any())


def test_the_indexer_drops_entries():
    """With index_topk below the CSA entries the logits change; ignoring the indexer would not."""
    tokens = _tokens(2, 21)
    with torch.no_grad():
        sparse = build_model(ModelArgs())(tokens, 0)
        dense = build_model(replace(ModelArgs(), index_topk=ModelArgs().max_seq_len))(tokens, 0)
    assert _rel(sparse, dense) > 1e-3


def test_cache_bytes_per_token_for_v4_flash_widths():
    """V4-Flash's widths (bf16 entries of 512 columns, indexer keys of 128, 21 CSA and 20 HCA
    layers, window layers bounded): 6880 B per token over the model without DCP; at c = 8 the
    entries striped and the indexer replicated give 2036 B, the indexer striped too 860 B."""
    def model_bytes(c: int, indexer: str) -> float:
        csa = v4.cache_bytes_per_token(4, 512, 128, c, indexer=indexer)
        hca = v4.cache_bytes_per_token(128, 512, 128, c, indexer=indexer)
        return 21 * csa + 20 * hca + 2 * v4.cache_bytes_per_token(0, 512, 128, c)

    assert v4.cache_bytes_per_token(4, 512, 128) == 320 and v4.cache_bytes_per_token(128, 512, 128) == 8
    assert v4.cache_bytes_per_token(4, 512, 128, 8) == 96 and v4.cache_bytes_per_token(128, 512, 128, 8) == 1
    assert v4.cache_bytes_per_token(4, 512, 128, 8, indexer="striped") == 40
    assert model_bytes(1, "replicated") == 6880
    assert model_bytes(8, "replicated") == 2036 and model_bytes(8, "striped") == 860
    with pytest.raises(ValueError, match="indexer"):
        v4.cache_bytes_per_token(4, 512, 128, 8, indexer="sharded")


@pytest.mark.skipif(not env.full_tests(), reason="DCP_TEST_FULL=1 (the DCP test compares the compiled model too)")
def test_compile_equals_eager():
    tokens = _tokens(2, 8)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = _generate(build_model(ModelArgs()), tokens, 6)
            got = _generate(torch.compile(build_model(ModelArgs()), backend="aot_eager"), tokens, 6)
    finally:
        torch._dynamo.reset()
    for step, (g, w) in enumerate(zip(got, want)):
        assert _rel(g, w) < RTOL, (step, _rel(g, w))


# ----------------------------------------------------------------------------- under DCP


def _dcp_rank(rank: int, world: int, inner: str, prompts: list[int], steps: int):
    """The unmodified model compiled with backend="dcp" (tp_size 1) against eager, over several
    requests (one shorter than the DCP group); what the report says; the warning rank 0 gives."""
    import dcp_pass

    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    eager, model = build_model(ModelArgs()), build_model(ModelArgs())
    compiled = torch.compile(model, backend="dcp", options={"dcp_size": world, "tp_size": 1, "inner": inner})
    rel, tokens_equal = 0.0, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed, prompt in enumerate(prompts):
            tokens = _tokens(2, prompt + steps, seed)
            for got, want in zip(_generate(compiled, tokens, prompt), _generate(eager, tokens, prompt)):
                rel = max(rel, _rel(got, want))
                tokens_equal &= torch.equal(got.argmax(-1), want.argmax(-1))
    report = dcp_pass.last_report()
    torch._dynamo.reset()
    decode = [g for g in report.graphs if g.layers]
    return {
        "rel": rel, "tokens_equal": tokens_equal, "rewritten": report.layers_rewritten,
        "decode_graphs": len(decode), "graphs": len(report.graphs),
        "near_misses": [m for g in report.graphs for m in g.near_misses],
        "reasons": {g.unchanged_reason for g in decode},
        "kept": sorted({layer.layer for g in decode for layer in g.layers if not layer.rewritten}),
        "warnings": [str(w.message) for w in caught if "dcp_pass" in str(w.message)],
        "summary": str(report),
    }


@pytest.mark.slow
# CI: inner "eager" (every layer is kept, so the inner compiler sees the graph Dynamo made; the
# ring's write makes a graph per ring slot, each an aot trace under aot_eager); the rest under
# DCP_TEST_FULL=1
@pytest.mark.parametrize("world, inner", [(2, "eager")] + (
    [(2, "aot_eager"), (4, "aot_eager"), (2, "inductor"), (4, "inductor")] if env.full_tests() else []))
def test_under_dcp_unchanged_exact_with_one_reason(world, inner):
    """Each attention's buffer is a window ring (written at start_pos % window) followed by the
    compressed entries: the pass keeps every layer as it is, exact, and says why once per graph
    in the model's terms (the ring's source line); the hyper-connections' Sinkhorn softmax and
    the compressors' pooling softmax are not attention near misses; rank 0 warns once."""
    for rank, r in enumerate(run_ranks(_dcp_rank, world, inner, [6, 1], 2, timeout=1500)):
        assert r["rel"] < RTOL and r["tokens_equal"], r["rel"]
        assert r["rewritten"] == 0 and r["decode_graphs"] > 0, r["summary"]
        assert r["near_misses"] == [], r["summary"]
        assert r["kept"] == ["layers.0.attn", "layers.1.attn", "layers.2.attn"], r["summary"]
        assert len(r["reasons"]) == 1, r["reasons"]
        reason = r["reasons"].pop()
        assert "layers.0.attn.kv_cache is written as a ring of 8 rows" in reason, reason
        assert "deepseek_v4.py" in reason and "start_pos % win" in reason, reason
        assert len(r["warnings"]) == (1 if rank == 0 else 0), r["warnings"]


# ----------------------------------------------------------------------------- transformers' V4


def test_hf_deepseek_v4_dynamic_cache_is_one_reason_per_attention():
    """transformers' DeepseekV4ForCausalLM has only dynamic caches (they grow by torch.cat): every
    near miss of every graph is that reason, one per attention layer that reads a cache (the
    sliding, CSA and HCA layers), none from the hyper-connections' Sinkhorn softmax, the
    compressors' pooling softmaxes or the MoE router."""
    pytest.importorskip("transformers")
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import hf_tiny

    from dcp_pass.rewrites.match import GROWING_CACHE, find_mla

    prompts = torch.tensor([[3, 5, 7, 9, 11, 2, 4, 6, 8, 10], [1, 2, 3, 4, 6, 8, 5, 7, 9, 12]])
    found = []

    def record(gm, example_inputs):
        found.append(find_mla(gm.graph))
        return gm.forward

    model = hf_tiny.tiny_model("deepseek_v4", attn_implementation="eager")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = hf_tiny.tiny_model("deepseek_v4", attn_implementation="eager").generate(
                prompts, max_new_tokens=2, do_sample=False)
            model.compile(backend=record)
            got = model.generate(prompts, max_new_tokens=2, do_sample=False)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    decode = [f for f in found if f.near_misses]
    assert decode and all(not f.matches for f in found)
    for f in decode:
        assert len(f.near_misses) == 3 and all(GROWING_CACHE in reason for _, reason in f.near_misses), f.near_misses
        assert all("modeling_deepseek_v4.py" in where and "softmax" in where for where, _ in f.near_misses)
