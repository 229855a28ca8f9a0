"""A boolean mask that is a causal comparison of positions becomes the op's causal cap.

A model that builds its causal mask in the graph (Hugging Face's `sdpa_mask` under
torch.compile, whenever its query offset is a tensor or a padding mask is traced) compares
two position ranges and broadcasts the result over the scores:

    q_idx  = (arange(S) + q_offset)[None, None, :, None]
    kv_idx = (arange(T) + kv_offset)[None, None, None, :]
    keep   = (kv_idx <= q_idx) & padding[:, None, None, :]     # the padding term optional
    mask   = keep.expand(B, 1, S, T)

Handed to the attention op as it is, the mask becomes an fp32 [S, T] tensor (16 GiB for a
64K-token prefill, more than the cache the rank holds). But `kv_idx <= q_idx` says exactly
what the op's causal cap says: key j of the read is visible to query s when
j <= q_idx[s] - kv_offset. So the comparison leaves the mask and becomes
`q_pos = q_idx - kv_offset` (global positions: plus the read's start), and what is left of
the mask (the padding term: one row per request) stays a mask.

Only for multi-token calls (a decode step's mask is one row per request already, and its
kernels are chosen for a mask, not a cap), and only where every factor is recognised: a
comparison either way round (`kv <= q`, `q >= kv`), terms joined by `&` (an all-true start
value among them), views that only add or keep axes, `to` that keeps the dtype, and an
`expand`. Anything else leaves the mask as it is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.axes import S, T
from dcp_pass.rewrites.match import MaskTerm

_AND = {operator.and_, torch.bitwise_and, torch.logical_and, "__and__", "bitwise_and", "logical_and"}
_LE = {operator.le, torch.le, "le", "__le__"}
_GE = {operator.ge, torch.ge, "ge", "__ge__"}
_EXPANDS = {"expand", "expand_as", "contiguous"}
_ADDS = {operator.add, torch.add, "add", "__add__"}
_SUBS = {operator.sub, torch.sub, "sub", "__sub__"}


@dataclass
class CausalSplit:
    """A mask term split into a causal comparison and what is left of it.

    `query_index`: the node holding the query positions as the model counts them ([S]);
    `key_offset`: what the model adds to a key's index in the read (0, an int or a node);
    `rest`: the other factors, each as a boolean keep mask with its roles."""

    term: MaskTerm
    query_index: fx.Node
    key_offset: Any
    rest: list[MaskTerm] = field(default_factory=list)


def _is(node: Any, targets: set) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def _same_values(node: fx.Node) -> bool:
    """`x.to(...)` that changes neither dtype nor values (a device move where there is none)."""
    if not _is(node, {"to"}) or not isinstance(node.args[0], fx.Node):
        return False
    before, after = axes.example_value(node.args[0]), axes.example_value(node)
    return isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype


def _all_true(node: fx.Node) -> bool:
    """A boolean tensor of ones (`x.new_ones((), dtype=torch.bool)`): a factor that keeps everything."""
    value = axes.example_value(node)
    return _is(node, {"new_ones", torch.ones}) and isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _through_views(node: Any) -> Any:
    """The tensor under getitem(None / full slices), unsqueeze and expand views, and dtype-keeping `to`."""
    while isinstance(node, fx.Node):
        if _is(node, _EXPANDS) or _same_values(node):
            node = node.args[0]
        elif _is(node, {"unsqueeze", torch.unsqueeze}):
            node = node.args[0]
        elif _is(node, {operator.getitem}) and _only_new_axes(node.args[1]):
            node = node.args[0]
        else:
            return node
    return node


def _only_new_axes(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items)


def _range_and_offset(node: Any) -> Optional[tuple[fx.Node, Any]]:
    """`arange(n) [+ offset]` -> (the arange node, offset): a 1-D position range."""
    node = _through_views(node)
    offset: Any = 0
    if _is(node, _ADDS):
        a, b = node.args[0], node.args[1]
        if _is(a, {torch.arange}):
            node, offset = a, b
        elif _is(b, {torch.arange}):
            node, offset = b, a
        else:
            return None
    if not _is(node, {torch.arange}) or len(node.args) != 1 or node.kwargs.get("step", 1) != 1:
        return None
    if isinstance(offset, fx.Node):
        value = axes.example_value(offset)
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            return None  # a per-request offset: not one position range
    return node, offset


def _axis_from_right(node: fx.Node) -> Optional[int]:
    """The one axis (counted from the right, 0 = last) along which a broadcast index varies."""
    shape = axes.shape_of(node)
    if shape is None:
        return None
    varying = [len(shape) - 1 - i for i, n in enumerate(shape) if not axes.known_equal(n, 1)]
    return varying[0] if len(varying) == 1 else None


def _factors(node: fx.Node) -> list[fx.Node]:
    node = _through_views(node)
    if _is(node, _AND) and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        return _factors(node.args[0]) + _factors(node.args[1])
    return [node]


def split_causal(term: MaskTerm) -> Optional[CausalSplit]:
    """`term` as a causal comparison of query and key positions and the rest, or None."""
    if term.kind != "keep" or not isinstance(term.node, fx.Node):
        return None
    roles = term.roles
    found: Optional[tuple[fx.Node, Any]] = None
    rest: list[MaskTerm] = []
    for factor in _factors(term.node):
        if _all_true(factor):
            continue
        pair = None
        if _is(factor, _LE) and len(factor.args) == 2:
            pair = factor.args[0], factor.args[1]  # kv <= q
        elif _is(factor, _GE) and len(factor.args) == 2:
            pair = factor.args[1], factor.args[0]  # q >= kv
        split = _comparison(pair, roles) if pair is not None and found is None else None
        if split is not None:
            found = split
            continue
        shape = axes.shape_of(factor)
        value = axes.example_value(factor)
        if shape is None or not isinstance(value, torch.Tensor) or value.dtype != torch.bool or len(shape) > len(roles):
            return None
        rest.append(MaskTerm(factor, "keep", 1.0, list(roles[len(roles) - len(shape) :])))
    if found is None:
        return None
    return CausalSplit(term, found[0], found[1], rest)


def _comparison(pair: tuple[Any, Any], roles: list[Optional[str]]) -> Optional[tuple[fx.Node, Any]]:
    kv, q = pair
    if not (isinstance(kv, fx.Node) and isinstance(q, fx.Node)):
        return None
    kv_range, q_range = _range_and_offset(kv), _range_and_offset(q)
    if kv_range is None or q_range is None:
        return None
    rows = q_range[0].args[0]
    if not isinstance(rows, int) or rows <= 1:
        return None  # one query token (a decode step): its mask is one row per request already
    kv_axis, q_axis = _axis_from_right(kv), _axis_from_right(q)
    if kv_axis is None or q_axis is None or max(kv_axis, q_axis) >= len(roles):
        return None
    if roles[len(roles) - 1 - kv_axis] != T or roles[len(roles) - 1 - q_axis] != S:
        return None
    q_positions = _through_views(q)
    return q_positions, kv_range[1]


def causal_splits(masks: list[MaskTerm]) -> tuple[Optional[CausalSplit], list[MaskTerm]]:
    """(the first mask term that splits into a causal comparison, the masks left to add)."""
    for i, term in enumerate(masks):
        split = split_causal(term)
        if split is not None:
            return split, list(masks[:i]) + split.rest + list(masks[i + 1 :])
    return None, list(masks)
