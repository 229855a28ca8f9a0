"""Complex products in real arithmetic (the reference code's rotary embedding).

DeepSeek-style code rotates queries and keys as

    torch.view_as_real(torch.view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis.view(...))

Inductor has no complex code generation: `view_as_complex`, the complex multiply,
`view_as_real` and every view or index of the complex `freqs_cis` run as fallback ops,
each one host call per step when the step is not a CUDA graph (three or four per
rotary; a DCP layer has three rotaries, one more for the replicated query). The same
product written as

    stack(xr * fr - xi * fi, xr * fi + xi * fr)

is pointwise (`runtime.decode.rotary.complex_mul_real`, one graph node), so inductor
fuses it with its neighbours. The complex operand is reached
through its real view: `view_as_real` is moved up through the views and indexing that
made it to the tensor they came from (for `freqs_cis`, the buffer itself), so the
lookup at the step position becomes a real gather that fuses too.

Only products whose dtypes already agree are rewritten (real input, the complex
operand's real dtype and the result all the same float dtype), which is what the
complex multiply computes up to the rounding of its own formula. Pure graph surgery
on Dynamo's torch-level graph; every new node gets its example value, so the passes
after this one (positions) read it like any other node.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.report import log
from dcp_pass.rewrites import fx_util
from dcp_pass.rewrites.axes import example_value, is_function, is_method, known_equal
from dcp_pass.runtime.decode.rotary import complex_mul_real

_MULS = (operator.mul, torch.mul)


def _is_view_as_complex(node: Any) -> bool:
    return isinstance(node, fx.Node) and is_function(node, torch.view_as_complex)


def complex_product(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(x, f) when `node` is `view_as_real(view_as_complex(x) * f)` (either operand order)
    with x real [..., 2], f complex and x, f's real dtype and the result one dtype."""
    if not is_function(node, torch.view_as_real) or len(node.args) != 1:
        return None
    product = node.args[0]
    if not isinstance(product, fx.Node) or product.kwargs or len(product.args) != 2:
        return None
    if not (is_function(product, *_MULS) or is_method(product, "mul")):
        return None
    a, b = product.args
    pair = (a, b) if _is_view_as_complex(a) else (b, a) if _is_view_as_complex(b) else None
    if pair is None or not isinstance(pair[1], fx.Node):
        return None
    as_complex, other = pair
    x = as_complex.args[0] if len(as_complex.args) == 1 and not as_complex.kwargs else None
    vx, vf, vout = example_value(x), example_value(other), example_value(node)
    if not all(isinstance(v, torch.Tensor) for v in (vx, vf, vout)) or not vf.is_complex():
        return None
    if not (vx.dtype == vout.dtype == vf.dtype.to_real()) or vx.dtype not in (torch.float32, torch.float64):
        return None
    if _mutation_between(product, node):  # the real form reads x and f where the view_as_real was
        return None
    return x, other


def _mutation_between(first: fx.Node, last: fx.Node) -> bool:
    node = first.next
    while node is not last and node.op != "root":
        if node.op in ("call_function", "call_method") and fx_util.mutates_input(node):
            return True
        node = node.next
    return False


class _RealViews:
    """`view_as_real` of complex nodes, moved up through views and indexing.

    real(z.view(*shape))         = real(z).view(*shape, 2)
    real(z[index]) (no Ellipsis) = real(z)[index]
    real(index_select(z, d, i))  = index_select(real(z), d', i)   (d' = d - 1 if d < 0)
    real(unsqueeze(z, d))        = unsqueeze(real(z), d')
    real(conj(z))                = cat(real(z)[..., :1], -real(z)[..., 1:])
    real(anything else)          = view_as_real(z)

    The real dimension is the last one, so indexing and views of the leading (complex)
    dimensions carry over unchanged. Each node's real view is made once (the rotaries
    of every layer share `freqs_cis`'s) and placed right after the node.
    """

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.made: dict[fx.Node, fx.Node] = {}  # complex node -> its real view (every one made)

    def of(self, node: fx.Node, site: fx.Node) -> fx.Node:
        """The real view of `node`, placed right after it, or for a graph input (which must
        stay among the inputs, ahead of e.g. the inference-mode block's first node) right
        after `site`, a node after the input and before every use of the view."""
        if node not in self.made:
            self.made[node] = self._build(node, site)
        return self.made[node]

    def _new(self, after: fx.Node, op: str, target: Any, args: tuple, name: str) -> fx.Node:
        with self.graph.inserting_after(after):
            new = self.graph.create_node(op, target, args, {}, name=f"{name}_real")
        try:
            fx_util.set_example_value(new)
        except Exception:
            self.graph.erase_node(new)  # a node that cannot be traced is not left behind
            raise
        return new

    def _conjugate(self, node: fx.Node, base: fx.Node) -> fx.Node:
        """real(conj(z)) = (re, -im) of real(z): `view_as_real` of a conjugate view fails at run time."""
        base_real = self.of(base, node)
        first = (base_real, (Ellipsis, slice(None, 1)))
        re = self._new(_later(base_real, node), "call_function", operator.getitem, first, node.name)
        im = self._new(re, "call_function", operator.getitem, (base_real, (Ellipsis, slice(1, None))), node.name)
        neg = self._new(im, "call_function", operator.neg, (im,), node.name)
        return self._new(neg, "call_function", torch.cat, ([re, neg], -1), node.name)

    def _build(self, node: fx.Node, site: fx.Node) -> fx.Node:
        args, base = node.args, node.args[0] if node.args else None
        if _is_input(node):
            return self._new(site, "call_function", torch.view_as_real, (node,), node.name)
        if node.kwargs or not isinstance(base, fx.Node):
            return self._new(node, "call_function", torch.view_as_real, (node,), node.name)

        def derived(target_op: str, target: Any, *rest: Any) -> fx.Node:
            base_real = self.of(base, node)
            return self._new(_later(base_real, node), target_op, target, (base_real, *rest), node.name)

        if is_method(node, "view", "reshape") and len(args) >= 2:
            shape = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            if all(isinstance(s, (int, fx.Node)) and not isinstance(s, bool) for s in shape) and not any(
                isinstance(s, fx.Node) and not isinstance(example_value(s), (int, torch.SymInt)) for s in shape
            ):
                return derived("call_method", node.target, *shape, 2)
        elif is_function(node, operator.getitem) and len(args) == 2 and _keeps_last_dim(args[1]):
            return derived("call_function", operator.getitem, args[1])
        elif is_function(node, torch.index_select) and len(args) == 3 and isinstance(args[1], int):
            return derived("call_function", torch.index_select, _shift(args[1]), args[2])
        elif (
            (is_method(node, "unsqueeze") or is_function(node, torch.unsqueeze))
            and len(args) == 2
            and isinstance(args[1], int)
        ):
            return derived(node.op, node.target, _shift(args[1]))
        elif (is_method(node, "conj") or is_function(node, torch.conj)) and len(args) == 1:
            return self._conjugate(node, base)
        return self._new(node, "call_function", torch.view_as_real, (node,), node.name)


def _later(a: fx.Node, b: fx.Node) -> fx.Node:
    """Whichever of `a` and `b` comes later in their graph: a node derived from both goes after
    it (an input's real view sits after its first use, which may come before or after `b`, whose
    own arguments, a step position's arithmetic, may come after that first use)."""
    node = a.next
    while node.op != "root":
        if node is b:
            return b
        node = node.next
    return a


def _is_input(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def _shift(dim: int) -> int:
    """A complex tensor's dim counted on its real view (one more trailing dim)."""
    return dim - 1 if dim < 0 else dim


def _keeps_last_dim(index: Any) -> bool:
    """An index that addresses leading dims only: the same index on the real view
    leaves the trailing real dim alone (an Ellipsis would reach it)."""
    items = index if isinstance(index, tuple) else (index,)
    return not any(item is Ellipsis for item in items)


def complex_products_as_real(graph: fx.Graph) -> int:
    """Rewrite every `view_as_real(view_as_complex(x) * f)` of `graph` in real arithmetic;
    returns how many. A product whose new nodes cannot be traced stays as it was."""
    views = _RealViews(graph)
    done = 0
    for node in list(graph.nodes):
        found = complex_product(node)
        if found is None:
            continue
        x, f = found
        product, new = node.args[0], []
        try:
            f_real = views.of(f, product)
            with graph.inserting_before(node):
                new = [graph.call_function(complex_mul_real, (x, f_real))]
            new[0].name = f"{product.name}_as_real"
            fx_util.set_example_value(new[0])
            vnew, vold = example_value(new[0]), example_value(node)
            same = (
                vnew.dtype == vold.dtype
                and vnew.dim() == vold.dim()
                and all(known_equal(a, b) for a, b in zip(vnew.shape, vold.shape))
            )
        except Exception as why:  # noqa: BLE001 - an unforeseen view or index: keep the complex form
            log.info("dcp_pass: %s kept complex: %s", node.name, why)
            same = False
        if not same:
            fx_util.erase_dead_region(graph, new)
            continue
        node.replace_all_uses_with(new[0])
        graph.erase_node(node)
        fx_util.erase_dead_region(graph, [product])
        done += 1
    fx_util.erase_dead_region(graph, [n for n in views.made.values() if not n.users])
    return done
