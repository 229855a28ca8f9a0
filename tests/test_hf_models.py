"""Hugging Face models through generate(cache_implementation="static") under backend "dcp".

Tiny random DeepseekV3, KimiLinear (KDA + MLA layers) and Llama (GQA) models
(tests/hf_tiny.py), unmodified, compiled in place with `model.compile(backend=DcpBackend(...))`
on real gloo ranks: greedy fp32 tokens equal the uncompiled model's, step logits within
1e-5 relative, every attention layer over the static cache rewritten in the prefill graph
(which allocates each rank's stripe of the cache instead of the whole) and the decode
graph, and each rank holds ceil(T / c) + 1 of the T cache positions (the cache tensor
itself has no memory).
Kimi's linear-attention states stay as they are and equal eager. Matcher-only tests read
the captured graphs without a process group; one pin shows the rewritten DeepseekV3 attention.

Option absorb_kv_b_proj (DeepseekV3, Kimi): the same checks, every layer absorbed and its
value projection applied before the exchange. CI runs c=2 end to end for DeepseekV3 sdpa,
Kimi eager absorbed and Llama eager (inner "eager") and the matcher on the other forms; DCP_TEST_FULL=1 runs every model and attention
implementation at c=2 and c=4 under aot_eager, and the matcher on all of them.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/hf_tiny.py, after the importorskip)
from kit import hf  # noqa: E402
from kit.graphs import PinCase  # noqa: E402

from dcp_pass import env
from dcp_pass.testing import run_ranks  # noqa: E402

FULL = env.full_tests()
ALL_CONFIGS = [(m, a) for m in ("deepseek_v3", "kimi_linear", "llama_gqa") for a in ("eager", "sdpa")]
# end-to-end: (model, attention implementation, option absorb_kv_b_proj)
ALL_RUNS = [(m, a, False) for m, a in ALL_CONFIGS] + [(m, a, True) for m, a in ALL_CONFIGS if m != "llama_gqa"]
# CI: every model and both attention implementations between the end-to-end run and the matcher tests
CI_RUNS = [("deepseek_v3", "sdpa", False), ("kimi_linear", "eager", True)]  # and Llama eager in _reuse_and_reset
MATCHER_CONFIGS = ALL_CONFIGS if FULL else [("deepseek_v3", "eager"), ("kimi_linear", "sdpa"), ("llama_gqa", "sdpa")]


# ----------------------------------------------------------------------------- on gloo ranks


def _linear_states(cache) -> list[torch.Tensor]:
    """Kimi's KDA layer states (conv and recurrent), flattened."""
    found = []
    for layer in cache.layers:
        for attr in ("conv_states", "recurrent_states"):
            value = getattr(layer, attr, None)
            if isinstance(value, dict):  # state index -> tensor
                found += [t for _, t in sorted(value.items()) if isinstance(t, torch.Tensor)]
            elif isinstance(value, (list, tuple)):
                found += [t for t in value if isinstance(t, torch.Tensor)]
            elif isinstance(value, torch.Tensor):
                found.append(value)
    return found


def _generate_configs(rank: int, world: int, configs: list, inner: str):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.state.guards import StripedCacheTensor

    results = []
    for name, impl, absorb in configs:
        torch._dynamo.reset()
        ref = hf.generate(hf_tiny.tiny_model(name, impl))
        model = hf_tiny.tiny_model(name, impl)
        backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner, absorb_kv_b_proj=absorb)
        model.compile(backend=backend)
        out = hf.generate(model)
        caches = []
        for (label, t), (_, r) in zip(hf.cache_tensors(out.cache), hf.cache_tensors(ref.cache)):
            own, shard = hf.held_bytes(t)
            caches.append(dict(name=label, own=own, shard=shard, full=r.untyped_storage().nbytes(),
                               striped=type(t) is StripedCacheTensor, positions=t.shape[2]))
        states = list(zip(_linear_states(out.cache), _linear_states(ref.cache)))
        state_err = max([((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in states],
                        default=0.0)
        results.append(dict(
            config=(name, impl, absorb), tokens_equal=torch.equal(out.sequences, ref.sequences),
            logits_err=hf.logits_error(out, ref), graphs=len(backend.graphs),
            rewritten=[g.rewritten for g in backend.report.graphs],
            families=sorted({layer.detail.split(", ")[1] for g in backend.report.graphs for layer in g.layers
                             if layer.rewritten}),
            absorbed=[("kv_b_proj absorbed" in layer.detail, "v-projection before merge" in layer.detail)
                      for g in backend.report.graphs for layer in g.layers if layer.rewritten],
            caches=caches, states=len(states), state_err=state_err))
    return results


def _check(results, c: int, configs: list):
    assert [r["config"] for r in results] == list(configs)
    for r in results:
        name, impl, absorb = r["config"]
        assert r["tokens_equal"], r
        assert r["logits_err"] < 1e-5, r
        # prefill (it returns the striped tensors it allocated) and decode; no graph break
        assert r["graphs"] == 2, r
        attention_layers = 1 if name == "kimi_linear" else hf_tiny.LAYERS
        assert r["rewritten"] == [attention_layers, attention_layers], r
        assert r["families"] == [f"per-head {impl} form"], r
        # absorbed: no re-expansion, and the value half of kv_b_proj moves before the exchange
        assert r["absorbed"] == [(absorb, absorb)] * (2 * attention_layers), r
        assert len(r["caches"]) == 2 * attention_layers, r
        for entry in r["caches"]:
            positions = entry["positions"]
            assert entry["striped"] and entry["own"] == 0, entry  # no full-size memory
            assert entry["shard"] * positions == entry["full"] * (math.ceil(positions / c) + 1), entry
        if name == "kimi_linear":  # the KDA layer's states: untouched by the pass, equal eager
            assert r["states"] == 2 and r["state_err"] < 1e-5, r


def _generate_default_tp(world: int):
    """dcp_size = world with tp_size left at its default (the world size): the error's text."""
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch._dynamo.reset()
    model = hf_tiny.tiny_model("deepseek_v3", "eager")
    model.compile(backend=DcpBackend(dcp_size=world, inner="eager"))
    try:
        hf.generate(model, new_tokens=2)
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        return str(e)
    return None


def _reuse_and_reset(world: int):
    """Llama (per-head K/V caches, GQA): a generate, a second one (a new cache) and a reset
    cache passed in again, each equal eager."""
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch._dynamo.reset()
    ref_model = hf_tiny.tiny_model("llama_gqa", "eager")
    model = hf_tiny.tiny_model("llama_gqa", "eager")
    backend = DcpBackend(dcp_size=world, tp_size=1, inner="eager")
    model.compile(backend=backend)
    counted = []  # the report's caches, bytes and layers after each generate

    def count():
        r = backend.report
        counted.append((len(r.caches), r.kv_bytes_full, r.kv_bytes_local, len(r.layers_seen)))

    ref, first = hf.generate(ref_model), hf.generate(model)
    count()
    flipped = hf.PROMPTS.flip(0)
    ref_second, second = hf.generate(ref_model, flipped), hf.generate(model, flipped)
    count()
    cache = first.cache
    cache.reset()  # zeroes the shards of the striped tensors
    third = hf.generate(model, cache=cache)
    count()
    from dcp_pass.state.store import DcpCacheError

    try:  # any other eager read of a striped cache tensor is refused, naming it
        cache.layers[0].keys.sum()
        refused = None
    except DcpCacheError as e:
        refused = str(e)
    return dict(equal=[torch.equal(first.sequences, ref.sequences), torch.equal(second.sequences, ref_second.sequences),
                       torch.equal(third.sequences, ref.sequences)],
                err=max(hf.logits_error(first, ref), hf.logits_error(second, ref_second), hf.logits_error(third, ref)),
                graphs=len(backend.graphs), rewritten=[g.rewritten for g in backend.report.graphs], refused=refused,
                counted=counted)


def _ci_run(rank: int, world: int, configs: list, inner: str):
    return dict(configs=_generate_configs(rank, world, configs, inner), reuse=_reuse_and_reset(world),
                default_tp=_generate_default_tp(world))


@pytest.mark.slow
def test_generate_static_c2():
    """c=2 on gloo, one group for all of it (spawning and tracing dominate on two cores):
    each config's tokens, logits, graphs, rewritten layers and cache bytes per rank; a second
    generate and a reset cache reused (Llama), equal eager; tp_size left at its default (the world
    size) for an unsharded model refused with an error that says to pass tp_size=1 (not run
    with a query all-gather over heads every rank already has)."""
    configs = ALL_RUNS if FULL else CI_RUNS
    for result in run_ranks(_ci_run, 2, configs, "aot_eager" if FULL else "eager"):
        _check(result["configs"], 2, configs)
        reuse = result["reuse"]
        assert all(reuse["equal"]) and reuse["err"] < 1e-5, reuse
        # prefill (allocating the stripes) and decode; the second generate compiles nothing new;
        # the initialised cache passed in: a prefill that reads it (multi-token attention over
        # the striped cache)
        assert reuse["graphs"] == 3 and reuse["rewritten"] == [hf_tiny.LAYERS] * 3, reuse
        assert reuse["refused"] is not None and "cache.layers.0.keys" in reuse["refused"], reuse
        # each generate's new cache takes the place of the last in the report (it counted them
        # all, 2 then 4 layers, before the report keyed a renewed cache by its name)
        assert reuse["counted"][0][0] == 2 * hf_tiny.LAYERS and reuse["counted"][0][3] == hf_tiny.LAYERS, reuse
        assert len(set(reuse["counted"])) == 1, reuse
        message = result["default_tp"]
        assert message is not None and "tp_size': 1" in message and "not sharded" in message, message


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="DCP_TEST_FULL=1 runs c=4")
def test_generate_static_c4():
    for rank_results in run_ranks(_generate_configs, 4, ALL_RUNS, "aot_eager"):
        _check(rank_results, 4, ALL_RUNS)


def _gpu_generate(rank: int, world: int, runs: list, one_gpu: bool = False):
    """On cuda:rank (cuda:0 for every rank with `one_gpu`) under inductor: each run's tokens
    and logit error against the fp32 eager model, and the same error of the eager model in
    the run's dtype (bf16's own noise)."""
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    device = torch.device("cuda", 0 if one_gpu else rank)
    torch.cuda.set_device(device)
    prompts = hf.PROMPTS.to(device)
    results = []
    for name, impl, absorb, dtype in runs:
        torch._dynamo.reset()
        dtype = getattr(torch, dtype)
        want = hf.generate(hf_tiny.tiny_model(name, impl).to(device), prompts)
        eager = hf.generate(hf_tiny.tiny_model(name, impl, dtype=dtype).to(device), prompts)
        model = hf_tiny.tiny_model(name, impl, dtype=dtype).to(device)
        # gloo collectives cannot be captured in CUDA graphs
        model.compile(backend=DcpBackend(dcp_size=world, tp_size=1, inner="inductor", absorb_kv_b_proj=absorb,
                                         **({"cudagraphs": False} if one_gpu else {})))
        got = hf.generate(model, prompts)
        results.append(dict(run=(name, impl, absorb, str(dtype)), err=hf.logits_error(got, want),
                            eager_err=hf.logits_error(eager, want),
                            tokens_equal=torch.equal(got.sequences, want.sequences)))
    return results


GPU_RUNS = [("deepseek_v3", "sdpa", absorb, dtype) for absorb in (False, True) for dtype in ("float32", "bfloat16")] \
    + [("llama_gqa", "sdpa", False, "bfloat16")]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_gpu_generate_static():
    """2 GPUs, NCCL, inductor (CUDA graphs as 'auto' sets them): fp32 exact to 1e-4 with equal
    tokens; bf16 within a few times the bf16 eager model's own error."""
    for rank_results in run_ranks(_gpu_generate, 2, GPU_RUNS, backend="nccl", timeout=900):
        for r in rank_results:
            if r["run"][3] == "torch.float32":
                assert r["err"] < 1e-4 and r["tokens_equal"], r
            else:
                assert r["err"] < 4 * r["eager_err"] + 1e-2, r


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu_full
def test_gpu_generate_static_two_ranks_one_gpu():
    """Two ranks on one GPU through gloo (CUDA graphs off: gloo collectives cannot be
    captured): the striped CUDA kernels, device counts and merges inside generate, at DCP=2;
    the same bounds as on two GPUs."""
    for rank_results in run_ranks(_gpu_generate, 2, GPU_RUNS, True, backend="gloo", timeout=900):
        for r in rank_results:
            if r["run"][3] == "torch.float32":
                assert r["err"] < 1e-4 and r["tokens_equal"], r
            else:
                assert r["err"] < 4 * r["eager_err"] + 1e-2, r


# ----------------------------------------------------------------------------- no process group


@pytest.fixture(scope="module")
def decode_graphs():
    """name -> (prefill graph, decode graph) of each tiny model (eager and sdpa)."""
    graphs = {}
    for name, impl in MATCHER_CONFIGS:
        captured = hf.capture_graphs(hf_tiny.tiny_model(name, impl))
        assert len(captured) == 2, (name, impl, len(captured))
        graphs[(name, impl)] = (captured[0][0], captured[1][0])
    return graphs


@pytest.mark.parametrize("config", MATCHER_CONFIGS, ids=lambda c: "-".join(c))
def test_prefill_builds_the_cache_state(decode_graphs, config):
    """The prefill allocates the StaticCache's tensors in the graph: under "auto" it gets no
    CUDA graphs (their pool would own the cache); the decode graphs only write inputs."""
    from dcp_pass.rewrites.fx_util import state_built_in_graph

    prefill, decode = decode_graphs[config]
    built = state_built_in_graph(prefill.graph)
    caches = 1 if config[0] == "kimi_linear" else hf_tiny.LAYERS
    assert sum(name.startswith(("keys", "values")) for name in built) == 2 * caches, built
    assert state_built_in_graph(decode.graph) == []


@pytest.mark.parametrize("config", MATCHER_CONFIGS, ids=lambda c: "-".join(c))
def test_matcher_finds_static_cache_attention(decode_graphs, config):
    from dcp_pass.rewrites.match import find_mla

    name, impl = config
    prefill, decode = decode_graphs[config]
    assert find_mla(prefill.graph).matches == []  # its caches are created inside the graph
    found = find_mla(decode.graph)
    layers = ["cache.layers.1"] if name == "kimi_linear" else [f"cache.layers.{i}" for i in range(hf_tiny.LAYERS)]
    assert [m.layer for m in found.matches] == layers
    assert found.near_misses == []
    for match in found.matches:
        assert match.family == f"per-head {impl}"
        assert match.kv_len == hf.PROMPTS.shape[1] + 3 - 1
        written = sorted(w.buffer.name for w in match.writes)
        assert len(written) == 2 and all("index_copy" in w.node.name or "setitem" in str(w.node.target)
                                         for w in match.writes), written
        if name == "llama_gqa":  # per-head K and V read directly, 2 kv heads for 4 query heads
            assert (match.keys.heads, match.values.heads) == (2, 2)
            assert all(p.projection is None for p in match.keys.pieces + match.values.pieces)
        else:  # K = kv_b_proj(latent)[:nope] || broadcast rope cache; V = kv_b_proj(latent)[nope:]
            nope, rope, v = hf_tiny.QK_NOPE_HEAD_DIM, hf_tiny.QK_ROPE_HEAD_DIM, hf_tiny.V_HEAD_DIM
            k_latent, k_rope = match.keys.pieces
            assert k_latent.projection.cols == (0, nope) and k_latent.cols == (0, nope)
            assert k_rope.projection is None and k_rope.broadcast and k_rope.cols == (nope, nope + rope)
            (v_latent,) = match.values.pieces
            assert v_latent.projection.cols == (nope, nope + v)
            assert v_latent.projection.weight is k_latent.projection.weight


@pytest.mark.parametrize("config", MATCHER_CONFIGS, ids=lambda c: "-".join(c))
def test_absorbable(decode_graphs, config):
    """DeepseekV3 / Kimi keys and values are the two halves of one kv_b_proj over the latent
    cache beside the rotary key cache; Llama's per-head caches have nothing to absorb."""
    from dcp_pass.rewrites.match import find_mla
    from dcp_pass.rewrites.recognisers.per_head import Absorbed, absorbable

    found = find_mla(decode_graphs[config][1].graph).matches
    for match in found:
        ab = absorbable(match)
        if config[0] == "llama_gqa":
            assert not isinstance(ab, Absorbed) and "kv_b_proj" in ab, ab
        else:
            assert (ab.nope, ab.rope, ab.v_dim, ab.rank) == (hf_tiny.QK_NOPE_HEAD_DIM, hf_tiny.QK_ROPE_HEAD_DIM,
                                                               hf_tiny.V_HEAD_DIM, hf_tiny.KV_LORA_RANK)


def test_absorb_option_is_auto_or_a_bool():
    from dcp_pass.options import DcpOptionError, DcpOptions

    assert DcpOptions.from_mapping({}).absorb_kv_b_proj is None  # "auto"
    assert DcpOptions.from_mapping({"absorb_kv_b_proj": "auto"}).absorb_kv_b_proj is None
    assert DcpOptions.from_mapping({"absorb_kv_b_proj": True}).absorb_kv_b_proj is True
    assert DcpOptions.from_mapping({"absorb_kv_b_proj": False}).absorb_kv_b_proj is False
    for bad in ("yes", 1, "on"):
        with pytest.raises(DcpOptionError, match="absorb_kv_b_proj.*True, False or 'auto'"):
            DcpOptions.from_mapping({"absorb_kv_b_proj": bad})


def test_absorb_auto_decision():
    """On for decode on CUDA in 16-bit dtypes; off, with the reason, on the CPU, in fp32 / fp64
    and for multi-token calls (a function of what every rank has alike)."""
    from dcp_pass.options import absorb_kv_b_proj_auto

    for dtype in ("bfloat16", "float16"):
        assert absorb_kv_b_proj_auto("cuda", dtype, decode=True) is None
    assert "runs on cpu" in absorb_kv_b_proj_auto("cpu", "bfloat16", decode=True)
    for dtype in ("float32", "float64"):
        assert f"this one is {dtype}" in absorb_kv_b_proj_auto("cuda", dtype, decode=True)
    assert "several queries" in absorb_kv_b_proj_auto("cuda", "bfloat16", decode=False)


@pytest.mark.parametrize("config", MATCHER_CONFIGS, ids=lambda c: "-".join(c))
def test_absorb_auto_on_cpu_keeps_the_expansion_and_says_why(decode_graphs, config):
    """The default ("auto") on these CPU fp32 decode graphs: every DeepseekV3 / Kimi layer keeps
    the re-expansion with the reason in its report notes; Llama (nothing to absorb) gets none;
    True absorbs the same layers."""
    from dcp_pass.rewrites.attention import AttentionPlan
    from dcp_pass.rewrites.match import find_mla
    from dcp_pass.rewrites.recognisers.per_head import Absorbed

    for requested in (None, True):
        plan = AttentionPlan(2, 0, "0", "a2a", False, "e", "auto", requested)
        for match in find_mla(decode_graphs[config][1].graph).matches:
            assert match.check_plan(plan) is None
            if config[0] == "llama_gqa":
                assert match.absorbed is None
                assert match.rewrite_notes == ([] if requested is None else [match.rewrite_notes[0]])
            elif requested is None:
                assert match.absorbed is None
                assert match.rewrite_notes == ["kv_b_proj not absorbed (auto: on for CUDA decode, the model runs "
                                               "on cpu)"], match.rewrite_notes
            else:
                assert isinstance(match.absorbed, Absorbed) and match.rewrite_notes == []


def test_matcher_leaves_linear_attention_states_alone(decode_graphs):
    """Kimi's KDA conv and recurrent states are graph inputs of the decode graph, not caches."""
    from dcp_pass.rewrites.cache_reads import is_cache_tensor

    _, decode = decode_graphs[next(c for c in MATCHER_CONFIGS if c[0] == "kimi_linear")]
    states = [n for n in decode.graph.nodes if n.op == "placeholder" and ("conv_states" in n.name
                                                                            or "recurrent_states" in n.name)]
    assert len(states) == 2 and not any(is_cache_tensor(n) for n in states)


class _Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class _Cache:
    def __init__(self, keys, values):
        self.layers = [_Layer(keys, values)]


class _NonlinearKeys(torch.nn.Module):
    """Attention over a static-cache-like object whose keys go through tanh (not a
    projection the pass knows to stripe)."""

    def forward(self, q, cache, mask):
        k = torch.tanh(cache.layers[0].keys)
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
        return torch.matmul(torch.softmax(scores, dim=-1), cache.layers[0].values)


def test_matcher_near_miss_leaves_graph_unchanged():
    from dcp_pass.rewrites.match import find_mla

    keeper = hf.GraphKeeper()
    torch._dynamo.reset()
    cache = _Cache(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    torch.compile(_NonlinearKeys(), backend=keeper)(torch.randn(1, 2, 1, 16), cache, torch.zeros(1, 1, 1, 8))
    torch._dynamo.reset()
    found = find_mla(keeper.restore()[0][0].graph)
    assert found.matches == []
    assert len(found.near_misses) == 1 and "not position-wise" in found.near_misses[0][1], found.near_misses


class TestPin(PinCase):
    def test_deepseek_v3_decode_attention(self):
        """The rewritten attention of the HF DeepseekV3 decode graph (one layer, c=2, rank 0):
        the striped writes, kv_b_proj on the rank's latent rows only, the local attention over
        them and the head-replicated exchange."""
        from dcp_pass.testing import graph_stages

        model = hf.DecodeCall(hf_tiny.tiny_model("deepseek_v3", "eager", num_hidden_layers=1,
                                                 first_k_dense_replace=1))
        ids = hf.PROMPTS[:1]
        cache = hf.static_cache(model.model, 1, 8)
        stages = graph_stages(model, [(ids[:, :5], cache), (ids[:, 5:6], cache)], {"dcp_size": 2, "tp_size": 1})
        self.assertEqual(len(stages), 2)
        # the prefill allocates no cache: it writes the rank's positions into the shards the
        # backend makes for it, attends over them and returns the stand-ins (tensors without memory)
        prefill = stages[0]["install_shards"]
        self.assertNotIn("torch.zeros((1, 1, 8", prefill)
        dcp_lines = "\n".join(line.strip() for line in prefill.splitlines()[1:] if "dcp" in line)
        self.assertExpectedInline(dcp_lines, """\
striped_write = dcp_pass_runtime_decode_layout_write_rows_at_(dcp_local_cache_0, kv_nope_2, cache_position, 2, 2, 0, 8)
striped_write_1 = dcp_pass_runtime_decode_layout_write_rows_at_(dcp_local_cache_1, k_embed, cache_position, 2, 2, 0, 8)
latent_rows = dcp_local_cache_0[(slice(None, None, None), 0)]
expand = dcp_local_cache_1.expand(-1, 4, -1, -1)
local_attention = torch.ops.dcp.local_attention.default(q_bshd, k_local, v_local, 8, 2, 0, 0.1767766952966369, mask_f32, 'e', 'auto')
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
return (logits, to_9, dcp_allocated_values, dcp_allocated_keys)""")
        code = hf.lines_between(stages[1]["install_shards"], "striped_write", "o_proj")
        self.assertExpectedInline(code, """\
striped_write = dcp_pass_runtime_decode_layout_write_rows_at_(dcp_local_cache_0, kv_nope_2, cache_position, 2, 2, 0, 8)
striped_write_1 = dcp_pass_runtime_decode_layout_write_rows_at_(dcp_local_cache_1, k_embed, cache_position, 2, 2, 0, 8)
query_states = torch.cat((q_pass, q_embed), dim = -1)
latent_rows = dcp_local_cache_0[(slice(None, None, None), 0)]
kv_rows = torch._C._nn.linear(latent_rows, model_model_layers_0_self_attn_kv_b_proj_weight, None)
unflatten = kv_rows.unflatten(-1, (4, 32))
kv_heads = unflatten.transpose(1, 2)
getitem = kv_heads[(Ellipsis, slice(0, 16, None))]
expand = dcp_local_cache_1.expand(-1, 4, -1, -1)
cat = torch.cat([getitem, expand], -1)
k_local = cat.transpose(1, 2)
getitem_19 = kv_heads[(Ellipsis, slice(16, 32, None))]
v_local = getitem_19.transpose(1, 2)
q_bshd = query_states.transpose(1, 2)
permute = mask.permute(0, 2, 1, 3)
mask_f32 = permute.float()
local_attention = torch.ops.dcp.local_attention.default(q_bshd, k_local, v_local, 8, 2, 0, 0.1767766952966369, mask_f32, 'e', 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
merged_layout = merged.permute(0, 2, 1, 3)
transpose_3 = merged_layout.transpose(1, 2)
attn_output_1 = transpose_3.contiguous()
reshape = attn_output_1.reshape(1, 1, -1)
attn_output_2 = reshape.contiguous()
attn_output_3 = torch._C._nn.linear(attn_output_2, model_model_layers_0_self_attn_o_proj_weight, None)""")

    def test_deepseek_v3_decode_attention_absorbed(self):
        """The same with absorb_kv_b_proj: the key half of kv_b_proj folded into the query,
        absorbed-MLA attention over the latent and rotary rows, the value half per rank's
        partial before the exchange (project_before_merge)."""
        from dcp_pass.testing import graph_stages

        model = hf.DecodeCall(hf_tiny.tiny_model("deepseek_v3", "eager", num_hidden_layers=1,
                                                 first_k_dense_replace=1))
        ids = hf.PROMPTS[:1]
        cache = hf.static_cache(model.model, 1, 8)
        stages = graph_stages(model, [(ids[:, :5], cache), (ids[:, 5:6], cache)],
                              {"dcp_size": 2, "tp_size": 1, "absorb_kv_b_proj": True})
        code = hf.lines_between(stages[1]["install_shards"], "kv_b_heads", "o_proj")
        self.assertExpectedInline(code, """\
kv_b_heads = model_model_layers_0_self_attn_kv_b_proj_weight.view(4, 32, -1)
w_k = kv_b_heads[(slice(None, None, None), slice(0, 16, None))]
w_v = kv_b_heads[(slice(None, None, None), slice(16, 32, None))]
q_bshd = query_states.transpose(1, 2)
q_nope = q_bshd[(Ellipsis, slice(0, 16, None))]
q_rope = q_bshd[(Ellipsis, slice(16, 32, None))]
q_lat = torch.functional.einsum('bshd,hdr->bshr', q_nope, w_k)
kv_local = dcp_local_cache_0[(slice(None, None, None), 0)]
pe_local = dcp_local_cache_1[(slice(None, None, None), 0)]
permute = mask.permute(0, 2, 1, 3)
mask_f32 = permute.float()
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat, q_rope, kv_local, pe_local, kv_len = 8, c = 2, rank = 0, v_dim = 32, scale = 0.1767766952966369, mask = mask_f32, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, w_v)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
merged_layout = merged_proj.permute(0, 2, 1, 3)
transpose_3 = merged_layout.transpose(1, 2)
attn_output_1 = transpose_3.contiguous()
reshape = attn_output_1.reshape(1, 1, -1)
attn_output_2 = reshape.contiguous()
attn_output_3 = torch._C._nn.linear(attn_output_2, model_model_layers_0_self_attn_o_proj_weight, None)""")


# ----------------------------------------------------------------------------- one device, option fast_path


def _fast_path_generates(device: torch.device, dtype: torch.dtype, inner: str, absorb: bool) -> dict:
    """Option fast_path at dcp_size=1 over several generate calls, each with a new StaticCache
    (equal and different lengths: the prefill allocates the cache inside its graph, the decode
    graphs then take the new tensors): the logit error of each against the fp32 eager model."""
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch._dynamo.reset()
    prompts = hf.PROMPTS.to(device)
    want = {n: hf.generate(hf_tiny.tiny_model("deepseek_v3", "sdpa").to(device), prompts, n) for n in (6, 10)}
    model = hf_tiny.tiny_model("deepseek_v3", "sdpa", dtype=dtype).to(device)
    backend = DcpBackend(dcp_size=1, tp_size=1, fast_path=True, inner=inner, absorb_kv_b_proj=absorb)
    model.compile(backend=backend)
    errors, tokens_equal = [], []
    for n in (10, 10, 6, 10):
        got = hf.generate(model, prompts, n)
        errors.append(hf.logits_error(got, want[n]))
        tokens_equal.append(torch.equal(got.sequences, want[n].sequences))
    details = [layer.detail for g in backend.report.graphs for layer in g.layers if layer.rewritten]
    torch._dynamo.reset()
    return dict(errors=errors, tokens_equal=tokens_equal, details=details)


def test_fast_path_absorbs_at_one_rank():
    """Option absorb_kv_b_proj holds at dcp_size=1 under fast_path, exact over new caches."""
    r = _fast_path_generates(torch.device("cpu"), torch.float32, "aot_eager", absorb=True)
    assert r["details"] and all("kv_b_proj absorbed" in d for d in r["details"]), r["details"]
    assert max(r["errors"]) < 1e-5 and all(r["tokens_equal"]), r


@pytest.mark.gpu
@pytest.mark.parametrize("absorb", [False, pytest.param(True, marks=pytest.mark.gpu_full)], ids=["expanded", "absorbed"])
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fast_path_generates_over_new_caches(absorb):
    """One GPU, inductor with CUDA graphs ("auto"): the prefill that allocates the cache runs
    without them (their pool would own the cache), the decode graphs with them, re-recorded
    for each new cache; fp32 exact over four generate calls, bf16 within bf16's own noise."""
    device = torch.device("cuda")
    r = _fast_path_generates(device, torch.float32, "inductor", absorb)
    assert max(r["errors"]) < 1e-4 and all(r["tokens_equal"]), r
    assert all(("kv_b_proj absorbed" in d) == absorb for d in r["details"]), r["details"]
    r = _fast_path_generates(device, torch.bfloat16, "inductor", absorb)
    assert max(r["errors"]) < 5e-2, r
