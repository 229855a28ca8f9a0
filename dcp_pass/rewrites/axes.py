"""Axis bookkeeping for torch-level FX graphs.

The matcher must know which axis of a tensor is the batch, query-sequence, head,
key-sequence or feature axis, whatever the model's layout ([b,s,h,d], [b,h,s,d], ...).
Roles come from the one place they are certain, the cache buffer ([batch, position,
feature]), and are carried through pure axis-moving ops (permute, transpose,
unsqueeze, dtype casts) and through contractions by their labels.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

B, S, H, T, F = "B", "S", "H", "T", "F"  # batch, query seq, heads, key seq, feature

DTYPE_CASTS = {"float", "half", "bfloat16", "to", "type_as", "type", "contiguous", "clone"}


def example_value(node: Any) -> Any:
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def shape_of(node: Any) -> Optional[tuple]:
    value = example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def known_equal(a: Any, b: Any) -> bool:
    """Equality of (possibly symbolic) sizes that holds for every value of the symbols."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def is_method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def is_function(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


def is_dtype_cast(node: fx.Node) -> bool:
    """A node that changes dtype/contiguity but never moves an axis."""
    # .to(dtype / device / other_tensor) keeps the shape too
    return node.op == "call_method" and node.target in DTYPE_CASTS


def normalize_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def axis_moving_step(node: fx.Node) -> Optional[tuple[fx.Node, list[Optional[int]]]]:
    """For a pure axis-moving op return (input, source axis of each output axis or None for new axes)."""
    shape = shape_of(node)
    if shape is None or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    src_shape = shape_of(src)
    if src_shape is None:
        return None
    rank, src_rank = len(shape), len(src_shape)
    if is_dtype_cast(node):
        return src, list(range(src_rank))
    target = node.target
    if (
        node.op == "call_method"
        and target in ("transpose", "swapaxes")
        or (node.op == "call_function" and target in (torch.transpose, torch.swapaxes))
    ):
        d0, d1 = (normalize_dim(d, src_rank) for d in node.args[1:3])
        swapped = list(range(src_rank))
        swapped[d0], swapped[d1] = swapped[d1], swapped[d0]
        return src, swapped
    if node.op == "call_method" and target == "permute" or is_function(node, torch.permute):
        dims = node.args[1:] if node.op == "call_method" else node.args[1]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        return src, [normalize_dim(d, src_rank) for d in dims]
    if node.op == "call_method" and target == "unsqueeze" or is_function(node, torch.unsqueeze):
        d = normalize_dim(node.args[1], rank)
        order: list[Optional[int]] = list(range(src_rank))
        order.insert(d, None)
        return src, order
    if node.op == "call_method" and target == "expand":
        if rank == src_rank:
            return src, list(range(src_rank))
    if node.op == "call_method" and target == "mT" or (node.op == "call_method" and target == "t" and src_rank == 2):
        return src, list(range(src_rank - 2)) + [src_rank - 1, src_rank - 2]
    return None


def _walk_back(node: fx.Node, steps: int):
    """`node`, then each input reached by up to `steps` axis-moving ops back, with the
    axis of that input that each axis of `node` came from (None for new axes)."""
    order: list[Optional[int]] = list(range(len(shape_of(node) or ())))
    current = node
    yield current, order
    for _ in range(steps):
        step = axis_moving_step(current)
        if step is None:
            return
        current, src_axes = step
        order = [None if o is None else src_axes[o] for o in order]
        yield current, order


def trace_axes(node: fx.Node, stop: Any) -> Optional[tuple[fx.Node, list[Optional[int]]]]:
    """Walk back through axis-moving ops until `stop(n)` is true (at most 32 nodes).

    Returns (the stopping node, for each axis of `node` its axis in the stopping node or None).
    """
    for current, order in _walk_back(node, 31):
        if stop(current):
            return current, order
    return None


def trace_to_base(node: fx.Node) -> tuple[fx.Node, list[Optional[int]]]:
    """Walk back through axis-moving ops as far as possible (for layout tie-breaks)."""
    *_, last = _walk_back(node, 32)
    return last


EINSUM_TARGETS = {torch.einsum, getattr(torch.functional, "einsum", torch.einsum)}
MATMUL_FUNCTIONS = {torch.matmul, operator.matmul, torch.bmm}


@dataclass
class Contraction:
    """A two-operand contraction with one label per axis (einsum or matmul family)."""

    node: fx.Node
    lhs: fx.Node
    rhs: fx.Node
    lhs_labels: list[str]
    rhs_labels: list[str]
    out_labels: list[str]
    family: str  # "einsum" | "matmul"

    def operand_labels(self, operand: fx.Node) -> list[str]:
        return self.lhs_labels if operand is self.lhs else self.rhs_labels

    def other(self, operand: fx.Node) -> fx.Node:
        return self.rhs if operand is self.lhs else self.lhs


def as_contraction(node: fx.Node) -> Optional[Contraction]:
    if node.op == "call_function" and node.target in EINSUM_TARGETS:
        return _einsum_contraction(node)
    if is_function(node, *MATMUL_FUNCTIONS) or is_method(node, "matmul", "bmm", "__matmul__"):
        return _matmul_contraction(node)
    return None


def _einsum_contraction(node: fx.Node) -> Optional[Contraction]:
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or "..." in equation or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    parts = inputs.split(",")
    if len(parts) != 2 or not all(isinstance(o, fx.Node) for o in operands):
        return None
    return Contraction(node, operands[0], operands[1], list(parts[0]), list(parts[1]), list(out), "einsum")


def _matmul_contraction(node: fx.Node) -> Optional[Contraction]:
    lhs, rhs = node.args[0], node.args[1]
    if not (isinstance(lhs, fx.Node) and isinstance(rhs, fx.Node)):
        return None
    ls, rs = shape_of(lhs), shape_of(rhs)
    if ls is None or rs is None or len(ls) < 2 or len(rs) < 2:
        return None
    nbatch = max(len(ls), len(rs)) - 2
    batch = [f"n{i}" for i in range(nbatch)]
    lhs_labels = batch[nbatch - (len(ls) - 2) :] + ["i", "k"]
    rhs_labels = batch[nbatch - (len(rs) - 2) :] + ["k", "j"]
    return Contraction(node, lhs, rhs, lhs_labels, rhs_labels, batch + ["i", "j"], "matmul")


def permutation_to(roles: Sequence[Optional[str]], canonical: Sequence[str]) -> Optional[list[int]]:
    """The permute() argument that reorders axes with `roles` into `canonical` order."""
    if sorted(r for r in roles if r is not None) != sorted(canonical) or len(roles) != len(canonical):
        return None
    return [list(roles).index(r) for r in canonical]


# ----------------------------------------------------------------------------- matmul family
# Matmul-style models flatten (seq, heads) into one axis around a 3-D matmul and view
# the result back: `matmul(q.flatten(1, 2), k.transpose(1, 2)).view(b, s, h, t)`.
# We model that as one contraction over the unflattened operand, with the merged
# axis label split in two, so the role logic sees [b, s, h, *] tensors again.


def flatten_source(node: Any) -> Optional[tuple[fx.Node, int]]:
    """(input, first merged axis) when `node` merges exactly two adjacent axes."""
    if not isinstance(node, fx.Node):
        return None
    if is_method(node, "flatten") or is_function(node, torch.flatten):
        src = node.args[0]
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        src_shape = shape_of(src)
        if src_shape is None:
            return None
        start, end = normalize_dim(start, len(src_shape)), normalize_dim(end, len(src_shape))
        return (src, start) if end == start + 1 else None
    if is_method(node, "view", "reshape") and isinstance(node.args[0], fx.Node):
        src = node.args[0]
        shape, src_shape = shape_of(node), shape_of(src)
        if shape is not None and src_shape is not None and len(src_shape) == len(shape) + 1:
            for a in range(len(shape)):
                if (
                    all(known_equal(shape[i], src_shape[i]) for i in range(a))
                    and known_equal(shape[a], src_shape[a] * src_shape[a + 1])
                    and all(known_equal(shape[i], src_shape[i + 1]) for i in range(a + 1, len(shape)))
                ):
                    return src, a
    return None


def split_axes(view: fx.Node, src: fx.Node) -> list[int]:
    """Every axis `a` such that `view` (a view/reshape of `src`) splits src's axis a in two.

    Several can fit when sizes are 1 (b=2, s=1, h=2: [2, 2, t] -> [2, 1, 2, t]); the
    caller keeps the one that matches how the operands were flattened.
    """
    if not is_method(view, "view", "reshape"):
        return []
    shape, src_shape = shape_of(view), shape_of(src)
    if shape is None or src_shape is None or len(shape) != len(src_shape) + 1:
        return []
    return [
        a
        for a in range(len(src_shape))
        if all(known_equal(shape[i], src_shape[i]) for i in range(a))
        and known_equal(shape[a] * shape[a + 1], src_shape[a])
        and all(known_equal(shape[i + 1], src_shape[i]) for i in range(a + 1, len(src_shape)))
    ]


def unflatten_contraction(contraction: Contraction, out_axis: int, node: fx.Node) -> Optional[Contraction]:
    """The contraction seen with output axis `out_axis` split in two (output = `node`)."""
    label = contraction.out_labels[out_axis]
    halves = [label + "'", label + '"']
    operands = []
    for operand, labels in ((contraction.lhs, contraction.lhs_labels), (contraction.rhs, contraction.rhs_labels)):
        if label not in labels:
            operands.append((operand, labels))
            continue
        flat = flatten_source(operand)
        if flat is None or flat[1] != labels.index(label):
            return None
        i = labels.index(label)
        operands.append((flat[0], labels[:i] + halves + labels[i + 1 :]))
    out = contraction.out_labels[:out_axis] + halves + contraction.out_labels[out_axis + 1 :]
    (lhs, lhs_labels), (rhs, rhs_labels) = operands
    return Contraction(node, lhs, rhs, lhs_labels, rhs_labels, out, contraction.family)
