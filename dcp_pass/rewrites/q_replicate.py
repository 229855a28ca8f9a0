"""Compile-time replication of the query projection (SPEC section 3).

Instead of all-gathering the queries of the DCP group in every layer, each rank
holds the q-projection and `w_kc` shards of all DCP ranks (gathered once) and
computes the whole group's queries itself: one collective less per layer, for c-fold
q-weight memory and GEMM work.

How: the nodes that compute a query operand from TP-sharded weights are cloned once
per other DCP rank, with that rank's weight shards as extra graph inputs; the clones'
outputs are concatenated along heads in DCP-rank order. A weight is "sharded" when
the compile-time gather shows different values on different ranks. Only unquantized
bf16/fp16 weights take this path; anything else keeps the query all-gather.

Like the cache shards, the gathered weights are resolved per call from the weight
tensor actually passed: one compiled graph can serve several layers.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.match import MlaMatch, buffer_source

REPLICABLE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class ExtraInput:
    """A trailing graph input whose value is derived, per call, from an existing input."""

    index: int  # the existing input it is derived from
    resolve: Callable[[torch.Tensor], torch.Tensor]
    example: torch.Tensor


_GATHERED: dict[int, tuple["weakref.ref[torch.Tensor]", list[torch.Tensor]]] = {}


def gathered_shards(weight: torch.Tensor, group_name: str, c: int) -> list[torch.Tensor]:
    """Every DCP rank's shard of `weight` (an eager all-gather on first use, then cached)."""
    held = _GATHERED.get(id(weight))
    if held is not None and held[0]() is weight:
        return held[1]
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    local = weight.detach().contiguous()
    if dist.get_backend(group) == "gloo":
        # gloo lacks half-precision (and int16) all-gathers: move the raw bytes instead
        raw = local.reshape(-1).view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(c)]
        dist.all_gather(parts, raw, group=group)
        parts = [p.view(local.dtype).view(local.shape) for p in parts]
    else:
        parts = [torch.empty_like(local) for _ in range(c)]
        dist.all_gather(parts, local, group=group)
    _GATHERED[id(weight)] = (weakref.ref(weight), parts)
    return parts


def _is_parameter(node: fx.Node) -> bool:
    name = buffer_source(node) if node.op == "placeholder" else None
    return bool(name and "_parameters[" in name)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


class QueryReplicator:
    """Decides per layer between replicated and gathered queries and emits the clones."""

    def __init__(self, gm: fx.GraphModule, values: dict[str, Any], plan, requested: Optional[bool]):
        self.gm = gm
        self.values = values
        self.plan = plan
        self.requested = requested
        self.extra: list[ExtraInput] = []
        self._weight_inputs: dict[tuple[fx.Node, int], fx.Node] = {}

    def queries_for(self, match: MlaMatch) -> tuple[Optional[tuple[fx.Node, Optional[fx.Node]]], str]:
        """(override queries or None, description for the report)."""
        if not self.plan.head_sharded:
            return None, "local (all heads on every rank)"
        if self.requested is False:
            return None, "all-gather"
        reason = self._ineligible(match)
        if reason:
            return None, f"all-gather ({reason})"
        return self._emit(match), "replicated q-proj/w_kc"

    # -- eligibility ---------------------------------------------------------------

    def _query_params(self, match: MlaMatch) -> list[fx.Node]:
        params: set[fx.Node] = set()
        for term in match.terms:
            params |= {n for n in _ancestors(term.query) if _is_parameter(n)}
        return sorted(params, key=lambda n: n.name)

    def _ineligible(self, match: MlaMatch) -> str:
        params = self._query_params(match)
        if not params:
            return "queries use no weights"
        dtypes = {self.values[p.name].dtype for p in params}
        if not dtypes <= set(REPLICABLE_DTYPES):
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
            return f"q weights are {names}; replication takes unquantized bf16/fp16 only"
        self._sharded = [p for p in params if self._differs_across_ranks(p)]
        if not self._sharded:
            return "no q weight differs across DCP ranks"
        return ""

    def _differs_across_ranks(self, param: fx.Node) -> bool:
        weight = self.values[param.name]
        parts = gathered_shards(weight, self.plan.group_name, self.plan.c)
        return not all(torch.equal(parts[0], p) for p in parts[1:])

    # -- emission ------------------------------------------------------------------

    def _weight_input(self, param: fx.Node, rank: int) -> fx.Node:
        key = (param, rank)
        if key not in self._weight_inputs:
            from dcp_pass.rewrites.cache import static_placeholder

            graph = self.gm.graph
            plan = self.plan
            weight = self.values[param.name]
            example = gathered_shards(weight, plan.group_name, plan.c)[rank]
            node = static_placeholder(graph, f"dcp_q_weight_{len(self._weight_inputs)}", axes.example_value(param))
            index = [n for n in graph.nodes if n.op == "placeholder"].index(param)
            self.extra.append(ExtraInput(
                index, lambda w, r=rank: gathered_shards(w, plan.group_name, plan.c)[r], example))
            self._weight_inputs[key] = node
        return self._weight_inputs[key]

    def _emit(self, match: MlaMatch) -> tuple[fx.Node, Optional[fx.Node]]:
        from dcp_pass.rewrites.attention import CANON_Q, ordered_terms, to_canonical

        graph = self.gm.graph
        latent, rope = ordered_terms(match)
        outputs = [latent.query] + ([rope.query] if rope else [])
        needed = set().union(*(_ancestors(q) for q in outputs))
        tainted = {n for n in graph.nodes if n in needed and (set(_ancestors(n)) & set(self._sharded))}
        per_rank: list[list[fx.Node]] = []
        with graph.inserting_before(match.softmax):
            for rank in range(self.plan.c):
                if rank == self.plan.rank:
                    copies = outputs
                else:
                    env: dict[fx.Node, fx.Node] = {p: self._weight_input(p, rank) for p in self._sharded}
                    for node in [n for n in graph.nodes if n in tainted and n not in env]:
                        env[node] = graph.node_copy(node, lambda n: env.get(n, n))
                    copies = [env[q] for q in outputs]
                per_rank.append([
                    to_canonical(graph, q, term.query_roles, CANON_Q)
                    for q, term in zip(copies, [latent] + ([rope] if rope else []))
                ])
            q_lat = graph.call_function(torch.cat, ([r[0] for r in per_rank], 2))
            q_rope = graph.call_function(torch.cat, ([r[1] for r in per_rank], 2)) if rope else None
        return q_lat, q_rope

    def finalize(self) -> None:
        pass
