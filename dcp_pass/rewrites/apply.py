"""The DCP pass over one captured graph: named passes run by one pipeline.

    allocated_caches -> match -> striped_writes -> query_replication -> attention
          -> project_before_merge -> verify_buffers -> complex_as_real -> install_shards
          -> device_positions

Each pass is a small class whose `run(ctx, plan)` does one step over the graph of a
`GraphContext` (the graph module, the example inputs, the options, the report) and hands
the next pass a `GraphPlan`: one `LayerPlan` per matched attention (its match, its cache
kind, the allocation stand-ins it reads, whether it is kept and why, its caches' shards, its
query, what its rewrite left) and the graph's cache tensors, writes and shards. A pass
declares the plan fields it reads and the ones it adds (`run_pass` refuses an undeclared
one), so any pass runs alone on a graph with a plan made for it. The pipeline records every
outcome (`PassOutcome`) in the graph's report (name, count, notes), and, when asked, hands
the graph after each pass to an observer (the graph-diff helper
`dcp_pass.testing.graph_stages` uses it), the way inductor's post-grad passes and vLLM's
pass manager run named passes.

The rewrite works on a copy of the graph. A pass that finds the graph cannot take DCP
(no MLA) stops the rewrite: the original graph is kept and the reason reported. Decisions
about caches are per layer: when verification finds a layer's cache used outside its
attention (a sliding-window layer's rolling cache: `roll`, `copy_`), the rewrite starts
again from the original graph with that layer left as it is (its cache whole on every
rank, reported per layer), and the other layers rewritten; the decision reads the graph
only, so every rank takes the same. Only when the copy is verified (no node reads a
full-size cache buffer any more) are the cache storages released. The device
position pass runs on whichever graph is kept: every graph of a DCP model, with MLA or
not, takes its step position as device data where possible (CUDA graphs replay only
when no graph of the step is symbolic).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from dcp_pass.report import GraphReport, LayerReport, PassRecord, log
from dcp_pass.rewrites import allocation, axes, complex_product, fx_util, project_merge, q_replicate
from dcp_pass.rewrites.attention import AttentionPlan, MergedOutput, rewrite_attention
from dcp_pass.rewrites.axes import B, H, S
from dcp_pass.rewrites.cache_reads import CacheAccess, CacheKind, module_path, position_axis
from dcp_pass.rewrites.fp8_cache import Fp8Refused, fp8_layout_of, fp8_packed_write
from dcp_pass.rewrites.match import MlaMatch, NearMiss, buffer_name, find_mla, where_of
from dcp_pass.state import shards
from dcp_pass.state.memory import unallocated
from dcp_pass.state.store import LocalCache, ShardKind, is_released
from dcp_pass.state.weights import ExtraInput, WeightCheck, weights_differ


class DcpRewriteError(RuntimeError):
    """The graph cannot run correctly with DCP and cannot run unchanged either."""


@dataclass(frozen=True)
class PassConfig:
    plan: AttentionPlan
    replicate_q_proj: Optional[bool]
    strict: bool
    complex_as_real: bool  # resolved from the option's "auto" by the backend
    static_positions: bool = False  # resolved from the option's "auto" by the backend
    project_before_merge: Optional[bool] = None  # None: where exact; True: required; False: off
    kv_cache_dtype: Optional[str] = None  # None: the model's; "fp8_e4m3": packed fp8 latent shards


@dataclass
class DcpPassResult:
    """What `apply_dcp` returns.

    `graph_module`: the graph module to compile (the input one when nothing changed).
    `caches`: for each cache shard input it gained, the index of the full-size buffer
    input it shards and that shard now. `allocations`: the cache tensors the graph
    allocated, now inputs that follow the graph's own (before the shards): the backend
    makes each call's (rewrites/allocation.py). `weights`: the other inputs it gained (replicated
    q weights), each resolved per call from an existing input. `checks`: parameter inputs
    the graph uses for every rank's heads, checked per call. `position`: how the
    backend feeds a step position moved to the device (None: kept as an int).
    """

    graph_module: fx.GraphModule
    caches: list[tuple[int, LocalCache]] = field(default_factory=list)
    weights: list[ExtraInput] = field(default_factory=list)
    position: Any = None
    checks: list[WeightCheck] = field(default_factory=list)
    allocations: list[shards.AllocatedCache] = field(default_factory=list)


@dataclass
class PassOutcome:
    count: int = 0
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- the plan


@dataclass
class GraphContext:
    """What is per graph and not a decision of the passes: the graph module being rewritten
    (and the original, kept when the rewrite stops), each input's example value, the options
    and the report. Passes edit `gm`'s graph and write the report; what they decide goes into
    the plan."""

    original: fx.GraphModule
    gm: fx.GraphModule  # the working copy (the original once the rewrite stops)
    values: dict[str, Any]  # placeholder name -> example input
    config: PassConfig
    report: GraphReport
    stopped: Optional[str] = None  # why the DCP rewrite stopped (the original graph is kept)

    @classmethod
    def of(
        cls, gm: fx.GraphModule, example_inputs: Sequence[Any], config: PassConfig, report: GraphReport
    ) -> "GraphContext":
        """A context over a working copy of `gm`."""
        return cls(
            gm, fx_util.copy_dynamo_graph_module(gm), fx_util.placeholder_values(gm, example_inputs), config, report
        )

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def stop(self, reason: str) -> None:
        self.stopped = reason
        self.gm = self.original


@dataclass(frozen=True)
class CacheShard:
    """A cache tensor's shard on this rank: its state.store.LocalCache and the graph input
    that carries it (whose meta says the shard's row format)."""

    entry: LocalCache
    node: fx.Node


@dataclass(frozen=True)
class RewrittenLayer:
    """What the attention pass left where a layer's attention was: what the passes after it build on."""

    merged: MergedOutput
    shape: tuple  # the merged output's sizes as [B, S, H, F] (H: the heads this rank ends with)
    report: LayerReport


@dataclass(frozen=True)
class LayerPlan:
    """One matched attention and what the passes decided for it, each field set by one pass."""

    match: MlaMatch
    kind: CacheKind  # the kind of the cache its values are read from
    stand_ins: tuple[allocation.StandIn, ...] = ()  # allocations among the caches it reads
    kept: Optional[str] = None  # why it stays as it is (in the user's terms); None: it is rewritten
    cache_shards: Mapping[fx.Node, CacheShard] = field(default_factory=dict)  # striped_writes: its caches'
    query: Optional[tuple[Any, str]] = None  # query_replication: (the query it reads or None, how)
    rewritten: Optional[RewrittenLayer] = None  # attention

    @property
    def layer(self) -> str:
        return self.match.layer

    @property
    def local_nodes(self) -> dict[fx.Node, fx.Node]:
        """Each cache tensor it reads -> the graph input of this rank's shard."""
        return {buf: shard.node for buf, shard in self.cache_shards.items()}


@dataclass(frozen=True)
class GraphPlan:
    """What the passes of one graph hand each other: each pass reads some fields and returns
    the plan with the fields it adds (`GraphPass.reads`, `GraphPass.adds`)."""

    kept_layers: Mapping[str, str] = field(default_factory=dict)  # layers to leave as they are -> why
    stand_ins: Mapping[fx.Node, allocation.StandIn] = field(default_factory=dict)  # allocated caches
    prefixes: tuple[allocation.CausalPrefix, ...] = ()  # causal prefixes over the stand-ins
    layers: tuple[LayerPlan, ...] = ()  # every matched attention, rewritten or kept
    writes: Mapping[fx.Node, list[CacheAccess]] = field(default_factory=dict)  # cache tensor -> its writes
    buffers: frozenset[fx.Node] = frozenset()  # the cache tensors striped
    cache_shards: Mapping[fx.Node, CacheShard] = field(default_factory=dict)  # each striped cache tensor's
    replicator: Optional[q_replicate.QueryReplicator] = None  # the inputs query replication added
    caches: tuple[tuple[int, LocalCache], ...] = ()  # (input index, shard) of each installed shard
    allocations: tuple[shards.AllocatedCache, ...] = ()  # each stand-in's, in input order
    position: Any = None  # how the backend feeds a step position moved to the device

    @property
    def rewritten(self) -> tuple[LayerPlan, ...]:
        return tuple(layer for layer in self.layers if layer.kept is None)


PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(GraphPlan))


class GraphPass:
    """One named step: `run(ctx, plan)` returns the plan with the fields named in `adds` set
    (`reads`: the fields it reads) and the outcome reported. `rewrite_only`: skipped once the
    DCP rewrite has stopped."""

    name = "?"
    rewrite_only = True
    reads: tuple[str, ...] = ()
    adds: tuple[str, ...] = ()

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        raise NotImplementedError


# ----------------------------------------------------------------------------- the passes


class AllocatedCaches(GraphPass):
    """Cache tensors the graph allocates become inputs, so that each rank allocates only its
    stripe (rewrites/allocation.py); those no rewritten attention reads are put back by `match`."""

    name = "allocated_caches"
    adds = ("stand_ins", "prefixes")

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        # at dcp_size=1 too: the stripe is the whole cache, but the prefill then attends over it
        # through the op (a causal cap, a boolean mask read in place), not through SDPA with an
        # [S, T] mask made 16-bit (8 GiB for a 64K-token prefill), and no decode step copies it
        if ctx.config.kv_cache_dtype:
            return plan, PassOutcome(0, ["kv_cache_dtype: allocated caches are striped at their first decode step"])
        from dcp_pass.rewrites.match import load_recognisers

        load_recognisers()  # they register the allocation forms
        symbolic: list[str] = []
        stand_ins: dict[fx.Node, allocation.StandIn] = {}
        for stand_in in allocation.stand_in_allocations(ctx.graph, symbolic):
            stand_ins[stand_in.placeholder] = stand_in
            example = fx_util.node_value(stand_in.placeholder)
            ctx.values[stand_in.placeholder.name] = unallocated(
                example.shape, example.stride(), example.dtype, example.device
            )
        prefixes = allocation.causal_prefix_over_cache(ctx.graph, list(stand_ins.values()))
        notes = [f"{buffer_name(p)} allocated in the graph" for p in stand_ins]
        notes += [
            f"{p.name}: causal attention over the first positions, as causal attention over the cache" for p in prefixes
        ]
        if symbolic:
            # Dynamo compiled this graph for any cache length (a generate with a longer cache than
            # the one before): the stripe's size would be a run-time value
            note = (
                f"{', '.join(module_path(s) for s in symbolic)}: allocated with a symbolic size, so at full "
                f"size here (each rank keeps its stripe from the first decode step); keep the cache length "
                f"fixed (generate's max_length, or a StaticCache made once) to allocate stripes only"
            )
            notes.append(note)
            ctx.report.notes.append(note)
        plan = replace(plan, stand_ins=stand_ins, prefixes=tuple(prefixes))
        return plan, PassOutcome(len(stand_ins), notes)


GRAPH_BREAK_AFTER_WRITES = "the cache written here is read after a graph break"


class FindAttention(GraphPass):
    """Run every registered recogniser: one LayerPlan per attention found (those of
    `kept_layers` kept); near misses are reported (or raised when strict). Stand-ins no
    rewritten attention reads are put back."""

    name = "match"
    reads = ("kept_layers", "stand_ins", "prefixes")
    adds = ("layers", "writes", "buffers", "stand_ins", "prefixes")

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        found = find_mla(ctx.graph)
        kept = [m for m in found.matches if m.layer in plan.kept_layers]
        matches = [m for m in found.matches if m.layer not in plan.kept_layers]
        ctx.report.layers.extend(LayerReport(m.layer, False, plan.kept_layers[m.layer]) for m in kept)
        ctx.report.near_misses.extend(found.near_misses)
        ctx.report.notes.extend(found.notes)  # attention that is not MLA, one line each
        if ctx.config.strict and found.near_misses:
            where, reason = found.near_misses[0]
            raise DcpRewriteError(f"near-miss MLA pattern at {where}: {reason} (strict=True)")
        buffers = {b for m in matches for b in m.buffers} | {b for b in found.writes if is_released(ctx.values[b.name])}
        written = sorted({buffer_name(b) for b in [*found.writes, *plan.stand_ins]})  # before any is put back
        stand_ins = dict(plan.stand_ins)
        prefixes = list(plan.prefixes)
        dropped = {p for p in stand_ins if p not in buffers}  # no rewritten attention reads them
        for prefix in [p for p in prefixes if p.placeholders & dropped]:
            allocation.undo_prefix(ctx.graph, prefix)
            prefixes.remove(prefix)
        for placeholder in dropped:
            allocation.put_back(ctx.graph, stand_ins.pop(placeholder))
            found.writes.pop(placeholder, None)
        layers = tuple(
            LayerPlan(
                m,
                m.value_cache.kind,
                tuple(stand_ins[b] for b in m.buffers if b in stand_ins),
                plan.kept_layers.get(m.layer),
            )
            for m in found.matches
        )
        plan = replace(
            plan,
            layers=layers,
            writes=found.writes,
            buffers=frozenset(buffers),
            stand_ins=stand_ins,
            prefixes=tuple(prefixes),
        )
        if not buffers:
            _refuse_released(ctx.graph, ctx.values, found.near_misses)
            reason = "no absorbed-MLA attention in this graph"
            if found.near_misses:  # attention was found: say that none of it could be rewritten
                count = len(found.near_misses)
                reason = f"no attention in this graph that the pass can rewrite ({count} near miss(es))"
            cut = fx_util.graph_break_site(ctx.original)
            if cut is not None and written:
                # the layer's attention runs in a later graph (or uncompiled, past Dynamo's
                # recompile_limit), over keys and values handed across the break, not the cache
                reason = (
                    f"{GRAPH_BREAK_AFTER_WRITES} ({', '.join(written)}): Dynamo cut the graph at {cut}, so "
                    f"the attention reads keys and values passed across the break, not the cache (in a later "
                    f"graph, or uncompiled once torch._dynamo.config.recompile_limit is reached); remove the "
                    f"graph break (TORCH_LOGS=graph_breaks lists them)"
                )
                if ctx.config.strict:
                    raise DcpRewriteError(f"{reason} (strict=True)")
            ctx.stop(reason)
            ctx.report.unchanged_reason = reason
        return plan, PassOutcome(len(matches), [f"{m.layer}: {m.family}" for m in matches] + found.notes)


class StripedWrites(GraphPass):
    """Give each cache tensor of the plan its shard input, and stripe the writes into it."""

    name = "striped_writes"
    reads = ("layers", "writes", "buffers", "stand_ins")
    adds = ("layers", "cache_shards")

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        attn = ctx.config.plan
        for layer in plan.rewritten:
            why = layer.match.check_plan(attn)
            if why is not None:
                raise DcpRewriteError(why)
        reads = {
            read.buffer: read
            for layer in plan.rewritten
            for read in [t.cache for t in layer.match.terms] + [layer.match.value_cache]
        }
        for read in reads.values():
            check = read.kind.stripe_check
            why = check(read, attn.c) if check is not None else None
            if why is not None:
                if is_released(ctx.values[read.buffer.name]):
                    raise DcpRewriteError(why)
                ctx.stop(why)
                ctx.report.unchanged_reason = why
                return plan, PassOutcome(0, [why])
        formats = _fp8_formats(ctx, plan.rewritten) if ctx.config.kv_cache_dtype else {}
        # shards of allocated caches last, in the order of their inputs: the backend passes them so
        allocated = {p: i for i, p in enumerate(plan.stand_ins)}
        made: dict[fx.Node, CacheShard] = {}
        for index, buf in enumerate(sorted(plan.buffers, key=lambda n: (allocated.get(n, -1), n.name))):
            # how the attention reads it, else (a striped cache only written here) how it is written
            kind = (reads[buf].kind if buf in reads else plan.writes[buf][0].kind).shards
            if buf in plan.stand_ins:  # an example shard: the backend makes each call's
                entry = _allocated_cache(ctx, buf, kind).shard()
            else:
                entry = shards.shard_for(
                    ctx.values[buf.name], attn.c, attn.rank, buffer_name(buf), kind, formats.get(buf, "")
                )
            node = fx_util.static_placeholder(ctx.graph, f"dcp_local_cache_{index}", entry.local)
            node.meta["dcp_kv_format"] = entry.kv_format  # the attention rewrite reads the shard's row format
            made[buf] = CacheShard(entry, node)
        count = 0
        for buf, writes in plan.writes.items():
            if buf in made:
                for write in writes:
                    feeding = list(write.node.all_input_nodes)
                    entry = made[buf].entry
                    if entry.kv_format:  # quantised in the graph: the striped write stores packed bytes
                        try:
                            write = fp8_packed_write(ctx.graph, write, entry.kv_format, entry.name)
                        except Fp8Refused as why:
                            raise DcpRewriteError(f"{_FP8_REFUSED}: {why}") from why
                    write.rewrite_write(ctx.graph, made[buf].node, entry)
                    fx_util.erase_dead_region(ctx.graph, feeding)  # e.g. the pool's flat view
                    count += 1
        layers = tuple(
            layer if layer.kept is not None else replace(layer, cache_shards={b: made[b] for b in layer.match.buffers})
            for layer in plan.layers
        )
        notes = [f"{buffer_name(b)}: {f}" for b, f in sorted(formats.items(), key=lambda bf: bf[0].name)]
        return replace(plan, layers=layers, cache_shards=made), PassOutcome(count, notes)


class QueryReplication(GraphPass):
    """Per layer: replicated q-projection / w_kc (option replicate_q_proj), gathered or local queries."""

    name = "query_replication"
    reads = ("layers",)
    adds = ("layers", "replicator")

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        replicator = q_replicate.QueryReplicator(ctx.gm, ctx.values, ctx.config.plan, ctx.config.replicate_q_proj)
        layers = []
        for layer in plan.layers:
            if layer.kept is None:
                try:
                    layer = replace(layer, query=replicator.queries_for(layer.match))
                except NearMiss as miss:
                    _striped_already(layer.match, miss)
            layers.append(layer)
        count = sum(layer.query is not None and layer.query[0] is not None for layer in layers)
        return replace(plan, layers=tuple(layers), replicator=replicator), PassOutcome(count)


def _rewrite(match: MlaMatch, gm: fx.GraphModule, attn: AttentionPlan, local_nodes, override) -> MergedOutput:
    """The match's own rewrite where its kind defines one (per-head attention), else the MLA one."""
    own = getattr(match, "rewrite", None)
    if own is not None:
        return own(gm, attn, local_nodes, override)
    return rewrite_attention(gm, match, attn, local_nodes, override)


class AttentionRewrite(GraphPass):
    """Each match becomes shard-local attention + the exchange that merges the partials."""

    name = "attention"
    reads = ("layers",)
    adds = ("layers",)

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        layers = []
        for layer in plan.layers:
            if layer.kept is None:
                layer = replace(layer, rewritten=self._rewrite(ctx, layer))
            layers.append(layer)
        return replace(plan, layers=tuple(layers)), PassOutcome(sum(layer.kept is None for layer in layers))

    @staticmethod
    def _rewrite(ctx: GraphContext, layer: LayerPlan) -> RewrittenLayer:
        attn, match = ctx.config.plan, layer.match
        override, q_detail = layer.query if layer.query is not None else (None, "all-gather")
        shape = _merged_shape(match)
        try:
            merged = _rewrite(match, ctx.gm, attn, layer.local_nodes, override)
        except NearMiss as miss:
            _striped_already(match, miss)
        kind = "decode" if _is_decode(match) else "multi-token"
        window = ", sliding window" if match.value_cache.windowed else ""
        window += layer.kind.layer_note
        kv_format = layer.cache_shards[match.value_cache.buffer].node.meta.get("dcp_kv_format", "")
        window += f", kv cache {kv_format}" if kv_format else ""
        report = LayerReport(
            match.layer,
            True,
            f"{kind}{window}, {match.family} form, {len(match.terms)} score term(s), q {q_detail}, "
            f"comm {_comm_name(attn)}, lse base {attn.lse_base}, attention {attn.attn_backend}"
            + "".join(f", {note}" for note in match.rewrite_notes),
        )
        ctx.report.layers.append(report)
        return RewrittenLayer(merged, shape, report)


class ProjectBeforeMerge(GraphPass):
    """Per layer: the value up-projection that follows the attention moves before the
    exchange, which then carries v_head_dim columns instead of the latent width
    (rewrites/project_merge.py)."""

    name = "project_before_merge"
    reads = ("layers", "replicator")

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        requested = ctx.config.project_before_merge
        if requested is False:
            return plan, PassOutcome(0, ["off"])
        if ctx.config.plan.c == 1:  # the single-GPU fast path: nothing is exchanged
            return plan, PassOutcome(0, ["no exchange at dcp_size=1"])
        count, notes = 0, []
        for layer in plan.rewritten:
            try:
                detail = self._project(ctx, plan.replicator, layer.match, layer.rewritten)
                count += 1
            except project_merge.NotProjected as why:
                if requested:
                    raise DcpRewriteError(
                        f"layer {layer.layer}: project_before_merge=True, but {why}; pass "
                        f"project_before_merge='auto' to keep the projection after the merge where it cannot move"
                    ) from why
                detail = f"v-projection after merge ({why})"
            layer.rewritten.report.detail += f", {detail}"
            notes.append(f"{layer.layer}: {detail}")
        return plan, PassOutcome(count, notes)

    @staticmethod
    def _project(
        ctx: GraphContext, replicator: q_replicate.QueryReplicator, match: MlaMatch, rewritten: RewrittenLayer
    ) -> str:
        attn = ctx.config.plan
        graph = ctx.graph
        exchange = rewritten.merged.exchange
        if match.lse_outputs:  # its exchange feeds the model's LSE too: it stays one exchange
            raise project_merge.NotProjected("the model reads the attention's LSE from the same exchange")
        found = project_merge.find_projection(exchange, rewritten.shape, q_replicate.is_parameter)
        out_dtype = fx_util.node_value(found.node).dtype  # the projection's
        in_dtype = match.out_dtype  # the attention output the projection read
        project_merge.check_operand_dtypes(in_dtype, fx_util.node_value(found.weight).dtype)
        query = fx_util.node_value(match.terms[0].query)  # the local attention's output has its dtype
        partial_dtype = query.dtype if isinstance(query, torch.Tensor) else None
        if attn.comm_backend == "fi_a2a" and attn.head_sharded and (found.v_dim * out_dtype.itemsize) % 16:
            raise project_merge.NotProjected(
                f"FlashInfer's all-to-all moves rows of 16-byte multiples, and {found.v_dim} "
                f"{str(out_dtype).replace('torch.', '')} columns are not"
            )
        if not attn.head_sharded:  # every rank holds every head: the local weight covers them
            weights = [found.weight]
            for param in found.params:  # as the query weights: the same on every rank, checked
                replicator.rely_on_same(param)
        else:
            # a fingerprint decides which parameters differ across the group (a fake test group
            # cannot tell: gather); the others are the same on every rank and shared
            sharded = [
                p for p in found.params if weights_differ(ctx.values[p.name], attn.group_name, attn.c, no_verdict=True)
            ]
            project_merge.check_gatherable(sharded, lambda p: ctx.values[p.name].dtype)
            for param in found.params:  # projected for the other ranks' chunks as this rank holds it
                if param not in sharded:
                    replicator.rely_on_same(param)
            weights = [
                found.weight
                if r == attn.rank or not sharded
                else project_merge.weight_for_rank(
                    graph, found, sharded, lambda p, r=r: replicator.weight_input(p, r, prefix="dcp_vc_weight")
                )
                for r in range(attn.c)
            ]
        project_merge.emit_projection(graph, exchange, found, weights, in_dtype, partial_dtype, out_dtype)
        return f"v-projection before merge (exchanges {found.v_dim} instead of {rewritten.shape[3]} columns per head)"


class VerifyBuffers(GraphPass):
    """No node may read a full-size cache buffer any more (else the layers whose caches are
    used outside their attention are kept, starting again, or the graph is)."""

    name = "verify_buffers"
    reads = ("layers", "buffers", "stand_ins")

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        graph, values = ctx.graph, ctx.values
        leftovers = [
            n
            for n in graph.nodes
            if n in plan.buffers and n.users and not (n in plan.stand_ins and allocation.only_returned(n))
        ]
        if leftovers:
            uses = "; ".join(f"{buffer_name(n)}: {', '.join(_describe_use(u) for u in n.users)}" for n in leftovers)
            reason = f"cache buffers are used outside the matched attention ({uses})"
            rings = [r for r in map(_ring_write, leftovers) if r]
            if len(rings) == len(leftovers):  # said once, in the model's terms
                more = len(rings) - 1
                reason = rings[0] + (f"; {more} more cache(s) of this graph are rings too" if more else "")
            if any(is_released(values[n.name]) for n in leftovers) or ctx.config.strict:
                raise DcpRewriteError(reason + shards.striped_with_note([values[n.name] for n in leftovers]))
            kept = _layers_to_keep(plan.rewritten, leftovers)
            if kept and len(kept) < len(plan.rewritten):
                raise _KeepLayers(kept)  # apply_dcp starts again without them
            ctx.report.layers = [
                layer if not layer.rewritten else LayerReport(layer.layer, False, kept.get(layer.layer, reason))
                for layer in ctx.report.layers
            ]
            ctx.report.unchanged_reason = reason
            log.warning("dcp_pass: graph left unchanged: %s", reason)
            ctx.stop(reason)
            return plan, PassOutcome(0, [reason])
        _refuse_released(graph, values)  # e.g. a deferred buffer read next to a matched attention
        return plan, PassOutcome(len(plan.buffers))


class ComplexAsReal(GraphPass):
    """The reference rotary's complex products in real arithmetic (after query replication,
    so that its copies of the rotary are rewritten too)."""

    name = "complex_as_real"

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        if not ctx.config.complex_as_real:
            return plan, PassOutcome(0, ["off"])
        count = complex_product.complex_products_as_real(ctx.graph)
        notes = [f"{count} complex product(s) (rotary) computed in real arithmetic"] if count else []
        ctx.report.notes.extend(notes)
        return plan, PassOutcome(count, notes)


class InstallShards(GraphPass):
    """Release the full-size caches: from here on each rank holds only its stripe."""

    name = "install_shards"
    reads = ("cache_shards", "stand_ins")
    adds = ("caches", "allocations")

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        attn = ctx.config.plan
        kept = {buf: shard.entry for buf, shard in plan.cache_shards.items() if buf not in plan.stand_ins}
        for buf, entry in kept.items():  # a stand-in's shard is made anew by every call
            if entry.kind.installed_at_first_call:
                shards.install_at_first_call(ctx.values[buf.name], entry)
            else:
                shards.install(ctx.values[buf.name], entry)
        placeholders = fx_util.placeholders(ctx.graph)
        # the graph decided for each buffer it takes (a kept layer's stays whole)
        inputs = [ctx.values[p.name] for p in placeholders if p.name in ctx.values]
        siblings = 0
        for buf, entry in kept.items():
            # the same cache of the other layers this graph will be called with
            for other, name in shards.sibling_buffers(ctx.values[buf.name], fx_util.dynamo_source_name(buf), inputs):
                shards.stripe_sibling(other, name, ctx.values[buf.name], attn.c, attn.rank, entry)
                siblings += 1
        caches = tuple((placeholders.index(buf), entry) for buf, entry in kept.items())
        allocations = tuple(
            _allocated_cache(ctx, buf, plan.cache_shards[buf].entry.kind)
            for buf in placeholders
            if buf in plan.stand_ins
        )
        allocation.drop_factories(ctx.graph, list(plan.stand_ins.values()))
        ctx.graph.lint()
        ctx.gm.recompile()
        notes = [f"{siblings} cache buffer(s) of other layers striped with them"] if siblings else []
        return replace(plan, caches=caches, allocations=allocations), PassOutcome(len(plan.cache_shards), notes)


class DevicePositions(GraphPass):
    """An int step position becomes device data where the graph allows it (static shapes)."""

    name = "device_positions"
    rewrite_only = False
    adds = ("position",)

    def run(self, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
        from dcp_pass.rewrites.positions import NotStatic, has_symbolic_input, positions_to_device

        if not ctx.config.static_positions or not has_symbolic_input(ctx.gm.graph):
            return plan, PassOutcome(0)
        try:
            ctx.gm, position = positions_to_device(ctx.gm)
        except NotStatic as why:
            note = f"int position kept (no static-shape decode graph): {why}"
            ctx.report.notes.append(note)
            return plan, PassOutcome(0, [note])
        note = "int step position moved to the device (static-shape graph)"
        ctx.report.notes.append(note)
        return replace(plan, position=position), PassOutcome(1, [note])


DEFAULT_PASSES: tuple[GraphPass, ...] = (
    AllocatedCaches(),
    FindAttention(),
    StripedWrites(),
    QueryReplication(),
    AttentionRewrite(),
    ProjectBeforeMerge(),
    VerifyBuffers(),
    ComplexAsReal(),
    InstallShards(),
    DevicePositions(),
)

Observer = Callable[[str, fx.GraphModule], None]


def run_pass(graph_pass: GraphPass, ctx: GraphContext, plan: GraphPlan) -> tuple[GraphPlan, PassOutcome]:
    """One pass over `ctx`'s graph with `plan`; an error when it sets a plan field it does not declare."""
    new, outcome = graph_pass.run(ctx, plan)
    changed = [name for name in PLAN_FIELDS if getattr(new, name) is not getattr(plan, name)]
    undeclared = [name for name in changed if name not in graph_pass.adds]
    if undeclared:
        raise AssertionError(f"pass {graph_pass.name} set {', '.join(undeclared)}, which it does not declare")
    return new, outcome


def run_passes(
    ctx: GraphContext,
    plan: GraphPlan,
    passes: Sequence[GraphPass] = DEFAULT_PASSES,
    observer: Optional[Observer] = None,
) -> GraphPlan:
    """Run `passes` in order, each handed the plan the one before returned, recording each
    outcome in the report (and showing the graph after each to `observer`)."""
    for graph_pass in passes:
        if graph_pass.rewrite_only and ctx.stopped is not None:
            continue
        plan, outcome = run_pass(graph_pass, ctx, plan)
        ctx.report.passes.append(PassRecord(graph_pass.name, outcome.count, list(outcome.notes)))
        if observer is not None:
            observer(graph_pass.name, ctx.gm)
    return plan


class _KeepLayers(Exception):
    """Verification found these layers' caches used outside their attention: the rewrite
    starts again from the original graph with them left as they are."""

    def __init__(self, layers: dict[str, str]):
        super().__init__(", ".join(layers))
        self.layers = layers


def _layers_to_keep(layers: Sequence[LayerPlan], leftovers: list[fx.Node]) -> dict[str, str]:
    """Layer -> why it stays as it is: every match reading a cache that is used outside the
    matched attention (and, through shared caches, every match reading the same cache)."""
    blocked = set(leftovers)
    kept: dict[str, str] = {}
    grew = True
    while grew:
        grew = False
        for match in (layer.match for layer in layers):
            if match.layer not in kept and blocked & set(match.buffers):
                uses = "; ".join(
                    f"{buffer_name(n)}: {', '.join(_describe_use(u) for u in n.users)}"
                    for n in match.buffers
                    if n in leftovers
                )
                ring = next((r for r in map(_ring_write, match.buffers) if r), None)
                if ring:
                    kept[match.layer] = f"left as it is: {ring}; every rank keeps it whole"
                else:
                    what = "a rolling (sliding-window) cache, used" if "roll" in uses else "its cache is used"
                    kept[match.layer] = (
                        f"left as it is: {what} outside the attention "
                        f"({uses or 'shared with a layer left as it is'}); every rank keeps it whole"
                    )
                blocked |= set(match.buffers)
                grew = True
    return kept


def apply_dcp(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: PassConfig,
    report: GraphReport,
    observer: Optional[Observer] = None,
) -> DcpPassResult:
    """Rewrite every MLA attention of `gm` (see `DcpPassResult`)."""
    kept: dict[str, str] = {}
    while True:
        ctx = GraphContext.of(gm, example_inputs, config, report)
        try:
            plan = run_passes(ctx, GraphPlan(kept_layers=dict(kept)), observer=observer)
            break
        except _KeepLayers as found:
            kept.update(found.layers)
            # the report restarts with the next attempt (the kept layers' lines are written again)
            report.reset()
    if ctx.stopped is not None:
        return DcpPassResult(ctx.gm, position=plan.position)
    replicator = plan.replicator
    return DcpPassResult(
        ctx.gm,
        list(plan.caches),
        replicator.extra if replicator else [],
        plan.position,
        replicator.checks if replicator else [],
        list(plan.allocations),
    )


# ----------------------------------------------------------------------------- helpers


def _allocated_cache(ctx: GraphContext, buf: fx.Node, kind: ShardKind) -> shards.AllocatedCache:
    attn = ctx.config.plan
    return shards.AllocatedCache.of(
        ctx.values[buf.name],
        position_axis(buf),
        attn.c,
        attn.rank,
        buffer_name(buf),
        kind,
        tuple(allocation.output_positions(ctx.graph, buf)),
    )


_FP8_REFUSED = "kv_cache_dtype='fp8_e4m3' cannot store this graph's cache as fp8"


def _fp8_formats(ctx: GraphContext, layers: Sequence[LayerPlan]) -> dict:
    """Buffer node -> the packed fp8 layout spec of every latent cache of the layers' matches
    (the same for every layer reading it); DcpRewriteError naming the layer where one cannot be."""
    formats: dict = {}
    for match in (layer.match for layer in layers):
        try:
            spec = fp8_layout_of(match, ctx.values).spec()
        except Fp8Refused as why:
            raise DcpRewriteError(
                f"{_FP8_REFUSED}: layer {match.layer}: {why}; pass kv_cache_dtype=None to keep the model's cache dtype"
            ) from why
        buf = match.value_cache.buffer
        if formats.setdefault(buf, spec) != spec:
            raise DcpRewriteError(f"{_FP8_REFUSED}: layers read {buffer_name(buf)} as {formats[buf]} and {spec}")
    return formats


def _striped_already(match: MlaMatch, miss: NearMiss):
    raise DcpRewriteError(
        f"layer {match.layer}: {miss}; its cache writes were already striped, so it cannot be left unchanged"
    ) from miss


def _released_buffers_used(graph: fx.Graph, values: dict[str, Any]) -> list[fx.Node]:
    return [
        n
        for n in graph.nodes
        if n.op == "placeholder"
        and n.users
        and isinstance(values.get(n.name), torch.Tensor)
        and is_released(values[n.name])
    ]


_MODULO = {operator.mod, torch.remainder, torch.fmod}


def _ring_write(buffer: fx.Node) -> Optional[str]:
    """Why `buffer` is not striped when the graph writes it at a position taken modulo a size
    (`cache[:b, start_pos % window] = kv`: a ring over the last `window` tokens, DeepSeek-V4's
    sliding window): its rows are ring slots, not token positions; None for other caches."""
    for use in buffer.users:
        if not (use.op == "call_function" and use.target is operator.setitem and use.args[0] is buffer):
            continue
        index = use.args[1] if isinstance(use.args[1], tuple) else (use.args[1],)
        # rows of the batch, then the ring's slot (a paged pool's `pool[page, pos % page_size]`
        # names a page first, not the batch)
        ring = index[1] if len(index) > 1 and isinstance(index[0], slice) else None
        if not (isinstance(ring, fx.Node) and ring.op == "call_function" and ring.target in _MODULO):
            continue
        size = ring.args[1] if len(ring.args) > 1 and isinstance(ring.args[1], int) else "a size"
        return (
            f"{buffer_name(buffer)} is written as a ring of {size} rows (at {where_of(use)}): its rows are "
            f"ring slots, not token positions, and DCP stripes only rows that are positions (a ring is bounded "
            f"by its size and costs the same on every rank)"
        )
    return None


def _describe_use(node: fx.Node, depth: int = 3) -> str:
    """`getitem -> index_copy_`: the op chain through which a buffer is used (for reports)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    users = list(node.users)
    if depth == 0 or len(users) != 1:
        return name
    return f"{name} -> {_describe_use(users[0], depth - 1)}"


def _refuse_released(graph: fx.Graph, values: dict[str, Any], near_misses: Sequence[tuple[str, str]] = ()) -> None:
    used = _released_buffers_used(graph, values)
    if used:
        names = ", ".join(buffer_name(n) for n in used)
        if near_misses:
            where, reason = near_misses[0]
            why = f"; the attention at {where} cannot be rewritten: {reason}"
        else:
            first = min((u for n in used for u in n.users), key=lambda u: _order(graph)[u])
            why = f"; first read at {where_of(first)}"
        raise DcpRewriteError(
            f"cache buffer(s) {names} have no full-size storage (striped by DCP in an earlier graph, or "
            f"deferred by dcp_pass.deferred_caches()), but this graph reads them outside an MLA attention "
            f"the pass can rewrite{why}{shards.striped_with_note([values[n.name] for n in used])}"
        )


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _merged_shape(match: MlaMatch) -> tuple:
    """[B, S, H, F] of the merged output: the query's batch, positions and heads (this
    rank's: the exchange gives each rank back the heads its query had), the value width."""
    term = match.terms[0]
    shape = axes.shape_of(term.query)
    return tuple(shape[term.query_roles.index(r)] for r in (B, S, H)) + (match.v_dim,)


def _is_decode(match: MlaMatch) -> bool:
    term = match.terms[0]
    shape = term.query.meta.get("example_value")
    seq_axis = term.query_roles.index("S")
    return shape is not None and shape.shape[seq_axis] == 1


def _comm_name(plan: AttentionPlan) -> str:
    if plan.c == 1:
        return "none (one rank)"
    return plan.comm_backend if plan.head_sharded else f"{plan.comm_backend} (head-replicated)"
