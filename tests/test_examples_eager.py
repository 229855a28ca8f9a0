"""Eager checks of the example models: variants agree, decoding loops are right, TP=2 == TP=1."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from dcp_pass.models.deepseek_mla import MLA, ModelArgs, build_model
from dcp_pass.models.generate import greedy_generate, speculative_greedy_generate
from dcp_pass.models.hybrid_linear import HybridArgs, LinearAttention, build_hybrid

VARIANTS = list(
    itertools.product(
        ["einsum", "matmul"], [False, True], ["method", "functional"], ["after_mask", "before_mask"],
        ["additive", "masked_fill"],
    )
)
ATOL = RTOL = 1e-5


def _tokens(bsz: int, seqlen: int, seed: int = 1, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (bsz, seqlen), generator=torch.Generator().manual_seed(seed))


def _prefill_decode(model, tokens: torch.Tensor, prefill: int = 6) -> list[torch.Tensor]:
    """Prefill `prefill` tokens, decode the rest one by one, then an extend (start_pos > 0)."""
    outs = [model.forward_all(tokens[:, :prefill], 0)]
    for p in range(prefill, tokens.size(1)):
        outs.append(model(tokens[:, p : p + 1], p))
    outs.append(model.forward_all(tokens[:, prefill - 2 :], prefill - 2))
    return outs


@pytest.fixture(scope="module")
def default_outputs():
    return _prefill_decode(build_model(ModelArgs()), _tokens(3, 9))


@pytest.mark.parametrize("score_impl,fused,softmax_style,scale_order,mask_style", VARIANTS)
def test_variant_matches_default(default_outputs, score_impl, fused, softmax_style, scale_order, mask_style):
    args = replace(
        ModelArgs(), score_impl=score_impl, fused_cache=fused, softmax_style=softmax_style,
        scale_order=scale_order, mask_style=mask_style,
    )
    model = build_model(args)
    attn = model.layers[0].attn
    assert attn.kv_cache.dtype == args.dtype
    if fused:
        assert tuple(attn.kv_cache.shape) == (4, 96, 32 + 8) and not hasattr(attn, "pe_cache")
    else:
        assert tuple(attn.kv_cache.shape) == (4, 96, 32) and tuple(attn.pe_cache.shape) == (4, 96, 8)
    for got, want in zip(_prefill_decode(model, _tokens(3, 9)), default_outputs):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mask_style", ["additive", "masked_fill"])
@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_chunked_positions_match_full_sequence(mask_style, q_lora_rank):
    """Prefill, extend with start_pos > 0 and decode give the logits of one full pass."""
    model = build_model(replace(ModelArgs(), mask_style=mask_style, q_lora_rank=q_lora_rank))
    tok = _tokens(2, 12, seed=5)
    full = model.forward_all(tok, 0)
    chunks = [model.forward_all(tok[:, :4], 0), model.forward_all(tok[:, 4:9], 4)]
    chunks += [model.forward_all(tok[:, p : p + 1], p) for p in range(9, 12)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(model(tok[:, 9:], 9), full[:, -1], atol=ATOL, rtol=RTOL)


def test_weights_deterministic_and_logits_order_one():
    a, b = build_model(ModelArgs(), seed=0), build_model(ModelArgs(), seed=0)
    c = build_model(ModelArgs(), seed=1)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.head.weight, c.head.weight)
    assert all(not p.requires_grad for p in a.parameters()) and not a.training
    logits = a(_tokens(2, 5), 0)
    assert logits.shape == (2, 128)
    assert 0.3 < logits.std().item() < 3.0


def _recompute_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    seq, logits = list(prompt), []
    for _ in range(n):
        last = model.forward_all(torch.tensor([seq]), 0)[0, -1]
        logits.append(last)
        seq.append(int(last.argmax()))
    return seq[len(prompt) :], logits


def _check_against_recompute(model, prompts, max_new):
    out, step_logits = greedy_generate(model, prompts, max_new)
    min_len = min(len(p) for p in prompts)
    assert len(step_logits) == max(len(p) for p in prompts) + max_new - min_len
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = _recompute_greedy(model, prompt, max_new)
        assert out[i] == ref_tokens, (i, out[i], ref_tokens)
        for j in range(max_new):
            step = len(prompt) + j - min_len  # the call that produced the token at position len + j
            torch.testing.assert_close(step_logits[step][i], ref_logits[j], atol=1e-4, rtol=1e-4)


def test_greedy_ragged_matches_recompute():
    model = build_model(ModelArgs())
    prompts = [[5, 9, 11, 3, 40], [7], [100, 2], [17, 18, 19]]
    _check_against_recompute(model, prompts, max_new=6)


def test_greedy_rejects_too_long():
    model = build_model(ModelArgs())
    with pytest.raises(ValueError, match="max_seq_len"):
        greedy_generate(model, [[1, 2, 3]], 94)


def _noisy_clone(args, seed, noise):
    model = build_model(args, seed=seed)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_greedy(k):
    args = ModelArgs()
    target = build_model(args)
    prompts = [[5, 9, 11, 3, 40], [7], [100, 2]]
    want, _ = greedy_generate(target, prompts, 10)
    drafts = {
        "same": (build_model(args), lambda s: s["accepted"] == s["proposed"]),
        "other": (build_model(replace(args, n_layers=1), seed=7), lambda s: True),
        "noisy": (_noisy_clone(args, 0, 0.3), lambda s: 0 < s["accepted"] < s["proposed"]),
    }
    for name, (draft, stats_ok) in drafts.items():
        stats: dict = {}
        got = speculative_greedy_generate(target, draft, prompts, 10, k, stats=stats)
        assert got == want, name
        assert stats_ok(stats), (name, stats)
        if name == "same":
            # every round accepts all k proposals plus one bonus token
            assert stats["rounds"] == sum(-(-10 // (k + 1)) for _ in prompts)


def test_hybrid_decode_matches_recompute():
    args = HybridArgs()
    model = build_hybrid(args)
    assert args.n_layers == 4
    kinds = [type(b.attn) for b in model.layers]
    assert kinds == [LinearAttention, MLA, LinearAttention, MLA]
    assert tuple(model.layers[0].attn.state.shape) == (4, 4, 16, 16)
    _check_against_recompute(model, [[5, 9, 11, 3], [7], [100, 2]], max_new=5)
    # chunked == full, and the state really carries over between calls
    tok = _tokens(2, 10, seed=3)
    full = model.forward_all(tok, 0)
    parts = [model.forward_all(tok[:, :4], 0), model.forward_all(tok[:, 4:7], 4)]
    parts += [model.forward_all(tok[:, p : p + 1], p) for p in range(7, 10)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=RTOL)
    assert model.layers[0].attn.state[:2].abs().sum() > 0
    with pytest.raises(ValueError, match="recurrent"):
        speculative_greedy_generate(model, build_model(ModelArgs()), [[1, 2]], 3, 2)


def test_compile_aot_eager_matches_eager():
    torch._dynamo.reset()
    eager = build_model(ModelArgs())
    compiled_model = build_model(ModelArgs())
    compiled = torch.compile(compiled_model, backend="aot_eager")
    prompts = [[5, 9, 11, 3], [7, 8], [100]]
    want_tokens, want_logits = greedy_generate(eager, prompts, 4)
    got_tokens, got_logits = greedy_generate(compiled, prompts, 4)
    assert got_tokens == want_tokens
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- TP = 2


def _tp_worker(rank, world_size, compile_too):
    tok = _tokens(3, 9)
    out = {}
    if compile_too:
        compiled = torch.compile(build_model(ModelArgs()), backend="aot_eager")
        out["compiled"] = [compiled.forward_all(tok[:, :6], 0), compiled(tok[:, 6:7], 6)]
    else:
        model = build_model(ModelArgs())  # tp_size None -> world size
        assert model.tp_size == world_size and model.tp_rank == rank
        assert model.layers[0].attn.n_local_heads == 4 // world_size
        out["mla"] = _prefill_decode(model, tok)
        out["hybrid"] = _prefill_decode(build_hybrid(HybridArgs()), tok)
    # plain arrays: tensors would travel as shared-memory handles that die with this process
    return {key: [t.numpy() for t in outs] for key, outs in out.items()}


@pytest.mark.parametrize("compile_too", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_tp2_matches_tp1(compile_too):
    """tp=2 on 2 gloo ranks computes the tp=1 function (compiled: collectives trace in dynamo)."""
    from dcp_pass.testing import run_ranks

    tok = _tokens(3, 9)
    want_mla = _prefill_decode(build_model(ModelArgs(tp_size=1)), tok)
    want_hybrid = _prefill_decode(build_hybrid(HybridArgs(tp_size=1)), tok)
    results = run_ranks(_tp_worker, 2, compile_too, timeout=300)
    for res in results:
        for key, want in (("mla", want_mla), ("hybrid", want_hybrid), ("compiled", want_mla[:2])):
            if key not in res:
                continue
            for g, w in zip(res[key], want):
                torch.testing.assert_close(torch.from_numpy(g), w, atol=ATOL, rtol=RTOL)


def test_tp_shards_are_slices_of_full_weights():
    full = build_model(ModelArgs(tp_size=1))
    shards = [build_model(ModelArgs(tp_size=2), rank=r) for r in range(2)]
    torch.testing.assert_close(torch.cat([s.head.weight for s in shards], 0), full.head.weight, atol=0, rtol=0)
    torch.testing.assert_close(
        torch.cat([s.layers[1].attn.wo.weight for s in shards], 1), full.layers[1].attn.wo.weight, atol=0, rtol=0
    )
    assert shards[0].layers[1].ffn.experts[2] is None and shards[1].layers[1].ffn.experts[0] is None
    torch.testing.assert_close(
        shards[1].layers[2].ffn.experts[3].w2.weight, full.layers[2].ffn.experts[3].w2.weight, atol=0, rtol=0
    )
