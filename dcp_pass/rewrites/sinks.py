"""Attention sinks around a softmax: the spellings the softmax recognisers see through.

gpt-oss, HY-V4 and DeepSeek-V4 give each head a learned logit s_h that joins the softmax's
denominator and carries no value:

    combined = cat([scores, sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values     # optional
    probs = softmax(combined, dim=-1)[..., :-1]                          # the sink's column dropped
    out = probs @ values

The row-max subtraction shifts every logit of a row by one constant, which the softmax
ignores, so it is read through (with or without a sink). The sink itself becomes the
match's `SinkTerm`: the rewrite attends over the keys alone and counts the sink once, after
the merge (`attention.emit_exchange`).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.match import NearMiss

_SUBS = {operator.sub, torch.sub}
_MAX_FUNCTIONS = (torch.max, torch.amax)


def _last_dim_keepdim(node: fx.Node, rank: int) -> bool:
    """Whether a max / amax call reduces the last axis of a rank-`rank` tensor, keeping it."""
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and axes.normalize_dim(dim, rank) == rank - 1 and keepdim is True


def _row_max_of(node: Any) -> Optional[fx.Node]:
    """x for `x.max(-1, keepdim=True)[0]` / `.values`, `x.amax(-1, keepdim=True)` (and the
    torch.* spellings), optionally detached; else None."""
    if not isinstance(node, fx.Node):
        return None
    if axes.is_method(node, "detach") or axes.is_function(node, torch.detach):
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    reduced = node
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        reduced = node.args[0]
        if not (axes.is_method(reduced, "max") or axes.is_function(reduced, torch.max)):
            return None
    elif node.op == "call_function" and node.target is getattr and node.args[1] == "values":
        reduced = node.args[0]
        if not (axes.is_method(reduced, "max") or axes.is_function(reduced, torch.max)):
            return None
    elif not (axes.is_method(node, "amax") or axes.is_function(node, torch.amax)):
        return None
    if not isinstance(reduced, fx.Node) or not isinstance(reduced.args[0], fx.Node):
        return None
    x = reduced.args[0]
    shape = axes.shape_of(x)
    if shape is None or not _last_dim_keepdim(reduced, len(shape)):
        return None
    return x


def peel_row_max(node: Any) -> Any:
    """`x - rowmax(x)` -> x (the softmax over the last axis is the same); else `node`."""
    if not isinstance(node, fx.Node):
        return node
    is_sub = (node.op == "call_function" and node.target in _SUBS) or axes.is_method(node, "sub", "__sub__")
    if not is_sub or len(node.args) != 2 or node.kwargs:
        return node
    x, m = node.args
    return x if isinstance(x, fx.Node) and _row_max_of(m) is x else node


def split_sink(node: Any, depends_on_cache: Callable[[fx.Node], bool]) -> tuple[Any, Optional[fx.Node], Optional[str]]:
    """`cat([scores, sink], -1)` -> (scores, sink, "last"); `cat([sink, scores], -1)` ->
    (scores, sink, "first"); anything else -> (node, None, None). The sink is one column that
    depends on no cache; the scores are the other operand."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.cat):
        return node, None, None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    shape = axes.shape_of(node)
    if (
        not isinstance(tensors, (list, tuple))
        or len(tensors) != 2
        or not all(isinstance(t, fx.Node) for t in tensors)
        or shape is None
        or not isinstance(dim, int)
        or axes.normalize_dim(dim, len(shape)) != len(shape) - 1
    ):
        return node, None, None
    first, last = tensors
    for scores, sink, side in ((first, last, "last"), (last, first, "first")):
        sink_shape = axes.shape_of(sink)
        if (
            depends_on_cache(scores)
            and sink_shape is not None
            and len(sink_shape) == len(shape)
            and axes.known_equal(sink_shape[-1], 1)
        ):
            if depends_on_cache(sink):
                raise NearMiss(
                    "a column concatenated to the attention scores is computed from a cache (a sink "
                    "logit is rewritten only when it depends on no cache)",
                    sink,
                )
            return scores, sink, side
    return node, None, None


def drops_sink_column(node: fx.Node, probs: fx.Node, side: str) -> bool:
    """Whether `node` is `probs[..., :-1]` (side "last") or `probs[..., 1:]` (side "first")."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[0] is probs):
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or not index:
        return False
    rank = len(axes.shape_of(probs) or ())
    *lead, cut = index
    if lead == [Ellipsis]:
        pass
    elif len(lead) != rank - 1 or any(e != slice(None) for e in lead):
        return False
    wanted = slice(None, -1) if side == "last" else slice(1, None)
    return isinstance(cut, slice) and (cut.start, cut.stop, cut.step) == (wanted.start, wanted.stop, None)


def sink_column_dropped(probs: fx.Node, side: str) -> fx.Node:
    """The probabilities without the sink's column: the one use of `probs` that drops it
    (`drops_sink_column`); anything else is a near miss."""
    users = list(probs.users)
    if len(users) != 1 or not drops_sink_column(users[0], probs, side):
        raise NearMiss(
            "the softmax over the scores and a sink column is not followed by dropping that column (`probs[..., :-1]`)",
            users[0] if len(users) == 1 else probs,
        )
    return users[0]


def sink_roles(sink: fx.Node, score_roles: list) -> list:
    """The sink's axis roles: right-aligned with the scores it is concatenated to."""
    return list(score_roles[len(score_roles) - len(axes.shape_of(sink)) :])
