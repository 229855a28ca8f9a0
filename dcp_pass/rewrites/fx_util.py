"""Graph surgery helpers shared by the rewrites, and every use of private Dynamo API.

Nothing here knows about MLA: node creation with readable names, the dead-region
erase that keeps deliberate in-place ops, static placeholders marked the way Dynamo
marks buffers, copying a Dynamo graph module without losing what aot_autograd reads
from it, and the few Dynamo internals the pass and the cache guard rely on
(`_dynamo_source`, `_dynamo_static_input_type`, the current fake mode, the eval-frame
callback, the tracing compiler, the graph break a graph ends at). When torch moves one of
them, this is the one file to change.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

# --------------------------------------------------------------------------- node creation


def call(graph: fx.Graph, target, *args, name: Optional[str] = None, **kwargs) -> fx.Node:
    """A `call_function` node; named nodes keep the rewritten graph readable in graph-diff reviews."""
    return graph.create_node("call_function", target, args, kwargs, name=name)


def method(graph: fx.Graph, method_name: str, *args, name: Optional[str] = None) -> fx.Node:
    """A `call_method` node (`x.permute(...)`, `x.float()`)."""
    return graph.create_node("call_method", method_name, args, {}, name=name)


def replace_node(graph: fx.Graph, old: fx.Node, target, args: tuple, name: Optional[str] = None) -> fx.Node:
    """Put a `call_function` of `target` where `old` was; `old`'s users read it; `old` is erased."""
    with graph.inserting_before(old):
        new = graph.create_node("call_function", target, args, {}, name=name)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


def set_example_value(node: fx.Node) -> None:
    """Give a new node its `example_value` by running its target on its inputs' example
    values (fake tensors and SymInts of the trace), as Dynamo would have recorded it."""

    def value(arg):
        v = node_value(arg)
        if v is None:
            raise ValueError(f"{arg.name} has no example value")
        return v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
    if node.op == "call_method":
        result = getattr(args[0], node.target)(*args[1:], **kwargs)
    elif node.op == "call_function":
        result = node.target(*args, **kwargs)
    else:
        raise ValueError(f"cannot trace a {node.op} node")
    node.meta["example_value"] = result


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def placeholder_values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """Placeholder name -> the example input passed for it."""
    return {n.name: v for n, v in zip(placeholders(gm.graph), example_inputs)}


def node_value(node: Any) -> Any:
    """The traced value of `node` (`example_value` from Dynamo, `val` from aot), or `node` itself."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node


# --------------------------------------------------------------------------- dead code


INPLACE_FUNCTIONS = {operator.iadd, operator.imul, operator.itruediv, operator.isub}


def mutates_input(node: fx.Node) -> bool:
    """Whether `node` writes into its first argument (`x.copy_(...)`, `x += y`, `x[i] = v`)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    return node.target in INPLACE_FUNCTIONS or node.target is operator.setitem


_VIEW_METHODS = {
    "view",
    "reshape",
    "transpose",
    "permute",
    "narrow",
    "select",
    "unsqueeze",
    "squeeze",
    "expand",
    "as_strided",
    "__getitem__",
    "t",
    "flatten",
    "unflatten",
}


def view_base(node: Any) -> Any:
    """The tensor `node` is a view of, through getitem and the view methods (itself if none)."""
    while (
        isinstance(node, fx.Node)
        and node.args
        and (node.target is operator.getitem or (node.op == "call_method" and node.target in _VIEW_METHODS))
    ):
        node = node.args[0]
    return node


def state_built_in_graph(graph: fx.Graph) -> list[str]:
    """Graph outputs the graph allocated and then wrote in place: state made inside the
    graph that lives on after it (a cache a model allocates on its first call, a step
    counter moved to the device and advanced). Returned tensors that are only computed
    (logits) are not state; tensors written in place that came in as inputs are the
    caller's and not listed."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    returned = {n for n in output.all_input_nodes if n.op != "placeholder"}
    written = {view_base(n.args[0]) for n in graph.nodes if n.args and mutates_input(n)}
    return [n.name for n in graph.nodes if n in returned and n in written]


def erase_dead_region(graph: fx.Graph, roots: list[fx.Node]) -> None:
    """Erase the nodes that only fed the replaced attention, walking back from `roots`.

    Not a graph-wide DCE: a graph may hold in-place ops whose results are unused on
    purpose (a `copy_` after an all_reduce), which a generic DCE would drop. An in-place
    op is erased only when the tensor it mutates dies with it.
    """
    work = list(roots)
    dead: set[fx.Node] = set()
    while work:
        node = work.pop()
        if node in dead or node.users or node.op not in ("call_function", "call_method"):
            continue
        if mutates_input(node):
            target = node.args[0]
            if not isinstance(target, fx.Node) or len(target.users) > 1:
                continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        dead.add(node)
        work.extend(inputs)


# --------------------------------------------------------------------------- Dynamo internals


def dynamo_source_name(node: fx.Node) -> Optional[str]:
    """Dynamo's source name of a placeholder (e.g. L['self']._modules['attn']._buffers['kv_cache']);
    for an input that stands in for a tensor the graph allocated (rewrites/allocation.py),
    the source of the tensor it becomes."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None else node.meta.get("dcp_source")


def current_fake_mode():
    """The fake mode of the trace in progress, or None."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode()


def static_fake(example: torch.Tensor) -> torch.Tensor:
    """`example` as a static-shape fake of the current trace: graphs kept for reports then
    hold no real shard (a deleted model frees its shards)."""
    fake_mode = current_fake_mode()
    if fake_mode is None or isinstance(example, torch._subclasses.FakeTensor):
        return example
    return fake_mode.from_tensor(example, static_shapes=True)


def static_placeholder(graph: fx.Graph, name: str, example: torch.Tensor) -> fx.Node:
    """A new trailing graph input that holds a long-lived tensor (a shard, a gathered weight).

    Marked static the way Dynamo marks buffers (no source, `_dynamo_static_input_type`),
    so inductor's CUDA graphs may read it in place and capture writes into it.
    """
    last = placeholders(graph)[-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name)
    node.meta["example_value"] = static_fake(example)
    node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    node._dynamo_source = None
    return node


def copy_dynamo_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a Dynamo graph module that keeps what aot_autograd reads from it.

    aot_autograd recognises a Dynamo graph by `meta["dynamo_compile_id"]`,
    `_param_name_to_source` and each placeholder's `_dynamo_source`; from them it marks
    parameters and buffers as static inputs, which CUDA graphs need (a mutated input
    that is not static makes inductor skip cudagraphs). A plain copy drops all three.
    """
    work = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    work.meta.update(gm.meta)
    for attr in ("_param_name_to_source", "_source_to_user_stacks"):
        if hasattr(gm, attr):
            setattr(work, attr, getattr(gm, attr))
    sources = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    for node in work.graph.find_nodes(op="placeholder"):
        old = sources.get(node.name)
        if old is not None and hasattr(old, "_dynamo_source"):
            node._dynamo_source = old._dynamo_source
    return work


def graph_break_site(gm: fx.GraphModule) -> Optional[str]:
    """Where and why Dynamo cut `gm` short, in the user's terms, or None when the graph ends
    where its frame returns: `model.py:1098 `x[:, keep]` (Dynamic shape operator: <Dynamo's
    explanation>; Dynamo's hint: <its hint>)`. Dynamo records this on the graph module it
    hands a backend (`compile_subgraph_reason`, a Dynamo internal)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    import os

    stack = list(getattr(reason, "user_stack", None) or [])
    frame = stack[-1] if stack else None
    where = f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame is not None else "an unknown line"
    if frame is not None and (frame.line or "").strip():
        where += f" `{frame.line.strip()}`"
    lines = [line.strip() for line in str(getattr(reason, "reason", "")).splitlines() if line.strip()]
    parts = {line.split(":", 1)[0]: line.split(":", 1)[1].strip().rstrip(".") for line in lines[1:] if ":" in line}
    why = lines[0].rstrip(".") if lines else ""
    if "Explanation" in parts:
        why += f": {parts['Explanation']}"
    if "Hint" in parts:
        why += f"; Dynamo's hint: {parts['Hint']}"
    return f"{where} ({why})" if why else where
