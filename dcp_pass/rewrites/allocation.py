"""Cache tensors that a graph allocates: each rank allocates only its stripe.

A Hugging Face `StaticCache` creates its layer tensors on their first update, inside the
compiled prefill, writes the prompt into them and keeps them on the cache object:

    keys = torch.zeros((b, kv heads, T, d), dtype=..., device=...)
    keys.index_copy_(2, cache_position, k)        # cache_position = arange(n) + layer.cumulative_length
    ... attention over keys (the mask hides the positions not yet written) ...
    return (..., keys, ...)                       # Dynamo then sets cache.layers[i].keys to it

`stand_in_allocations` replaces each such factory call by a new graph input carrying the
source name of the tensor the cache object keeps (the name its later graphs take it by),
so that the recognisers, the striped writes and the attention rewrite treat it as they
treat a cache that comes in: the graph writes this rank's positions into its shard and
attends over its rows. The backend then gives every call a new zeroed shard and a
full-shape tensor without memory (`state.shards.AllocatedCache`), returns that tensor where the
graph returned the allocation, and registers the shard as its stripe: the full-size
tensor never exists on any rank. An allocation that no rewritten attention reads is put
back as it was (`put_back`).

A prefill over a fresh cache may attend over its first `n` positions only, causally
(Hugging Face's SDPA path slices `key[:, :, :n]` and passes `is_causal=True` when there is
no padding mask). `causal_prefix_over_cache` writes such a call over a stand-in's tensors
as the same causal attention over every position: SDPA's `is_causal` is top-left aligned,
so query `i` still sees keys `p <= i` and none past the prefix; the cache is zero past what
this graph wrote and its write positions start at 0 (the graph allocated it, so its length
is 0, as the slice assumes too), so both see the same keys, and a causal read of the whole
cache is one the recognisers take over a striped cache (the attention op gets it as a cap
on key positions, no [S, T] mask anywhere).

Which factory calls are cache allocations is for the recognisers to say: each entry of
`ALLOCATION_FORMS` takes a factory node and returns the source name of the cache tensor
it creates, or None.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, fx_util

# node -> the source name (Dynamo's spelling) of the cache tensor the factory call creates, or None
ALLOCATION_FORMS: list[Callable[[fx.Node], Optional[str]]] = []

_FACTORIES = {torch.zeros: 0.0, torch.empty: None}
_FACTORY_METHODS = {"new_zeros": 0.0, "new_empty": None}
SOURCE_META = "dcp_source"  # meta key of a stand-in input: the source name it takes the place of


@dataclass
class StandIn:
    """A factory call replaced by a graph input (`placeholder`), until the pass keeps or undoes it."""

    factory: fx.Node
    placeholder: fx.Node
    source: str


def is_factory(node: fx.Node) -> bool:
    """`torch.zeros` / `torch.empty` / `x.new_zeros` / `x.new_empty` of a strided tensor."""
    if not (
        node.op == "call_function"
        and node.target in _FACTORIES
        or node.op == "call_method"
        and node.target in _FACTORY_METHODS
    ):
        return False
    value = axes.example_value(node)
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.requires_grad


def static_shape(node: fx.Node) -> bool:
    shape = axes.shape_of(node)
    return shape is not None and all(isinstance(s, int) for s in shape)


def _returned(graph: fx.Graph) -> set[fx.Node]:
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    return set(output.all_input_nodes)


def stand_in_allocations(graph: fx.Graph, symbolic: Optional[list] = None) -> list[StandIn]:
    """Replace every cache allocation the graph returns by a new trailing input (after the
    existing ones); the factory nodes stay, unused, until `drop_factories` or `put_back`.
    An allocation of a symbolic size is left as it is; its source name goes to `symbolic`."""
    returned = _returned(graph)
    found = []
    for node in list(graph.nodes):
        if node not in returned or not is_factory(node):
            continue
        source = next((s for s in (form(node) for form in ALLOCATION_FORMS) if s), None)
        if source is None:
            continue
        if not static_shape(node):
            if symbolic is not None:
                symbolic.append(source)
            continue
        last = fx_util.placeholders(graph)[-1]
        with graph.inserting_after(last):
            placeholder = graph.placeholder(f"dcp_allocated_{node.name}")
        placeholder.meta["example_value"] = node.meta["example_value"]
        placeholder.meta[SOURCE_META] = source
        # as the backend's other added inputs (fx_util.static_placeholder): never read, held by the cache object
        placeholder.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
        placeholder._dynamo_source = None
        node.replace_all_uses_with(placeholder)
        found.append(StandIn(node, placeholder, source))
    return found


def put_back(graph: fx.Graph, stand_in: StandIn) -> None:
    """Undo one stand-in: the graph allocates that tensor again."""
    stand_in.placeholder.replace_all_uses_with(stand_in.factory)
    graph.erase_node(stand_in.placeholder)


def drop_factories(graph: fx.Graph, stand_ins: list[StandIn]) -> None:
    """The stand-ins are kept: their factory calls go."""
    for stand_in in stand_ins:
        if not stand_in.factory.users:
            graph.erase_node(stand_in.factory)


def output_positions(graph: fx.Graph, node: fx.Node) -> list[int]:
    """Where the graph's (flat) output returns `node`."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    return [i for i, value in enumerate(flat) if value is node]


def only_returned(node: fx.Node) -> bool:
    """Whether the graph's output is the only use of `node`."""
    return all(user.op == "output" for user in node.users)


@dataclass
class CausalPrefix:
    """A causal SDPA over the first positions of stand-in tensors, replaced by `new`: what
    `undo_prefix` needs to put the call back."""

    new: fx.Node
    target: Callable
    args: tuple
    kwargs: dict
    slices: dict  # argument position -> (base, index) of the prefix slice it was
    name: str
    meta: dict
    placeholders: set


_ANCESTOR_LIMIT = 256  # nodes searched between an attention operand and the cache tensors it reads


def _stand_ins_under(node: fx.Node, placeholders: set) -> set:
    found: set = set()
    seen: set = set()
    work = [node]
    while work and len(seen) < _ANCESTOR_LIMIT:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in placeholders:
            found.add(n)
        work.extend(n.all_input_nodes)
    return found


def _prefix_of(node, length: int) -> Optional[fx.Node]:
    """`x[:, :, :length]` (or `x[:, :, :length, :]`) -> x."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    base, index = node.args
    if not isinstance(index, tuple) or len(index) not in (3, 4) or not isinstance(base, fx.Node):
        return None
    whole = [i for k, i in enumerate(index) if k != 2]
    if not all(isinstance(i, slice) and i == slice(None) for i in whole):
        return None
    cut = index[2]
    if not (isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1) and cut.stop == length):
        return None
    shape = axes.shape_of(base)
    return base if shape is not None and len(shape) == 4 else None


def causal_prefix_over_cache(graph: fx.Graph, stand_ins: list[StandIn]) -> list[CausalPrefix]:
    """Rewrite each `sdpa(q, k[:, :, :n], v[:, :, :n], is_causal=True)` whose keys and values
    are computed from stand-ins (n the query length) as `sdpa(q, k, v, is_causal=True)`."""
    from dcp_pass.rewrites.recognisers.sdpa import SDPA_TARGETS, sdpa_arguments

    placeholders = {s.placeholder for s in stand_ins}
    done = []
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target in SDPA_TARGETS):
            continue
        args = sdpa_arguments(node)
        q_shape = axes.shape_of(args["query"])
        if (
            args["is_causal"] is not True
            or args["attn_mask"] is not None
            or q_shape is None
            or len(q_shape) != 4
            or not isinstance(q_shape[2], int)
        ):
            continue
        n = q_shape[2]
        key, value = _prefix_of(args["key"], n), _prefix_of(args["value"], n)
        if key is None or value is None:
            continue
        total = axes.shape_of(key)[2]  # type: ignore[index]  # _prefix_of checked it is 4-D
        if not isinstance(total, int) or axes.shape_of(value)[2] != total:  # type: ignore[index]
            continue
        under = _stand_ins_under(key, placeholders) | _stand_ins_under(value, placeholders)
        if not under:
            continue
        kwargs = {k: v for k, v in args.items() if k not in ("query", "key", "value")}
        with graph.inserting_before(node):
            # a stand-in read as it is (GQA through enable_gqa): read through a view at the
            # attention, after the graph's write into it, as the slice read it
            key, value = (_read_here(graph, x) if x in placeholders else x for x in (key, value))
            new = graph.create_node(
                "call_function", node.target, (args["query"], key, value), kwargs, name=f"{node.name}_over_cache"
            )
        new.meta = dict(node.meta)
        slices = {i: (a.args[0], a.args[1]) for i, a in ((1, args["key"]), (2, args["value"]))}
        done.append(
            CausalPrefix(new, node.target, node.args, dict(node.kwargs), slices, node.name, dict(node.meta), under)
        )
        node.replace_all_uses_with(new)
        old_slices = [args["key"], args["value"]]
        graph.erase_node(node)
        for cut in old_slices:
            if not cut.users:
                graph.erase_node(cut)
    return done


def _read_here(graph: fx.Graph, tensor: fx.Node) -> fx.Node:
    """`tensor[..., 0:width]`: all of it, read where this node is."""
    width = axes.shape_of(tensor)[-1]  # type: ignore[index]
    view = fx_util.call(graph, operator.getitem, tensor, (Ellipsis, slice(0, width)))
    fx_util.set_example_value(view)
    return view


def undo_prefix(graph: fx.Graph, prefix: CausalPrefix) -> None:
    """Put back the causal call over the prefix slices that `prefix` replaced."""
    with graph.inserting_before(prefix.new):
        cut = {i: fx_util.call(graph, operator.getitem, base, index) for i, (base, index) in prefix.slices.items()}
        for node in cut.values():
            fx_util.set_example_value(node)
        if len(prefix.args) >= 3:  # positional query, key, value
            args = (prefix.args[0], cut[1], cut[2], *prefix.args[3:])
            kwargs = prefix.kwargs
        else:
            args = prefix.args
            kwargs = dict(prefix.kwargs, **{"key": cut[1], "value": cut[2]})
        old = graph.create_node("call_function", prefix.target, args, kwargs, name=prefix.name)
    old.meta = prefix.meta
    prefix.new.replace_all_uses_with(old)
    reads = [a for a in prefix.new.args[1:3] if isinstance(a, fx.Node)]
    graph.erase_node(prefix.new)
    fx_util.erase_dead_region(graph, reads)
