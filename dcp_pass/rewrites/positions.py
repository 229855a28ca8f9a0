"""Int step positions become device data: static-shape decode graphs for CUDA graphs.

A reference-style model takes the step position as a Python int (`start_pos`) and
uses it in slices: `cache[:b, start:end] = kv`, `cache[:b, :end]`,
`freqs_cis[start:end]`. After the first steps Dynamo makes it a SymInt graph input,
so every step calls the compiled graph with a new int: inductor's CUDA graphs key
their recordings on int inputs and re-record every step (none is ever replayed).

This rewrite runs after the DCP rewrite (which already turned cache reads into the
attention op and writes into `write_owned_tokens_`). It replaces the int input by a
one-element int64 tensor that the backend fills before each call, and every use of the
position by device arithmetic on it:

  write_owned_tokens_(shard, v, start, ...)  ->  write_tokens_at_(shard, v, start_t + arange(s), ...)
  mla_local_attention(kv_len=start + s)       ->  kv_lens=dcp_end_pos (kv_len=STEP_COUNT)
  x[..., start:start + k, ...]                ->  x.index_select(dim, start_t + arange(k))

When every attention op reads the same key count `start + s`, the buffer holds that
count (`dcp_end_pos`, filled with start + s) and the ops take it as it is: a count
computed on the device would be one more kernel per layer (inductor recomputes it for
each op), a host call each without CUDA graphs. `start_t` is then `dcp_end_pos - s`,
which fuses into the kernels that use it. Otherwise the buffer holds the position itself
(`dcp_start_pos`).

It applies only when the graph's one symbolic input is such a position and every use
is one of these (no tensor shape depends on it): otherwise the graph stays as it is
(correct, just without replayable CUDA graphs) and the reason is reported. Pure
graph surgery; the runtime functions it calls know nothing of graphs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import fx_util
from dcp_pass.runtime.decode import layout
from dcp_pass.runtime.decode.step_count import STEP_COUNT

_ARITH = {
    operator.add: torch.add,
    operator.sub: torch.sub,
    operator.mul: torch.mul,
    operator.floordiv: torch.floor_divide,
}


class NotStatic(Exception):
    """The graph's position cannot be moved to the device; the message says why."""


@dataclass
class DevicePosition:
    """What the backend does per call for a graph whose position moved to the device.

    `index`: the int position among the graph's original inputs, written into
    `buffer` (int64 [1], the rewritten graph's last input) plus `offset` (the key count's
    distance from the position; 0 when the buffer holds the position). `dropped`: other int inputs
    that only described an input tensor's strides or offset (e.g. `tokens[:, p:p+1]` of
    a longer buffer has offset p); they are removed, and each such tensor input is
    copied into a fixed contiguous buffer (`restaged`: original index -> buffer), so
    nothing the graph takes changes from step to step.
    """

    index: int
    buffer: torch.Tensor
    dropped: tuple[int, ...] = ()
    restaged: dict[int, torch.Tensor] = field(default_factory=dict)
    offset: int = 0

    def _kept(self, n: int) -> list[int]:
        return [i for i in range(n) if i != self.index and i not in self.dropped]

    @property
    def holds_count(self) -> bool:
        """Whether the buffer holds the step's key count (the attention ops then read it, marked
        kv_len=STEP_COUNT), not the position."""
        return self.offset > 0

    def key_count(self, args: tuple) -> Optional[int]:
        """The step's key count for the original graph's `args` when the buffer holds it, else None."""
        return int(args[self.index]) + self.offset if self.holds_count else None

    def call_args(self, args: tuple) -> list:
        """The rewritten graph's leading inputs for the original graph's `args`."""
        self.buffer.fill_(args[self.index] + self.offset)
        staged = self.restaged
        return [staged[i].copy_(args[i]) if i in staged else args[i] for i in self._kept(len(args))]

    def example_inputs(self, examples) -> list:
        """The inner compiler's example inputs for the leading inputs (static restaged ones)."""
        fake_mode = fx_util.current_fake_mode()

        def static(t):
            return fake_mode.from_tensor(t, static_shapes=True) if fake_mode else t

        return [static(self.restaged[i]) if i in self.restaged else examples[i] for i in self._kept(len(examples))]


_value = fx_util.node_value


def _is_symint(node: Any) -> bool:
    return isinstance(_value(node), torch.SymInt)


def _static_int(x: Any) -> Optional[int]:
    """The int value of `x` if it is a constant (or a node whose value is a plain int)."""
    v = _value(x)
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt) and v.node.is_constant():
        return int(v)
    return None


def _static_difference(a: Any, b: Any) -> Optional[int]:
    """`a - b` when it does not depend on any symbol (e.g. (s + 1) - s)."""
    va, vb = _value(a), _value(b)
    if va is None or vb is None:
        return None
    try:
        diff = va - vb
    except TypeError:
        return None
    if isinstance(diff, int):
        return diff
    if isinstance(diff, torch.SymInt):
        expr = diff.node.expr
        if expr.is_number:
            return int(expr)
    return None


def _static_tensor(value: Any) -> bool:
    return all(isinstance(d, int) for d in (*value.shape, *value.stride(), value.storage_offset()))


def has_symbolic_input(graph: fx.Graph) -> bool:
    return any(_is_symint(n) for n in graph.find_nodes(op="placeholder"))


def find_position_input(graph: fx.Graph) -> tuple[fx.Node, list[fx.Node], list[fx.Node]]:
    """(the position, int inputs that describe only tensor layouts, tensors to restage)."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    used = [n for n in placeholders if _is_symint(n) and n.users]
    unused = [n for n in placeholders if _is_symint(n) and not n.users]
    if len(used) != 1:
        raise NotStatic(f"{len(used)} symbolic int inputs used in the graph (one step position expected)")
    restage = []
    for node in placeholders:
        value = _value(node)
        if not isinstance(value, torch.Tensor):
            continue
        if any(not isinstance(d, int) for d in value.shape):
            raise NotStatic(f"input {node.name} has a symbolic shape {tuple(value.shape)}")
        if not _static_tensor(value):
            restage.append(node)
    return used[0], unused, restage


class _Rewriter:
    def __init__(
        self,
        graph: fx.Graph,
        start: fx.Node,
        start_t: fx.Node,
        device: torch.device,
        end_t: Optional[fx.Node] = None,
        count_offset: int = 0,
    ):
        self.graph, self.start, self.device = graph, start, device
        self.tensor_of: dict[fx.Node, fx.Node] = {start: start_t}  # SymInt node -> int64 [1] node
        self.offset_of: dict[fx.Node, int] = {start: 0}  # SymInt node == start + offset (when known)
        # the buffer when it holds the key count start + count_offset (see the module doc)
        self.end_t, self.count_offset = end_t, count_offset

    def call(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.create_node("call_function", target, args, kwargs)

    def as_tensor(self, x: Any) -> Any:
        """The device tensor (int64 [1]) for a position-derived SymInt node; ints pass through."""
        if isinstance(x, fx.Node) and x in self.tensor_of:
            return self.tensor_of[x]
        if _static_int(x) is not None:
            return _static_int(x)
        raise NotStatic(f"{x} is symbolic but not derived from the position")

    def positions(self, first: Any, count: int) -> fx.Node:
        steps = self.call(torch.arange, count, device=self.device)
        return self.call(torch.add, self.as_tensor(first), steps)

    def visit(self, node: fx.Node) -> None:
        """Rewrite every user of the position-derived SymInt `node`."""
        for user in list(node.users):
            if getattr(user, "_erased", False):  # reached first through another SymInt
                continue
            if user.op == "output":
                raise NotStatic("the graph returns the position")
            with self.graph.inserting_before(user):
                self.rewrite_user(user)

    def rewrite_user(self, user: fx.Node) -> None:
        target = user.target
        if target in _ARITH and _is_symint(user):
            if user in self.tensor_of:
                return
            a, b = user.args
            self.tensor_of[user] = self.call(_ARITH[target], self.as_tensor(a), self.as_tensor(b))
            if target is operator.add:
                base, k = (a, _static_int(b)) if a in self.offset_of else (b, _static_int(a))
                if base in self.offset_of and k is not None:
                    self.offset_of[user] = self.offset_of[base] + k
            self.visit(user)
        elif target is layout.write_owned_tokens_:
            shard, values, start, c, r, capacity, *rest = user.args
            seq = _value(values).shape[1]
            new = self.call(layout.write_tokens_at_, shard, values, self.positions(start, seq), c, r, capacity, *rest)
            new.name = user.name
            user.replace_all_uses_with(new)
            self.graph.erase_node(user)
        elif target is torch.ops.dcp.mla_local_attention.default:
            kv_len = user.kwargs["kv_len"]
            step = self.end_t is not None and self.offset_of.get(kv_len) == self.count_offset
            counts = self.end_t if step else self.as_tensor(kv_len)
            # the int count is not read when the device counts are given; STEP_COUNT marks the
            # step's count buffer, whose value the backend holds (runtime/decode/step_count.py)
            user.kwargs = dict(user.kwargs, kv_len=STEP_COUNT if step else 0, kv_lens=counts)
        elif target is operator.getitem and isinstance(user.args[0], fx.Node) and _is_tensor(user.args[0]):
            self.rewrite_slice(user)
        elif target in (torch._check, torch._check_is_size) or getattr(target, "__name__", "") in (
            "_assert_scalar",
            "sym_constrain_range_for_size",
        ):
            # bounds of the position (checked by the writes' own device assertion instead)
            self.graph.erase_node(user)
        elif target is torch.arange and len(user.args) == 2 and not set(user.kwargs) - {"device", "dtype"}:
            # arange(start, start + k) -> start_t + arange(k): the positions of the step's tokens
            first, stop = user.args
            length = _static_difference(stop, first)
            if length is None:
                raise NotStatic(f"{user.format_node()}: the range's length depends on the position")
            new = self.positions(first, length)
            if user.kwargs.get("dtype") not in (None, torch.int64):
                new = self.call(torch.Tensor.to, new, user.kwargs["dtype"])
            user.replace_all_uses_with(new)
            self.graph.erase_node(user)
        elif target is operator.getitem:
            raise NotStatic(f"{user.format_node()} indexes a non-tensor with the position")
        else:
            raise NotStatic(f"the position reaches {user.format_node()}")

    def rewrite_slice(self, user: fx.Node) -> None:
        source, index = user.args
        index = index if isinstance(index, tuple) else (index,)
        dims, new_index, gathered = 0, [], None
        for item in index:
            if isinstance(item, slice) and (_is_symint(item.start) or _is_symint(item.stop)):
                if gathered is not None or item.step not in (None, 1):
                    raise NotStatic(f"{user.format_node()}: more than one symbolic slice")
                length = _static_difference(item.stop, item.start)
                if length is None:
                    raise NotStatic(f"{user.format_node()}: the slice length depends on the position")
                gathered = (dims, item.start, length)
                new_index.append(slice(None))
            elif item is Ellipsis:
                raise NotStatic(f"{user.format_node()}: an Ellipsis next to a symbolic slice")
            else:
                new_index.append(item)
            if item is not None:
                dims += 1
        if gathered is None:
            raise NotStatic(f"{user.format_node()}: a symbolic index that is not a slice")
        dim, first, length = gathered
        # Integer items before the slice drop a dimension of the result.
        dim -= sum(1 for item in index[:dim] if isinstance(item, int) or _is_symint(item))
        base = (
            self.call(operator.getitem, source, tuple(new_index))
            if any(not (isinstance(i, slice) and i == slice(None)) for i in new_index)
            else source
        )
        new = self.call(torch.index_select, base, dim, self.positions(first, length))
        user.replace_all_uses_with(new)
        self.graph.erase_node(user)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(_value(node), torch.Tensor)


def _device_of(graph: fx.Graph) -> torch.device:
    for node in graph.find_nodes(op="placeholder"):
        value = _value(node)
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def positions_to_device(gm: fx.GraphModule) -> tuple[fx.GraphModule, DevicePosition]:
    """A copy of `gm` whose int position is a device tensor input; `gm` is not touched.

    Raises NotStatic when it does not apply. The int placeholder is removed; the new
    int64 [1] input `dcp_start_pos` is the graph's last input.
    """
    find_position_input(gm.graph)  # cheap refusal before copying
    work = fx_util.copy_dynamo_graph_module(gm)
    graph = work.graph
    start, unused, restage = find_position_input(graph)
    device = _device_of(graph)
    placeholders = list(graph.find_nodes(op="placeholder"))
    buffer = torch.zeros(1, dtype=torch.long, device=device)
    offset = shared_count_offset(graph, start)
    if offset:
        end_t = fx_util.static_placeholder(graph, "dcp_end_pos", buffer)
        with graph.inserting_after(end_t):
            start_t = graph.call_function(torch.sub, (end_t, offset))
        rewriter = _Rewriter(graph, start, start_t, device, end_t, offset)
    else:
        start_t = fx_util.static_placeholder(graph, "dcp_start_pos", buffer)
        rewriter = _Rewriter(graph, start, start_t, device)
    rewriter.visit(start)
    _erase_dead_symbolic(graph)
    # device arithmetic made for uses that took the count buffer instead
    fx_util.erase_dead_region(graph, [n for n in rewriter.tensor_of.values() if n.op == "call_function"])
    if start.users:
        raise NotStatic(f"the position is still used by {', '.join(u.name for u in start.users)}")
    restaged = {}
    for node in restage:
        value = _value(node)
        restaged[placeholders.index(node)] = torch.zeros(tuple(value.shape), dtype=value.dtype, device=value.device)
    for node in [start, *unused]:
        graph.erase_node(node)
    leftover = [n for n in graph.nodes if n.op != "placeholder" and _uses_symbol(n)]
    if leftover:
        raise NotStatic(f"{leftover[0].format_node()} still has a symbolic value")
    graph.lint()
    work.recompile()
    return work, DevicePosition(
        placeholders.index(start), buffer, tuple(placeholders.index(n) for n in unused), restaged, offset
    )


def shared_count_offset(graph: fx.Graph, start: fx.Node) -> int:
    """s when every attention op of `graph` reads the key count `start + s` (s > 0), else 0."""
    offsets = set()
    for node in graph.find_nodes(op="call_function", target=torch.ops.dcp.mla_local_attention.default):
        count = node.kwargs.get("kv_len")
        if not (isinstance(count, fx.Node) and count.target is operator.add and start in count.args):
            return 0
        other = count.args[1] if count.args[0] is start else count.args[0]
        k = _static_int(other)
        if k is None:
            return 0
        offsets.add(k)
    return offsets.pop() if len(offsets) == 1 and min(offsets) > 0 else 0


def _erase_dead_symbolic(graph: fx.Graph) -> None:
    """Erase the SymInt arithmetic that only fed rewritten uses."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op == "call_function" and not node.users and _is_symint(node):
                graph.erase_node(node)
                changed = True


def _uses_symbol(node: fx.Node) -> bool:
    return any(_is_symint(a) for a in node.all_input_nodes)
