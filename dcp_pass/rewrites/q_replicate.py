"""Compile-time replication of the query projection (option replicate_q_proj, docs/usage.md).

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
tensor actually passed (one compiled graph can serve several layers): the graph's extra
inputs refer to the weight store, dcp_pass/state/weights.py.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, fx_util
from dcp_pass.rewrites.match import MlaMatch, NearMiss, buffer_source
from dcp_pass.state.weights import (
    ExtraInput,
    WeightCheck,
    gathered_shards,
    remember_same,
    same_weight_check,
    shards_lookup,
    weights_differ,
)

REPLICABLE_DTYPES = (torch.bfloat16, torch.float16)


def is_parameter(node: fx.Node) -> bool:
    """Whether a placeholder is a module parameter (by its Dynamo source)."""
    name = buffer_source(node) if node.op == "placeholder" else None
    return bool(name and "_parameters[" in name)


def _parameters(region: set[fx.Node]) -> list[fx.Node]:
    # sorted: every rank must fingerprint and gather the same weights in the same order
    return sorted((n for n in region if is_parameter(n)), key=lambda n: n.name)


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target)


def _mutators(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """For each node, the in-place ops that later overwrite it (`x.copy_(...)`, `x.add_(...)`)."""
    found: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if (
            node.op in ("call_function", "call_method")
            and fx_util.mutates_input(node)
            and isinstance(node.args[0], fx.Node)
        ):
            found.setdefault(node.args[0], []).append(node)
    return found


def _collective_copy(node: fx.Node) -> bool:
    """`x.copy_(wait_tensor(all_reduce(x)))`: Dynamo's form of an in-place dist.all_reduce."""
    return (
        node.op == "call_method"
        and node.target == "copy_"
        and len(node.args) > 1
        and isinstance(node.args[1], fx.Node)
        and _is_collective(node.args[1])
    )


class ReplicationRefused(Exception):
    """The query path has a form whose replication we cannot prove exact."""


def query_region(graph: fx.Graph, outputs: list[fx.Node]) -> set[fx.Node]:
    """The nodes that compute `outputs` from rank-invariant values.

    The walk back from the queries stops at collective results (all-reduced or
    all-gathered values are the same on every rank) and at tensors overwritten in place
    by such a result (Dynamo's in-place all_reduce), so that only the weights of the
    query projection itself, not e.g. a vocab-sharded embedding upstream, are replicated.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    mutators = _mutators(graph)
    region: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in region or _is_collective(node):
            continue
        muts = mutators.get(node, [])
        if muts:
            if not all(_collective_copy(m) for m in muts):
                raise ReplicationRefused(f"the query path mutates {node.name} in place")
            last = max(order[m] for m in muts)
            early = [u for u in node.users if u in region or u in outputs]
            if any(order[u] < last for u in early):
                raise ReplicationRefused(f"the query path reads {node.name} before its all-reduce")
            continue  # rank-invariant once reduced: shared, not cloned
        region.add(node)
        if node.op != "placeholder":
            stack.extend(node.all_input_nodes)
    return region


class QueryReplicator:
    """Decides per layer between replicated and gathered queries and emits the clones."""

    def __init__(self, gm: fx.GraphModule, values: dict[str, Any], plan, requested: Optional[bool]):
        self.gm = gm
        self.values = values
        self.plan = plan
        self.requested = requested
        self.extra: list[ExtraInput] = []
        self.checks: list[WeightCheck] = []
        self._weight_inputs: dict[tuple[fx.Node, int], fx.Node] = {}
        self._relied: set[fx.Node] = set()

    def queries_for(self, match: MlaMatch) -> tuple[Optional[tuple[fx.Node, Optional[fx.Node]]], str]:
        """(override queries or None, description for the report)."""
        if self.plan.c == 1:
            return None, "local (one rank)"
        if not self.plan.head_sharded:
            self._check_heads_replicated(match)
            return None, "local (all heads on every rank)"
        if self.requested is False:
            return None, "all-gather"
        try:
            region, sharded = self._replicable(match)
        except ReplicationRefused as refused:
            return None, f"all-gather ({refused})"
        return self._emit(match, region, sharded), "replicated q-proj/w_kc"

    def _check_heads_replicated(self, match: MlaMatch) -> None:
        """tp_size=1 promises every rank holds all heads; a head-sharded model would
        otherwise be merged across different heads: a silent wrong answer."""
        try:
            region = query_region(self.gm.graph, [t.query for t in match.terms])
        except ReplicationRefused:
            return
        params = _parameters(region)
        for param in params:
            if weights_differ(self.values[param.name], self.plan.group_name, self.plan.c):
                raise NearMiss(
                    f"tp_size=1 says every rank holds all attention heads, but the query weight "
                    f"{buffer_source(param)} differs across the DCP ranks: the model looks head-sharded; "
                    f"pass its tensor-parallel size as tp_size"
                )
        for param in params:  # checked at compile only: a later change must not pass unseen
            self.rely_on_same(param)

    # -- eligibility ---------------------------------------------------------------

    def _replicable(self, match: MlaMatch) -> tuple[set[fx.Node], list[fx.Node]]:
        """(the query region, its TP-sharded weights); ReplicationRefused says why not."""
        region = query_region(self.gm.graph, [t.query for t in match.terms])
        params = _parameters(region)
        if not params:
            raise ReplicationRefused("queries use no weights")
        dtypes = {self.values[p.name].dtype for p in params}
        if not dtypes <= set(REPLICABLE_DTYPES):
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
            raise ReplicationRefused(f"q weights are {names}; replication takes unquantized bf16/fp16 only")
        # a fingerprint decides; only the sharded weights are then gathered whole (weight_input)
        sharded = [p for p in params if weights_differ(self.values[p.name], self.plan.group_name, self.plan.c)]
        if not sharded:
            raise ReplicationRefused("no q weight differs across DCP ranks")
        return region, sharded

    # -- emission ------------------------------------------------------------------

    def weight_input(self, param: fx.Node, rank: int, prefix: str = "dcp_q_weight") -> fx.Node:
        """The graph input holding DCP rank `rank`'s shard of parameter `param` (one per
        (parameter, rank), shared by every rewrite that asks for it; gathered once)."""
        key = (param, rank)
        if key not in self._weight_inputs:
            graph = self.gm.graph
            plan = self.plan
            weight = self.values[param.name]
            # held as a fake: the per-call feeder that carries this outlives the model (Dynamo keeps
            # compiled functions after a reset), and a real shard here would outlive it too
            example = fx_util.static_fake(gathered_shards(weight, plan.group_name, plan.c, compiling=True)[rank])
            node = fx_util.static_placeholder(graph, f"{prefix}_{len(self._weight_inputs)}", axes.example_value(param))
            index = fx_util.placeholders(graph).index(param)
            name = f"the weight {buffer_source(param) or param.name}"
            self.extra.append(ExtraInput(index, shards_lookup(plan.group_name, plan.c, name), rank, example))
            self._weight_inputs[key] = node
        return self._weight_inputs[key]

    def rely_on_same(self, param: fx.Node) -> None:
        """The graph uses parameter `param` (found the same on every rank) for the other ranks'
        heads too: remember what it was, and check it per call (refresh_weights checks it is
        still the same on every rank)."""
        if param in self._relied:
            return
        self._relied.add(param)
        plan = self.plan
        remember_same(self.values[param.name], plan.group_name, plan.c)
        name = f"the weight {buffer_source(param) or param.name}"
        index = fx_util.placeholders(self.gm.graph).index(param)
        self.checks.append(WeightCheck(index, same_weight_check(plan.group_name, plan.c, name)))

    def _emit(self, match: MlaMatch, region: set[fx.Node], sharded: list[fx.Node]) -> tuple[fx.Node, Optional[fx.Node]]:
        from dcp_pass.rewrites.attention import canonical_query, ordered_terms

        graph = self.gm.graph
        latent, rope = ordered_terms(match)
        terms = [latent] + ([rope] if rope else [])
        outputs = [term.query for term in terms]
        for param in _parameters(region):  # the clones compute from these as this rank holds them
            if param not in sharded:
                self.rely_on_same(param)
        tainted: set[fx.Node] = set(sharded)
        cloned: list[fx.Node] = []  # the tainted region nodes, in graph order
        for node in graph.nodes:  # topological: a region node is tainted if an input is
            if node in region and any(i in tainted for i in node.all_input_nodes):
                tainted.add(node)
                cloned.append(node)
        per_rank: list[list[fx.Node]] = []
        with graph.inserting_before(match.anchor):
            for rank in range(self.plan.c):
                if rank == self.plan.rank:
                    copies = outputs
                else:
                    env: dict[fx.Node, fx.Node] = {p: self.weight_input(p, rank) for p in sharded}
                    for node in cloned:
                        env[node] = graph.node_copy(node, lambda n: env.get(n, n))
                    copies = [env[q] for q in outputs]
                per_rank.append([canonical_query(graph, q, term) for q, term in zip(copies, terms)])
            q_lat = graph.call_function(torch.cat, ([r[0] for r in per_rank], 2))
            q_rope = graph.call_function(torch.cat, ([r[1] for r in per_rank], 2)) if rope else None
        return q_lat, q_rope
