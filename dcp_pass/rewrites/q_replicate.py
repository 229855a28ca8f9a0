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
tensor actually passed: one compiled graph can serve several layers.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from dcp_pass.rewrites import axes, fx_util
from dcp_pass.rewrites.match import MlaMatch, NearMiss, buffer_source

REPLICABLE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class ExtraInput:
    """A trailing graph input whose value is derived, per call, from an existing input: entry
    `rank` of what `shards` gives for it (the inputs derived from one weight share one call)."""

    index: int  # the existing input it is derived from
    shards: Callable[[torch.Tensor], list[torch.Tensor]]
    rank: int
    example: torch.Tensor


def resolve_inputs(extra: list[ExtraInput], args) -> list[torch.Tensor]:
    """The values of `extra` for one call with inputs `args`: each weight's shards looked up
    (and checked) once, whatever the number of ranks."""
    found: dict[int, list[torch.Tensor]] = {}
    values = []
    for item in extra:
        shards = found.get(item.index)
        if shards is None:
            shards = found[item.index] = item.shards(args[item.index])
        values.append(shards[item.rank])
    return values


class DcpWeightsError(RuntimeError):
    """A weight whose other ranks' shards this rank holds changed after they were gathered."""


def _version(weight: torch.Tensor) -> Optional[int]:
    try:
        return weight._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


@dataclass
class _Stamp:
    """What a weight was when the pass last read its values: its version counter (None: an
    inference tensor has none) and its storage's address. Renewed in place."""

    version: Optional[int]
    data_ptr: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> "_Stamp":
        return cls(_version(weight), weight.data_ptr())

    def matches(self, weight: torch.Tensor) -> bool:
        return self.data_ptr == weight.data_ptr() and self.version == _version(weight)

    def renew(self, weight: torch.Tensor) -> None:
        self.version, self.data_ptr = _version(weight), weight.data_ptr()


@dataclass
class _Held:
    """Every DCP rank's shard of one weight, and the weight's stamp when they were gathered."""

    shards: list[torch.Tensor]
    stamp: _Stamp


# weight -> {(group name, c): _Held}; weak, so a dead model's gathered weights go with it
_GATHERED = WeakIdKeyDictionary()
# weight -> {(group name, c): _Stamp} of the weights found the same on every rank that a graph
# uses for the other ranks' heads
_SAME = WeakIdKeyDictionary()


class _Recent:
    """`table`'s entry under `key` for a weight, remembered per weight (by id, confirmed by a
    weak reference): the per-call lookups cost a plain dictionary's, not a weak-key one's. The
    entries are renewed in place, so a remembered one stays current.

    Both the weight and its entry are held weakly: Dynamo keeps every compiled function (and
    so this lookup) after ``torch._dynamo.reset()``, and a strong hold here would keep a dead
    model's gathered shards alive with it. A remembered entry that the table replaced is
    looked up again."""

    def __init__(self, table: WeakIdKeyDictionary, key: tuple):
        self.table, self.key = table, key
        self.seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def __call__(self, weight: torch.Tensor):
        hit = self.seen.get(id(weight))
        if hit is not None and hit[0]() is weight:
            entry = hit[1]()
            if entry is not None:
                return entry
        entry = self.table.get(weight, {}).get(self.key)
        if entry is not None:
            self.seen[id(weight)] = (weakref.ref(weight, self._forget(id(weight))), weakref.ref(entry))
        return entry

    def _forget(self, ident: int) -> Callable[[weakref.ref], None]:
        lookup = weakref.ref(self)  # the callback must not keep this lookup alive either

        def forget(ref: weakref.ref) -> None:
            recent = lookup()
            if recent is not None and ident in recent.seen and recent.seen[ident][0] is ref:
                del recent.seen[ident]

        return forget


@dataclass
class WeightCheck:
    """A parameter input the rewritten graph uses for every rank's heads (it was the same on
    every rank when compiled): `check`, given the parameter passed, raises if it changed."""

    index: int
    check: Callable[[torch.Tensor], None]


def _remember_same(weight: torch.Tensor, group_name: str, c: int) -> None:
    table = _SAME.setdefault(weight, {})
    stamp = table.get((group_name, c))
    if stamp is None:
        table[(group_name, c)] = _Stamp.of(weight)
    else:
        stamp.renew(weight)
    _GATHERED.get(weight, {}).pop((group_name, c), None)  # a graph compiled before the weight changed


def check_same_unchanged(weight: torch.Tensor, group_name: str, c: int, name: str,
                         stamp: Optional[_Stamp] = None) -> None:
    """DcpWeightsError when `weight`, which the graph takes as the same on every rank, was
    written in place or given new storage since that was checked (`stamp`: its entry, when
    the caller has it)."""
    if stamp is None:
        stamp = _SAME.get(weight, {}).get((group_name, c))
    if stamp is not None and not stamp.matches(weight):
        raise DcpWeightsError(
            f"{name} was the same on every DCP rank when the graph was compiled, and the graph computes the "
            f"other ranks' heads with this rank's copy of it; it changed since (written in place or given new "
            f"storage): call dcp_pass.refresh_weights(model) on every rank after updating the weights, which "
            f"checks that it is still the same on every rank")


def _gather(weight: torch.Tensor, group_name: str, c: int) -> list[torch.Tensor]:
    """Every DCP rank's shard of `weight` (an eager all-gather; collective over the group)."""
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
    # this rank's own shard is the weight itself: no second copy of it is kept
    own = dist.get_rank(group)
    parts[own] = weight.detach()
    held = _GATHERED.get(weight, {}).get((group_name, c))
    if held is not None and all(h.shape == p.shape and h.dtype == p.dtype for h, p in zip(held.shards, parts)):
        # gathered again: into the copies the graphs already take, whose addresses CUDA graphs
        # captured (the graphs' inputs are static)
        with torch.inference_mode():  # the copies may be inference tensors (made under it)
            for r, (h, p) in enumerate(zip(held.shards, parts)):
                if r != own:
                    h.copy_(p)
        held.shards[own] = parts[own]
        held.stamp.renew(weight)
    else:
        _GATHERED.setdefault(weight, {})[(group_name, c)] = held = _Held(parts, _Stamp.of(weight))
    _SAME.get(weight, {}).pop((group_name, c), None)  # a graph compiled before the weight changed
    return held.shards


def gathered_shards(weight: torch.Tensor, group_name: str, c: int, name: str = "a q weight",
                    compiling: bool = False, held: Optional[_Held] = None) -> list[torch.Tensor]:
    """Every DCP rank's shard of `weight`: gathered on first use (collective), then cached.
    `compiling`: a compile, where every rank gathers together: a changed weight is gathered
    again there.

    The cached shards of the other ranks are copies: a weight written in place afterwards
    (``load_state_dict``, ``p.copy_``) or given new storage (``p.data = ...``) would leave
    them stale, and the graph would mix this rank's new heads with the others' old ones.
    Such a change raises :class:`DcpWeightsError` (`name` says which weight) instead;
    :func:`refresh_weights` gathers them again. Writes torch does not count (through
    ``p.data``, or a collective such as ``dist.broadcast`` into the weight) cannot be seen
    here: after them, :func:`refresh_weights` is required. `held`: the weight's entry, when
    the caller has it."""
    if held is None:
        held = _GATHERED.get(weight, {}).get((group_name, c))
    if held is None or (compiling and not held.stamp.matches(weight)):
        return _gather(weight, group_name, c)
    if not held.stamp.matches(weight):
        raise DcpWeightsError(
            f"{name} changed after the first compiled call (written in place or given new storage), and "
            f"this rank holds the other DCP ranks' shards of it as they were then: call "
            f"dcp_pass.refresh_weights(model) on every rank after updating the weights (or compile with "
            f"replicate_q_proj=False and project_before_merge=False, which gather nothing)")
    return held.shards


def refresh_weights(model: torch.nn.Module) -> int:
    """Bring the pass's view of `model`'s weights up to date after they changed: gather
    again the other DCP ranks' shards it holds copies of (``replicate_q_proj``,
    ``project_before_merge``), and check that the weights it found the same on every rank
    (which its graphs use for the other ranks' heads) still are. Call it on every rank of
    the DCP group after every update of the weights: the gathers and checks are
    collectives, made in the order of the model's parameter names, the same on every rank.
    Returns how many weights it gathered or checked; 0 when the pass relies on none.

    A weight that was the same on every rank when a graph was compiled and differs now (a
    model compiled with placeholder weights, then loaded) raises DcpWeightsError: the
    compiled graph has no input for the other ranks' copies; compile again after loading
    (``torch._dynamo.reset()``, then ``torch.compile``)."""
    count = 0
    for name, param in sorted(model.named_parameters(remove_duplicate=True), key=lambda item: item[0]):
        for group_name, c in sorted(_GATHERED.get(param, {})):
            _gather(param, group_name, c)
            count += 1
        for group_name, c in sorted(_SAME.get(param, {})):
            if weights_differ(param, group_name, c):
                raise DcpWeightsError(
                    f"the weight {name} was the same on every DCP rank when the graph was compiled, and differs "
                    f"across them now: the compiled graph computes the other ranks' heads with this rank's copy; "
                    f"compile again after loading the weights (torch._dynamo.reset(), then torch.compile)")
            _remember_same(param, group_name, c)
            count += 1
    return count


def weights_differ(weight: torch.Tensor, group_name: str, c: int, no_verdict: bool = False) -> bool:
    """Whether `weight` differs across the ranks of the group, from a small fingerprint
    (size, sums, position-weighted row and column sums, a few entries), so nothing of weight
    size is gathered or kept.
    `no_verdict`: the answer on a fake (test) process group, which cannot tell."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    if dist.get_backend(group) == "fake":  # test process groups return garbage: no verdict
        return no_verdict
    flat = weight.detach().reshape(-1).float()
    head = flat[:8] if flat.numel() >= 8 else torch.nn.functional.pad(flat, (0, 8 - flat.numel()))
    # row and column sums weighted by position: shards that hold the same values in another
    # order (two heads swapped) differ there
    table = flat.reshape(weight.shape[0], -1) if weight.dim() and flat.numel() else flat.reshape(1, -1)
    rows = (table.sum(1) * torch.arange(1, table.shape[0] + 1, device=flat.device)).sum()
    cols = (table.sum(0) * torch.arange(1, table.shape[1] + 1, device=flat.device)).sum()
    stats = torch.stack([flat.sum(), (flat * flat).sum(), flat.abs().max() if flat.numel() else flat.new_zeros(()),
                         rows, cols])
    fingerprint = torch.cat([torch.tensor([float(flat.numel())], device=flat.device), stats, head])
    parts = [torch.empty_like(fingerprint) for _ in range(c)]
    dist.all_gather(parts, fingerprint, group=group)
    return not all(torch.equal(parts[0], p) for p in parts[1:])


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
        if (node.op in ("call_function", "call_method") and fx_util.mutates_input(node)
                and isinstance(node.args[0], fx.Node)):
            found.setdefault(node.args[0], []).append(node)
    return found


def _collective_copy(node: fx.Node) -> bool:
    """`x.copy_(wait_tensor(all_reduce(x)))`: Dynamo's form of an in-place dist.all_reduce."""
    return (node.op == "call_method" and node.target == "copy_" and len(node.args) > 1
            and isinstance(node.args[1], fx.Node) and _is_collective(node.args[1]))


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
            recent = _Recent(_GATHERED, (plan.group_name, plan.c))
            self.extra.append(ExtraInput(
                index, lambda w, n=name, h=recent: gathered_shards(w, plan.group_name, plan.c, n, held=h(w)), rank,
                example))
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
        _remember_same(self.values[param.name], plan.group_name, plan.c)
        name = f"the weight {buffer_source(param) or param.name}"
        index = fx_util.placeholders(self.gm.graph).index(param)
        recent = _Recent(_SAME, (plan.group_name, plan.c))
        self.checks.append(WeightCheck(
            index, lambda w, n=name, h=recent: check_same_unchanged(w, plan.group_name, plan.c, n, h(w))))

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
