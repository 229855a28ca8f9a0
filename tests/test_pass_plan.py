"""The pass pipeline's passes one at a time: each runs alone on a captured graph with a plan
made for it (not by the passes before it), and adds only the plan fields it declares.

The graph is TinyMLA's decode step (two caches written by slices, einsum scores, softmax),
captured by a recording backend; each pass runs inside it (Dynamo drops the inputs' sources,
which name the caches, once the backend returns). Nothing is installed: no pass here
releases a cache.
"""
from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
from kit.graphs import TinyMLA, tiny_inputs

from dcp_pass.report import GraphReport
from dcp_pass.rewrites.apply import (
    AttentionRewrite,
    CacheShard,
    FindAttention,
    GraphContext,
    GraphPass,
    GraphPlan,
    LayerPlan,
    PassConfig,
    PassOutcome,
    StripedWrites,
    run_pass,
)
from dcp_pass.rewrites.attention import AttentionPlan
from dcp_pass.rewrites.cache_kinds import FLAT
from dcp_pass.rewrites.cache_reads import buffer_name
from dcp_pass.rewrites.fx_util import static_placeholder
from dcp_pass.rewrites.match import find_mla
from dcp_pass.runtime.decode.layout import write_owned_tokens_
from dcp_pass.state import shards
from dcp_pass.testing.graphs import run_compiled

C = 2
CONFIG = PassConfig(AttentionPlan(C, 0, "unused", "a2a", True, "e", "auto"), replicate_q_proj=None, strict=False,
                    complex_as_real=False)


def _on_decode_graph(check) -> None:
    """`check(gm, example_inputs)` inside the backend that captures TinyMLA's decode step."""
    seen = []

    def record(gm, example_inputs):
        check(gm, example_inputs)
        seen.append(gm)
        return gm.forward

    run_compiled(TinyMLA(), record, [tiny_inputs(1, 5)])
    assert len(seen) == 1


def _changed(before: GraphPlan, after: GraphPlan) -> set[str]:
    return {f.name for f in dataclasses.fields(GraphPlan) if getattr(after, f.name) is not getattr(before, f.name)}


def _targets(graph: fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_match_alone_adds_one_layer_plan_per_attention():
    def check(gm, example_inputs):
        ctx = GraphContext.of(gm, example_inputs, CONFIG, GraphReport(0))
        before = ctx.graph.python_code("self").src
        plan = GraphPlan()
        found, outcome = run_pass(FindAttention(), ctx, plan)
        assert _changed(plan, found) <= set(FindAttention.adds)
        (layer,) = found.layers
        assert layer.match.family == "softmax"
        assert layer.kind is FLAT and layer.kept is None and layer.stand_ins == ()
        assert layer.cache_shards == {} and layer.query is None and layer.rewritten is None  # later passes' fields
        assert sorted(map(buffer_name, found.buffers)) == ["kv_cache", "pe_cache"]
        assert set(found.writes) == found.buffers and all(len(w) == 1 for w in found.writes.values())
        assert found.cache_shards == {} and found.replicator is None and found.caches == ()
        assert outcome.count == 1 and ctx.stopped is None
        assert ctx.graph.python_code("self").src == before  # matching edits nothing

    _on_decode_graph(check)


def test_match_alone_keeps_the_layers_its_plan_says():
    def check(gm, example_inputs):
        ctx = GraphContext.of(gm, example_inputs, CONFIG, GraphReport(0))
        layer = find_mla(ctx.graph).matches[0].layer
        found, _ = run_pass(FindAttention(), ctx, GraphPlan(kept_layers={layer: "left as it is: a test"}))
        assert [(lp.layer, lp.kept) for lp in found.layers] == [(layer, "left as it is: a test")]
        assert found.rewritten == () and found.buffers == frozenset()
        assert ctx.stopped == "no absorbed-MLA attention in this graph"  # nothing left to rewrite
        assert [(r.layer, r.rewritten) for r in ctx.report.layers] == [(layer, False)]

    _on_decode_graph(check)


def test_striped_writes_alone_on_a_plan_made_by_hand():
    """A plan made from `find_mla` directly (no match pass): the pass adds each cache's shard
    input and stripes its writes, and leaves the attention to the attention pass."""

    def check(gm, example_inputs):
        ctx = GraphContext.of(gm, example_inputs, CONFIG, GraphReport(0))
        found = find_mla(ctx.graph)
        (match,) = found.matches
        plan = GraphPlan(layers=(LayerPlan(match, match.value_cache.kind),), writes=found.writes,
                         buffers=frozenset(match.buffers))
        setitems = _targets(ctx.graph).count(operator.setitem)
        striped, outcome = run_pass(StripedWrites(), ctx, plan)
        assert _changed(plan, striped) == {"layers", "cache_shards"}
        assert outcome.count == 2  # both slice writes
        assert set(striped.cache_shards) == set(match.buffers)
        (layer,) = striped.layers
        assert layer.cache_shards == striped.cache_shards and layer.match is match
        inputs = [n.name for n in ctx.graph.nodes if n.op == "placeholder"]
        assert inputs[-2:] == ["dcp_local_cache_0", "dcp_local_cache_1"]
        for buf, shard in striped.cache_shards.items():
            full = ctx.values[buf.name]
            assert shard.entry.c == C and shard.entry.rank == 0
            assert full.shape[1] // C <= shard.entry.local.shape[1] < full.shape[1]  # this rank's positions
            assert shard.node.name in inputs and shard.node.meta["dcp_kv_format"] == ""
        targets = _targets(ctx.graph)
        assert targets.count(write_owned_tokens_) == 2 and targets.count(operator.setitem) == setitems - 2
        assert any(n.op == "call_method" and n.target == "softmax" for n in ctx.graph.nodes)  # not rewritten here
        ctx.graph.lint()

    _on_decode_graph(check)


def test_attention_alone_on_shards_made_by_hand():
    """The attention pass given shard inputs made here (not by striped_writes): it replaces
    the softmax attention by the local attention op and the exchange, reports the layer, and
    leaves the cache writes as they were (striping them is another pass's)."""

    def check(gm, example_inputs):
        ctx = GraphContext.of(gm, example_inputs, CONFIG, GraphReport(0))
        (match,) = find_mla(ctx.graph).matches
        made = {}
        for index, buf in enumerate(match.buffers):
            entry = shards.shard_for(ctx.values[buf.name], C, 0, buffer_name(buf), FLAT.shards)
            node = static_placeholder(ctx.graph, f"shard_{index}", entry.local)
            node.meta["dcp_kv_format"] = ""
            made[buf] = CacheShard(entry, node)
        plan = GraphPlan(layers=(LayerPlan(match, FLAT, cache_shards=made),))
        setitems = _targets(ctx.graph).count(operator.setitem)
        done, outcome = run_pass(AttentionRewrite(), ctx, plan)
        assert _changed(plan, done) == {"layers"} and outcome.count == 1
        (layer,) = done.layers
        assert layer.rewritten is not None and layer.rewritten.shape == (2, 1, 4, 8)  # [B, S, H, latent]
        assert layer.rewritten.report in ctx.report.layers and "decode, softmax form" in layer.rewritten.report.detail
        targets = _targets(ctx.graph)
        assert torch.ops.dcp.mla_local_attention.default in targets
        assert layer.rewritten.merged.exchange.target in targets
        assert not any(n.op == "call_method" and n.target == "softmax" for n in ctx.graph.nodes)
        assert targets.count(operator.setitem) == setitems and write_owned_tokens_ not in targets

    _on_decode_graph(check)


def test_a_pass_may_set_only_the_fields_it_declares():
    class Sneaky(GraphPass):
        name = "sneaky"
        adds = ("layers",)

        def run(self, ctx, plan):
            return dataclasses.replace(plan, position=object()), PassOutcome()

    with pytest.raises(AssertionError, match="sneaky set position, which it does not declare"):
        run_pass(Sneaky(), None, GraphPlan())
