"""Hugging Face static caches are never full-size on any rank, prefill included.

`generate(cache_implementation="static")` allocates the StaticCache's tensors inside the
compiled prefill; under backend "dcp" that graph allocates each rank's stripe instead
(rewrites/allocation.py). On gloo ranks, tiny fp32 models (tests/hf_tiny.py):

* right after a prefill-only generate (max_new_tokens=1) the memory behind the cache
  tensors and their shards on each rank is ceil(T / c) + 1 of the T positions (at most
  1/c of the full cache plus the spare row and the rounding row), at c = 2 and c = 4 (it
  follows a longer generate, so that Hugging Face keeps the cache length and the prefill
  graph stays static-shape: a prefill compiled for any cache length allocates at full size);
* no CPU allocation of a full cache tensor's size happens on any rank during the whole run,
  prefill included (the profiler records every allocation);
* greedy tokens equal the model without DCP over 12 decode steps, with left-padded ragged
  prompts, prompts shorter than c and chunked prefill (`prefill_chunk_size`: the chunks after
  the first read the striped prefix), and with unpadded prompts, whose HF SDPA prefill is
  causal over the first positions of the raw cache (GQA through enable_gqa).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/hf_tiny.py, after the importorskip)

from dcp_pass.testing import run_ranks  # noqa: E402

PAD = 0
# lengths 7, 3 and 1 (left-padded): at c = 4 the last two are shorter than c
RAGGED = [[3, 5, 7, 9, 11, 2, 6], [1, 2, 3], [4]]
EVEN = [[3, 5, 7, 9, 11, 2, 6], [1, 2, 3, 8, 4, 4, 2]]  # no padding: HF's SDPA prefill is causal over the prompt
PROMPTS = {"ragged": RAGGED, "even": EVEN}
# 12 decode steps after the prefill's token; T = 7 + 13 - 1 = 19 positions, prime: no shard holds a whole
# fraction of the full cache's rows at c = 2 or 4, and no other tensor of these runs has a full cache tensor's size
NEW_TOKENS = 13


def _batch(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate(model, prompts, new_tokens, **kwargs):
    ids, mask = _batch(prompts)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static", return_dict_in_generate=True, pad_token_id=PAD,
                              **kwargs)


def _cache_bytes(cache) -> tuple[int, int, list[int]]:
    """(memory behind the cache tensors and their shards on this rank, their full size, the
    full size of each tensor)."""
    from dcp_pass.state.memory import held_nbytes
    from dcp_pass.state.store import lookup_local_cache

    held = full = 0
    sizes = []
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            entry = lookup_local_cache(t)
            held += held_nbytes(t) + (held_nbytes(entry.local) if entry is not None else 0)
            full += t.numel() * t.element_size()
            sizes.append(t.numel() * t.element_size())
    return held, full, sizes


def _allocations(prof) -> list[int]:
    """Byte sizes of every CPU allocation the profiler saw."""
    return [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]


def _run(rank: int, world: int, runs: list):
    """Per run (model, attention, inner compiler, prefill chunk, prompts): the allocations of a generate
    and its tokens against the model without DCP, then the cache bytes after a prefill-only
    generate."""
    import torch._dynamo
    from torch.profiler import ProfilerActivity, profile

    from dcp_pass.backend import DcpBackend

    results = []
    for name, impl, inner, chunk, which in runs:
        extra = dict(prefill_chunk_size=chunk) if chunk else {}
        prompts = PROMPTS[which]
        torch._dynamo.reset()
        want = _generate(hf_tiny.tiny_model(name, impl), prompts, NEW_TOKENS, **extra)
        model = hf_tiny.tiny_model(name, impl)
        backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner)
        model.compile(backend=backend)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            got = _generate(model, prompts, NEW_TOKENS, **extra)
        _, _, sizes = _cache_bytes(got.cache)
        seen = _allocations(prof)
        del got.cache
        # Hugging Face keeps the longer cache length of the generate before: the same prefill graph
        prefill_only = _generate(model, prompts, 1, **extra)
        held, full, _ = _cache_bytes(prefill_only.cache)
        positions = prefill_only.cache.layers[0].keys.shape[2]
        results.append(dict(run=(name, impl, inner, chunk, which), held=held, full=full, positions=positions,
                            full_tensor_allocations=[n for n in seen if n in set(sizes)], largest=max(seen),
                            tokens_equal=torch.equal(got.sequences, want.sequences),
                            graphs=len(backend.graphs), rewritten=[g.rewritten for g in backend.report.graphs],
                            reasons=[g.unchanged_reason for g in backend.report.graphs]))
    return results


def _check(results, c: int, runs: list):
    assert [r["run"] for r in results] == runs
    for r in results:
        assert r["tokens_equal"], r
        # every graph rewrites its attention layers, prefill (and each chunk) included
        assert all(n > 0 for n in r["rewritten"]), r
        positions = r["positions"]
        assert r["held"] * positions == r["full"] * (math.ceil(positions / c) + 1), r
        assert r["held"] <= r["full"] / c + 2 * r["full"] / positions, r
        assert r["full_tensor_allocations"] == [], r


# (model, attention implementation, inner compiler, prefill chunk, prompts): per-head K/V (Llama,
# GQA) and K/V re-expanded from the latent (DeepseekV3), the mask path of both implementations
# (padded prompts), SDPA's causal prefill over the raw cache (enable_gqa), chunked prefill, and
# the inner compiler's path (aot_eager)
RUNS_C2 = [("deepseek_v3", "sdpa", "aot_eager", 4, "ragged")]
RUNS_C4 = [("llama_gqa", "eager", "eager", None, "ragged"), ("llama_gqa", "sdpa", "eager", None, "even")]


@pytest.mark.slow
@pytest.mark.parametrize("c, runs", [(2, RUNS_C2), (4, RUNS_C4)], ids=["c2", "c4"])
def test_prefill_allocates_only_the_stripe(c, runs):
    for rank_results in run_ranks(_run, c, runs):
        _check(rank_results, c, runs)


# ----------------------------------------------------------------------------- no process group


@pytest.mark.parametrize("name, impl", [("deepseek_v3", "sdpa"), ("kimi_linear", "eager"), ("llama_gqa", "eager"),
                                        ("llama_gqa", "sdpa")])
def test_prefill_allocations_stand_in_for_the_cache_tensors(name, impl):
    """The recogniser names each StaticCache tensor the prefill allocates as the later graphs
    take it (`cache.layers.<i>.keys` / `values`; Kimi's linear-attention layer allocates none),
    every factory call gives way to an input, and HF's unpadded SDPA prefill (causal over
    `key[:, :, :n]`) becomes the same causal attention over every position, which the
    recognisers take with a causal cap and no mask; put back, the graph allocates and attends as
    captured."""
    from kit import hf

    from dcp_pass.rewrites import allocation
    from dcp_pass.rewrites.cache_reads import buffer_name
    from dcp_pass.rewrites.match import find_mla, load_recognisers

    prefill = hf.capture_graphs(hf_tiny.tiny_model(name, impl))[0][0]
    load_recognisers()
    graph = prefill.graph
    captured = graph.python_code("self").src
    stand_ins = allocation.stand_in_allocations(graph)
    layers = [1] if name == "kimi_linear" else list(range(hf_tiny.LAYERS))
    assert [buffer_name(s.placeholder) for s in stand_ins] == [
        f"cache.layers.{i}.{t}" for i in layers for t in ("keys", "values")]
    assert all(not s.factory.users for s in stand_ins)
    prefixes = allocation.causal_prefix_over_cache(graph, stand_ins)
    assert len(prefixes) == (len(layers) if impl == "sdpa" else 0)
    found = find_mla(graph)
    assert [m.layer for m in found.matches] == [f"cache.layers.{i}" for i in layers] and not found.near_misses
    assert [m.causal for m in found.matches] == [impl == "sdpa"] * len(layers)
    assert all(not m.masks for m in found.matches) if impl == "sdpa" else True
    assert {b for m in found.matches for b in m.buffers} == {s.placeholder for s in stand_ins}
    for prefix in prefixes:
        allocation.undo_prefix(graph, prefix)
    for stand_in in stand_ins:
        allocation.put_back(graph, stand_in)
    graph.lint()
    prefill.recompile()
    assert graph.python_code("self").src.count("torch.zeros(") == captured.count("torch.zeros(")
    assert find_mla(graph).matches == []  # attention over caches made in the graph: not a cache read


def test_prefill_of_any_cache_length_keeps_its_allocation():
    """A prefill Dynamo compiled for any cache length (dynamic shapes) allocates a symbolic size:
    no stand-in (the stripe's size would be a run-time value), its name returned for the report."""
    from kit import hf

    from dcp_pass.rewrites import allocation
    from dcp_pass.rewrites.match import load_recognisers

    keeper = hf.GraphKeeper()
    torch._dynamo.reset()
    model = hf_tiny.tiny_model("llama_gqa", "eager")
    model.compile(backend=keeper, dynamic=True)
    try:
        hf.generate(model, hf.PROMPTS[:1], 2)
    finally:
        torch._dynamo.reset()
    prefill = keeper.restore()[0][0]
    load_recognisers()
    symbolic: list = []
    assert allocation.stand_in_allocations(prefill.graph, symbolic) == []
    assert symbolic == [f"L['kwargs']['cache'].layers[{i}].{t}" for i in range(hf_tiny.LAYERS)
                        for t in ("keys", "values")]


@pytest.mark.parametrize("name", ["llama_gqa", "deepseek_v3"])
def test_padded_prefill_mask_becomes_a_causal_cap(name):
    """Called with a 2-D padding mask and a StaticCache, Hugging Face's compiled SDPA prefill
    builds its mask in the graph: `ones & (kv_idx <= q_idx) & padding[b, kv_idx]`, expanded to
    [B, 1, S, T]. The comparison goes to the op as its causal cap (q_pos) and only the padding
    term stays a mask, one row per request: no [S, T] mask reaches the op (as fp32 it would be
    16 GiB for a 64K-token prefill)."""
    from kit import hf
    from transformers import StaticCache

    from dcp_pass.rewrites import allocation
    from dcp_pass.rewrites.causal_masks import causal_splits
    from dcp_pass.rewrites.match import find_mla, load_recognisers

    keeper = hf.GraphKeeper()
    torch._dynamo.reset()
    model = hf_tiny.tiny_model(name, "sdpa")
    model.compile(backend=keeper)
    ids, mask = _batch(RAGGED)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True,
                  cache=StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4))
    finally:
        torch._dynamo.reset()
    prefill = keeper.restore()[0][0]
    load_recognisers()
    allocation.stand_in_allocations(prefill.graph)
    found = find_mla(prefill.graph)
    assert len(found.matches) == hf_tiny.LAYERS and not found.near_misses
    for match in found.matches:
        split, rest = causal_splits(match.masks)
        assert split is not None, [m.node.format_node() for m in match.masks]
        assert len(rest) == 1 and rest[0].kind == "keep", rest
        shape = rest[0].node.meta["example_value"].shape
        assert shape[-1] == ids.shape[1] + 4 and math.prod(shape[:-1]) == len(RAGGED), shape  # [B, T] rows


def _run_forward_calls(rank: int, world: int, name: str):
    """Logits of a padded prefill and 4 decode steps called as `model(...)` with a StaticCache
    (the mask built in the graph, its comparison the op's cap) under DCP, against the model."""
    import torch._dynamo
    from transformers import StaticCache

    from dcp_pass.backend import DcpBackend

    ids, mask = _batch(RAGGED)
    steps = torch.randint(1, 60, (4, len(RAGGED), 1), generator=torch.Generator().manual_seed(3))

    def run(model):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 5)
        with torch.no_grad():
            out = [model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]]
            grown = mask
            for token in steps:
                grown = torch.cat([grown, torch.ones_like(grown[:, :1])], 1)
                out.append(model(input_ids=token, attention_mask=grown, cache=cache, use_cache=True,
                                 cache_position=torch.tensor([grown.shape[1] - 1])).logits[:, -1])
        return torch.stack(out)

    torch._dynamo.reset()
    want = run(hf_tiny.tiny_model(name, "sdpa"))
    model = hf_tiny.tiny_model(name, "sdpa")
    backend = DcpBackend(dcp_size=world, tp_size=1, inner="aot_eager")
    model.compile(backend=backend)
    got = run(model)
    return dict(err=((got - want).abs().max() / want.abs().max()).item(), summary=backend.report.summary(),
                caps=["q_pos = causal_q_pos" in gm.code for gm in backend.graphs],
                prefill_float_masks=backend.graphs[0].code.count("mask_f32"))


@pytest.mark.slow
def test_padded_prefill_with_a_causal_cap_is_exact():
    for r in run_ranks(_run_forward_calls, 2, "llama_gqa"):
        assert r["err"] < 1e-5, r
        # the prefill's attention takes the cap; the decode steps (one token) keep their mask row
        assert r["caps"][0] and not any(r["caps"][1:]), r
        assert r["prefill_float_masks"] == 0, r


def _run_user_cache(rank: int, world: int, _):
    """Chunked prefill of a GQA model into a StaticCache the caller made: its tensors are made
    lazily, inside the compiled first chunk, so only the stripes are ever allocated."""
    import torch._dynamo
    from torch.profiler import ProfilerActivity, profile
    from transformers import StaticCache

    from dcp_pass.backend import DcpBackend

    ids, mask = _batch(RAGGED)

    def generate(model):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW_TOKENS - 1)
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  return_dict_in_generate=True, pad_token_id=PAD, past_key_values=cache,
                                  prefill_chunk_size=4)

    torch._dynamo.reset()
    want = generate(hf_tiny.tiny_model("llama_gqa", "sdpa"))
    model = hf_tiny.tiny_model("llama_gqa", "sdpa")
    backend = DcpBackend(dcp_size=world, tp_size=1, inner="eager")
    model.compile(backend=backend)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = generate(model)
    _, _, sizes = _cache_bytes(got.cache)
    return dict(tokens_equal=torch.equal(got.sequences, want.sequences),
                full_tensor_allocations=[n for n in _allocations(prof) if n in set(sizes)],
                rewritten=[g.rewritten for g in backend.report.graphs])


@pytest.mark.slow
def test_chunked_prefill_into_a_cache_made_by_the_caller_allocates_only_the_stripe():
    """Hugging Face initialises the cache it makes for `prefill_chunk_size` eagerly, before the
    first chunk (`StaticCache.early_initialization`, outside any graph: every rank holds the
    whole cache until the first graph reads it); a StaticCache passed in is made in the first
    chunk's graph, which allocates the rank's stripe only (the route usage.md gives)."""
    for r in run_ranks(_run_user_cache, 2, None):
        assert r["tokens_equal"], r
        assert all(n > 0 for n in r["rewritten"]), r
        assert r["full_tensor_allocations"] == [], r
