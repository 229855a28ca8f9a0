"""The DCP graph pass over one captured graph: match, install shards, rewrite, verify.

The pass works on a copy of the graph; only when the copy is verified (no node
reads a full-size cache buffer any more) are the cache storages released and the
copy returned. Otherwise the original graph is returned unchanged with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from dcp_pass.report import GraphReport, LayerReport, log
from dcp_pass.rewrites import cache as cache_rw
from dcp_pass.rewrites import complex_product
from dcp_pass.rewrites import fx_util
from dcp_pass.rewrites import q_replicate
from dcp_pass.rewrites.attention import AttentionPlan
from dcp_pass.rewrites.match import NearMiss, find_mla, module_path, buffer_source


class DcpRewriteError(RuntimeError):
    """The graph cannot run correctly with DCP and cannot run unchanged either."""


@dataclass(frozen=True)
class PassConfig:
    plan: AttentionPlan
    replicate_q_proj: Optional[bool]
    strict: bool
    complex_as_real: bool  # resolved from the option's "auto" by the backend


def _released_buffers_used(graph: fx.Graph, values: dict[str, Any]) -> list[fx.Node]:
    return [
        n for n in graph.nodes
        if n.op == "placeholder" and n.users and isinstance(values.get(n.name), torch.Tensor)
        and cache_rw.is_released(values[n.name])
    ]


@dataclass
class DcpPassResult:
    """What `apply_dcp` returns.

    `graph_module`: the graph module to compile (the input one when nothing changed).
    `caches`: for each cache shard input it gained, the index of the full-size buffer
    input it shards and that shard now. `weights`: the other inputs it gained (replicated
    q weights), each resolved per call from an existing input.
    """

    graph_module: fx.GraphModule
    caches: list[tuple[int, cache_rw.LocalCache]] = field(default_factory=list)
    weights: list[q_replicate.ExtraInput] = field(default_factory=list)


def apply_dcp(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: PassConfig, report: GraphReport
) -> DcpPassResult:
    """Rewrite every absorbed-MLA block of `gm` (see `DcpPassResult`)."""
    values = fx_util.placeholder_values(gm, example_inputs)
    work = fx_util.copy_dynamo_graph_module(gm)
    graph = work.graph
    found = find_mla(graph)
    report.near_misses.extend(found.near_misses)
    if config.strict and found.near_misses:
        where, reason = found.near_misses[0]
        raise DcpRewriteError(f"near-miss MLA pattern at {where}: {reason} (strict=True)")

    plan = config.plan
    buffers = {b for m in found.matches for b in m.buffers} | {
        b for b in found.writes if cache_rw.is_released(values[b.name])
    }
    if not buffers:
        _refuse_released(graph, values)
        report.unchanged_reason = "no absorbed-MLA attention in this graph" + (
            f" ({len(found.near_misses)} near miss(es) left unchanged)" if found.near_misses else "")
        return DcpPassResult(gm)

    entries: dict[fx.Node, cache_rw.LocalCache] = {}
    local_nodes: dict[fx.Node, fx.Node] = {}
    for index, buf in enumerate(sorted(buffers, key=lambda n: n.name)):
        entries[buf] = cache_rw.shard_for(values[buf.name], plan.c, plan.rank, module_path(buffer_source(buf)))
        local_nodes[buf] = cache_rw.local_cache_placeholder(graph, index, entries[buf].local)

    for buf, writes in found.writes.items():
        if buf in local_nodes:
            for write in writes:
                write.rewrite_write(graph, local_nodes[buf], entries[buf])

    replicated = q_replicate.QueryReplicator(work, values, plan, config.replicate_q_proj)
    for match in found.matches:
        try:
            override, q_detail = replicated.queries_for(match)
            match.rewrite(work, plan, local_nodes, override)
        except NearMiss as miss:
            raise DcpRewriteError(
                f"layer {match.layer}: {miss}; its cache writes were already striped, so it cannot be left unchanged"
            ) from miss
        kind = "decode" if _is_decode(match) else "multi-token"
        report.layers.append(LayerReport(
            match.layer, True,
            f"{kind}, {len(match.terms)} score term(s), q {q_detail}, comm {_comm_name(plan)}, "
            f"lse base {plan.lse_base}, attention {plan.attn_backend}",
        ))
    leftovers = [n for n in graph.nodes if n in buffers and n.users]
    if leftovers:
        uses = "; ".join(f"{module_path(buffer_source(n))}: {', '.join(_describe_use(u) for u in n.users)}"
                         for n in leftovers)
        reason = f"cache buffers are used outside the matched attention ({uses})"
        if any(cache_rw.is_released(values[n.name]) for n in leftovers) or config.strict:
            raise DcpRewriteError(reason)
        report.layers = [LayerReport(layer.layer, False, reason) for layer in report.layers]
        report.unchanged_reason = reason
        log.warning("dcp_pass: graph left unchanged: %s", reason)
        return DcpPassResult(gm)

    _refuse_released(graph, values)  # e.g. a deferred buffer read next to a matched attention
    if config.complex_as_real:  # after the query replication, so its rotaries are rewritten too
        count = complex_product.complex_products_as_real(graph)
        if count:
            report.notes.append(f"{count} complex product(s) (rotary) computed in real arithmetic")
    for buf, entry in entries.items():
        cache_rw.install(values[buf.name], entry)
    placeholders = fx_util.placeholders(graph)
    caches = [(placeholders.index(buf), entries[buf]) for buf in local_nodes]
    graph.lint()
    work.recompile()
    return DcpPassResult(work, caches, replicated.extra)


def _describe_use(node: fx.Node, depth: int = 3) -> str:
    """`getitem -> index_copy_`: the op chain through which a buffer is used (for reports)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    users = list(node.users)
    if depth == 0 or len(users) != 1:
        return name
    return f"{name} -> {_describe_use(users[0], depth - 1)}"


def _refuse_released(graph: fx.Graph, values: dict[str, Any]) -> None:
    used = _released_buffers_used(graph, values)
    if used:
        names = ", ".join(module_path(buffer_source(n)) for n in used)
        raise DcpRewriteError(
            f"cache buffer(s) {names} have no full-size storage (striped by DCP in an earlier graph, or "
            f"deferred by dcp_pass.deferred_caches()), but this graph reads them outside an MLA attention "
            f"the pass can rewrite"
        )


def _is_decode(match) -> bool:
    shape = match.terms[0].query.meta.get("example_value")
    seq_axis = match.terms[0].query_roles.index("S")
    return shape is not None and shape.shape[seq_axis] == 1


def _comm_name(plan: AttentionPlan) -> str:
    return plan.comm_backend if plan.head_sharded else f"{plan.comm_backend} (head-replicated)"
