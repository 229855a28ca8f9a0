"""Project before merge: the value up-projection applied to each rank's partial output,
so that the exchange carries v_head_dim columns per head instead of the latent width.

Absorbed MLA attends over latent rows (kv_lora_rank wide, 512 in DeepSeek-V3) and the
model then applies the value half of `wkv_b` per head (`w_vc`, latent -> v_head_dim,
128 in DeepSeek-V3): `einsum('bshc,hdc->bshd', o, wkv_b[:, -v_head_dim:])`. The DCP merge
is a weighted sum with per-row weights, o = sum_r w_r o_r (w_r = b**(lse_r - lse), one per
batch row, query position and head), and a per-head linear map P commutes with it:
P(o) = sum_r w_r P(o_r). So each rank projects its partial output of every DCP-group head
by that head's `w_vc`, and the exchange merges the projected partials: exact up to
rounding, and the exchanged rows are v_head_dim + LSE wide instead of latent + LSE.

Emptiness stays a count: an empty shard's partial is 0 with LSE -inf, the projection keeps
it 0, and the merge gives it weight 0 from its LSE (zeroing its rows whatever they hold).
A NaN in the data reaches the projected partial and propagates through the merge as it
would through the merged output.

Found (`find_projection`), walking from the merged output [B, S, H, F]: a chain of
layout-only ops, each the only use of the one before (permute / transpose; view /
reshape / flatten / unflatten / squeeze / unsqueeze that keep the order of elements), then
a two-operand contraction (einsum, matmul, bmm) whose other operand, the weight, is
computed from module parameters only. The contraction must sum the latent axis against
the weight, keep the head axis (which the weight may index) and the row axes (batch,
query position) untouched, and bring exactly one axis of its own (v_head_dim). Anything
else (a nonlinear use, a second use, a weight computed from an activation or a buffer)
raises `NotProjected`, whose text the report shows.

Emitted (`emit_projection`), before the projection, for head-sharded models (every rank
holds H/c heads, and the partial output covers the c*H/c heads of the DCP group):

    partial_heads = partial_out.chunk(c, 2)         # head chunk r belongs to DCP rank r
    partial_proj_r = einsum('bshf,<w>->bshv', partial_heads[r], w_vc of rank r)
    partial_proj = cat(partial_proj_0 .. partial_proj_{c-1}, 2)
    merged_proj = <the same exchange>(partial_proj, partial_lse, ...)

Rank r's `w_vc` is the model's weight expression evaluated on rank r's parameter shards,
gathered once at compile time (`QueryReplicator.weight_input`, the inputs query
replication uses; parameters equal on every rank are not gathered). For models whose
heads are not sharded (tp_size=1) the local weight covers every head: one einsum. The
merged projected output [B, S, H, v] is then laid out as the projection's output was, and
the projection's users read it. An attention sink folded in after the merge (`fold_sink`)
scales each head's row by one number, so it commutes with the projection as well: it is
folded into the merged projected output (the exchange then returns its LSE too).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, fx_util
from dcp_pass.rewrites.axes import B, F, H, S
from dcp_pass.rewrites.fx_util import call, erase_dead_region, method
from dcp_pass.runtime.decode.merge import fold_sink

V = "V"  # the projection's own feature axis (v_head_dim)
CANON = (B, S, H, F)
CANON_OUT = (B, S, H, V)

# weight dtypes the compile-time gather moves for head-sharded models (unquantized floats)
GATHERABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# the canonical einsum letters of the moved projection
_LETTER = {B: "b", S: "s", H: "h", F: "f", V: "v"}

Axis = tuple  # the canonical roles one axis holds, outermost first: (B, S) after flatten(0, 1)

_RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze}
_NO_OPS = {"contiguous", "clone"}
_CASTS = {"float", "double", "half", "bfloat16", "to", "type", "type_as"}


class NotProjected(Exception):
    """The merged output's use is not a per-head linear projection this pass can move."""


@dataclass
class ValueProjection:
    """A per-head linear projection of the merged output, found by `find_projection`."""

    node: fx.Node  # the contraction
    weight: fx.Node  # its weight operand
    equation: str  # the same contraction on the canonical [B, S, H, F] output: 'bshf,<w>->bshv'
    out_roles: list[Axis]  # the roles each axis of the contraction's output holds
    v_dim: Any  # the width it projects to
    chain: list[fx.Node]  # the layout-only ops from the merged output to the contraction
    region: set[fx.Node]  # the nodes that compute the weight
    params: list[fx.Node]  # the parameters the weight is computed from, sorted by name


def _sizes(shape: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(CANON, shape))


def _unit(role: str, sizes: dict[str, Any]) -> bool:
    return axes.known_equal(sizes[role], 1)


def _roles_text(axis: Axis) -> str:
    names = {B: "batch", S: "query position", H: "head", F: "latent", V: "value"}
    return " x ".join(names[r] for r in axis) or "size-1"


def _op_text(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "output":
        return "the graph's output"
    return getattr(node.target, "__name__", str(node.target))


# ----------------------------------------------------------------------------- layout ops


def _reshaped(roles: list[Axis], shape: Sequence[Any], sizes: dict[str, Any]) -> Optional[list[Axis]]:
    """Roles after a reshape to `shape` that keeps the order of elements, or None when it
    splits an axis other than into the roles it holds. Size-1 roles may go anywhere (they
    do not move data): they are dropped, and a new size-1 axis holds no role."""
    seq = [r for axis in roles for r in axis if not _unit(r, sizes)]
    out: list[Axis] = []
    i = 0
    for size in shape:
        if axes.known_equal(size, 1):
            out.append(())
            continue
        group: list[str] = []
        product: Any = 1
        while i < len(seq):
            group.append(seq[i])
            product = product * sizes[seq[i]]
            i += 1
            if axes.known_equal(product, size):
                break
        else:
            return None
        out.append(tuple(group))
    return out if i == len(seq) else None


def layout_step(node: fx.Node, src: fx.Node, roles: list[Axis], sizes: dict[str, Any]) -> Optional[list[Axis]]:
    """The roles of `node`'s axes when it is a layout-only op of `src` (roles `roles`), else None."""
    if node.op not in ("call_method", "call_function") or not node.args or node.args[0] is not src:
        return None
    rest = list(node.args[1:]) + list(node.kwargs.values())
    others: list[fx.Node] = []
    fx.node.map_arg(rest, others.append)
    if src in others:  # e.g. x.expand_as(x): not a layout op of x alone
        return None
    target = node.target
    if node.op == "call_method" and target in _NO_OPS:
        return list(roles)
    if axes.is_dtype_cast(node) or (node.op == "call_method" and target in _CASTS):
        raise NotProjected(f"a dtype cast ({_op_text(node)}) sits between the merge and the projection")
    if any(isinstance(a, torch.dtype) for a in rest):
        raise NotProjected(f"a dtype view ({_op_text(node)}) sits between the merge and the projection")
    dims = _flatten_dims(node, len(roles))
    if dims is not None:  # the merged axis keeps its size-1 roles: flatten(0, 1) of [B, 1, ...] holds (B, S)
        start, end = dims
        return roles[:start] + [sum(roles[start : end + 1], ())] + roles[end + 1 :]
    if (node.op == "call_method" and target in _RESHAPE_METHODS) or (
        node.op == "call_function" and target in _RESHAPE_FUNCTIONS
    ):
        shape = axes.shape_of(node)
        out = _reshaped(roles, shape, sizes) if shape is not None else None
        if out is None:
            raise NotProjected(f"a reshape ({_op_text(node)}) splits an axis of the merged output across its roles")
        return out
    order = _axis_order(node, len(roles))
    return None if order is None else [roles[o] for o in order]


def _flatten_dims(node: fx.Node, rank: int) -> Optional[tuple[int, int]]:
    """(start, end) of `x.flatten(start, end)` / `torch.flatten(x, start, end)`, normalized."""
    if not (axes.is_method(node, "flatten") or axes.is_function(node, torch.flatten)):
        return None
    start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    return axes.normalize_dim(start, rank), axes.normalize_dim(end, rank)


def _axis_order(node: fx.Node, rank: int) -> Optional[list[int]]:
    """For permute / transpose / .t() / .mT: the input axis of each output axis. From the
    arguments alone: the pass's own permute of the merged output has no traced shape."""
    if axes.is_method(node, "permute") or axes.is_function(node, torch.permute):
        dims = node.args[1:] if node.op == "call_method" else node.args[1:2]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        if sorted(axes.normalize_dim(d, rank) for d in dims) != list(range(rank)):
            return None
        return [axes.normalize_dim(d, rank) for d in dims]
    swap = None
    if axes.is_method(node, "transpose", "swapaxes") or axes.is_function(node, torch.transpose, torch.swapaxes):
        swap = node.args[1:3] if len(node.args) >= 3 else None
    elif (axes.is_method(node, "t") and rank == 2) or axes.is_method(node, "mT"):
        swap = (rank - 2, rank - 1)
    if swap is None or not all(isinstance(d, int) for d in swap):
        return None
    order = list(range(rank))
    d0, d1 = (axes.normalize_dim(d, rank) for d in swap)
    order[d0], order[d1] = order[d1], order[d0]
    return order


# ----------------------------------------------------------------------------- the weight


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target)


def weight_region(weight: fx.Node, is_parameter: Callable[[fx.Node], bool]) -> tuple[set[fx.Node], list[fx.Node]]:
    """(the nodes computing `weight`, its parameters sorted by name); NotProjected when it is
    computed from anything but module parameters and constants, or in place."""
    region: set[fx.Node] = set()
    stack = [weight]
    while stack:
        node = stack.pop()
        if node in region:
            continue
        region.add(node)
        if node.op == "placeholder":
            if not is_parameter(node):
                from dcp_pass.rewrites.match import buffer_source, module_path

                raise NotProjected(
                    f"the projection weight is computed from {module_path(buffer_source(node))}, "
                    f"not only from module parameters"
                )
            continue
        if node.op == "get_attr":
            continue
        if node.op not in ("call_function", "call_method") or fx_util.mutates_input(node) or _is_collective(node):
            raise NotProjected(f"the projection weight is computed with {_op_text(node)}")
        stack.extend(node.all_input_nodes)
    graph = weight.graph
    for node in graph.nodes:  # an in-place write into the weight's expression (a mutated parameter)
        if node.op in ("call_function", "call_method") and fx_util.mutates_input(node) and node.args[0] in region:
            raise NotProjected(f"the projection weight is overwritten in place ({_op_text(node)})")
    params = sorted((n for n in region if n.op == "placeholder"), key=lambda n: n.name)
    if not params:
        raise NotProjected("the projection weight is not a module parameter")
    return region, params


def check_gatherable(params: Sequence[fx.Node], dtype_of: Callable[[fx.Node], torch.dtype]) -> None:
    """The compile-time gather moves unquantized float weights only."""
    for param in params:
        dtype = dtype_of(param)
        if dtype not in GATHERABLE_DTYPES:
            from dcp_pass.rewrites.match import buffer_source, module_path

            names = "/".join(str(d).replace("torch.", "") for d in GATHERABLE_DTYPES)
            raise NotProjected(
                f"the projection weight {module_path(buffer_source(param))} is "
                f"{str(dtype).replace('torch.', '')}; the weight gather takes {names} only"
            )


# ----------------------------------------------------------------------------- finding


def find_projection(start: fx.Node, shape: Sequence[Any], is_parameter: Callable[[fx.Node], bool]) -> ValueProjection:
    """The per-head linear projection that `start` (the merged output, [B, S, H, F] of sizes
    `shape`) feeds through layout-only ops; NotProjected says why there is none."""
    sizes = _sizes(shape)
    roles: list[Axis] = [(r,) for r in CANON]
    chain: list[fx.Node] = []
    node = start
    while True:
        users = list(node.users)
        if len(users) != 1:
            if not users:
                raise NotProjected("the merged output is not used")
            uses = ", ".join(_op_text(u) for u in users)
            raise NotProjected(f"the merged output has another use ({uses})")
        user = users[0]
        if user.op == "output":
            raise NotProjected("the merged output leaves the graph unprojected")
        contraction = axes.as_contraction(user)
        if contraction is not None:
            break
        step = layout_step(user, node, roles, sizes)
        if step is None:
            raise NotProjected(f"the merged output's use ({_op_text(user)}) is not a per-head linear projection")
        chain.append(user)
        node, roles = user, step
    return _projection(contraction, node, roles, sizes, chain, is_parameter)


def _projection(
    con: axes.Contraction,
    src: fx.Node,
    roles: list[Axis],
    sizes: dict[str, Any],
    chain: list[fx.Node],
    is_parameter: Callable[[fx.Node], bool],
) -> ValueProjection:
    if con.lhs is src and con.rhs is src:
        raise NotProjected("the projection multiplies the attention output by itself")
    if src not in (con.lhs, con.rhs):
        raise NotProjected(f"the merged output enters {_op_text(con.node)} other than as an operand")
    att = con.operand_labels(src)
    weight = con.other(src)
    w_labels = con.operand_labels(weight)
    out = con.out_labels
    if len(set(att)) != len(att) or len(set(w_labels)) != len(w_labels):
        raise NotProjected("the projection repeats an einsum label (a diagonal)")
    latent = [i for i, axis in enumerate(roles) if F in axis]
    if len(latent) != 1 or roles[latent[0]] != (F,):
        raise NotProjected("the latent axis is reshaped together with other axes before the projection")
    l_f = att[latent[0]]
    if l_f in out or l_f not in w_labels:
        raise NotProjected(f"{_op_text(con.node)} does not contract the latent axis with its other operand")
    heads = [i for i, axis in enumerate(roles) if H in axis]
    if not heads:
        raise NotProjected("the head axis is reshaped away before the projection")
    if roles[heads[0]] != (H,):
        raise NotProjected("the head axis is merged with other axes before the projection")
    l_h = att[heads[0]]
    if l_h not in out:
        raise NotProjected(f"{_op_text(con.node)} sums over the heads")
    if l_h in w_labels:
        w_heads = axes.shape_of(weight)[w_labels.index(l_h)]
        if not axes.known_equal(w_heads, sizes[H]):
            raise NotProjected("the projection weight broadcasts over the heads")
    for i, label in enumerate(att):
        if i in (latent[0], heads[0]):
            continue
        if label not in out:
            raise NotProjected(f"{_op_text(con.node)} sums over the {_roles_text(roles[i])} axis")
        if label in w_labels:
            raise NotProjected(f"the projection weight varies along the {_roles_text(roles[i])} axis")
    own = [label for label in w_labels if label not in att]
    if any(label not in out for label in own):
        raise NotProjected("the projection sums an axis of the weight alone")
    if len(own) != 1:
        raise NotProjected(f"the projection adds {len(own)} axes of the weight; one (v_head_dim) is expected")
    l_v = own[0]
    region, params = weight_region(weight, is_parameter)
    letters = {l_h: _LETTER[H], l_f: _LETTER[F], l_v: _LETTER[V]}
    equation = f"bshf,{''.join(letters[label] for label in w_labels)}->bshv"
    out_roles = [roles[att.index(label)] if label in att else (V,) for label in out]
    v_dim = axes.shape_of(weight)[w_labels.index(l_v)]
    return ValueProjection(con.node, weight, equation, out_roles, v_dim, chain, region, params)


# ----------------------------------------------------------------------------- emitting


def weight_for_rank(
    graph: fx.Graph, projection: ValueProjection, sharded: Sequence[fx.Node], shard_input: Callable[[fx.Node], fx.Node]
) -> fx.Node:
    """The weight expression recomputed from another rank's shards of `sharded` (each
    `shard_input(param)`), before the projection; the other nodes are shared."""
    env: dict[fx.Node, fx.Node] = {p: shard_input(p) for p in sharded}
    tainted = set(sharded)
    with graph.inserting_before(projection.node):
        for node in list(graph.nodes):  # topological: tainted when an input is
            if (
                node in projection.region
                and node.op != "placeholder"
                and any(i in tainted for i in node.all_input_nodes)
            ):
                tainted.add(node)
                env[node] = graph.node_copy(node, lambda n: env.get(n, n))
    return env.get(projection.weight, projection.weight)


def _laid_out(graph: fx.Graph, node: fx.Node, out_roles: list[Axis]) -> fx.Node:
    """[B, S, H, V] `node` laid out with the axes `out_roles` (squeeze, permute, flatten, unsqueeze)."""
    present = [r for axis in out_roles for r in axis]
    kept = list(CANON_OUT)
    for i in reversed(range(len(CANON_OUT))):  # roles the output dropped have size 1
        if CANON_OUT[i] not in present:
            node = method(graph, "squeeze", node, i)
            kept.pop(i)
    perm = [kept.index(r) for r in present]
    if perm != list(range(len(perm))):
        node = method(graph, "permute", node, *perm)
    position = 0
    for axis in out_roles:
        if not axis:
            node = method(graph, "unsqueeze", node, position)
        elif len(axis) > 1:
            node = method(graph, "flatten", node, position, position + len(axis) - 1)
        position += 1
    return node


def check_operand_dtypes(in_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """The moved contraction joins the attention output and the weight as the model's did:
    torch's contractions take operands of one dtype, so they must agree."""
    if in_dtype != weight_dtype:
        raise NotProjected(
            f"the projection multiplies a {str(in_dtype).replace('torch.', '')} attention output "
            f"by a {str(weight_dtype).replace('torch.', '')} weight"
        )


def emit_projection(
    graph: fx.Graph,
    exchange: fx.Node,
    projection: ValueProjection,
    weights: Sequence[fx.Node],
    in_dtype: torch.dtype,
    partial_dtype: Optional[torch.dtype],
    out_dtype: torch.dtype,
) -> fx.Node:
    """Project the partial output before `exchange` and merge the projected partials.

    `weights`: one per DCP rank in rank order (head-sharded: head chunk r is projected by
    weights[r]), or one for all heads. `in_dtype`: the dtype of the attention output the
    model's projection read (the weight's); `partial_dtype`: the local attention's output
    dtype (the query's, None when unknown). A partial of another dtype (fp32 queries and
    softmax, bf16 weights: DeepSeek-V3.2's decode) is cast to `in_dtype` first, as the
    model's merged output was. Returns the node the projection's users now read.
    """
    sink = exchange if exchange.target is fold_sink else None
    if sink is not None:  # fold_sink(getitem(exchange(..., return_lse=True), 0), merged LSE, sink logits, ...)
        exchange = sink.args[0].args[0]
    partial, lse = exchange.args[0], exchange.args[1]
    with graph.inserting_before(projection.node):
        if partial_dtype != in_dtype:
            partial = method(graph, "to", partial, in_dtype, name="partial_cast")
        if len(weights) > 1:
            heads = method(graph, "chunk", partial, len(weights), 2, name="partial_heads")
            parts = []
            for r, weight in enumerate(weights):
                chunk = call(graph, operator.getitem, heads, r, name=f"partial_heads_{r}")
                parts.append(call(graph, torch.einsum, projection.equation, chunk, weight, name=f"partial_proj_{r}"))
            projected = call(graph, torch.cat, parts, 2, name="partial_proj")
        else:
            projected = call(graph, torch.einsum, projection.equation, partial, weights[0], name="partial_proj")
        kwargs = dict(exchange.kwargs, out_dtype=out_dtype if sink is None else torch.float32)
        merged = graph.create_node(
            "call_function", exchange.target, (projected, lse) + tuple(exchange.args[2:]), kwargs, name="merged_proj"
        )
        if sink is not None:  # the sink rescales each head's row: it commutes with the projection
            merged = call(
                graph,
                fold_sink,
                call(graph, operator.getitem, merged, 0, name="merged_proj_out"),
                call(graph, operator.getitem, merged, 1, name="merged_proj_lse"),
                *sink.args[2:4],
                out_dtype,
                name="merged_proj_sink",
            )
        result = _laid_out(graph, merged, projection.out_roles)
    projection.node.replace_all_uses_with(result)
    erase_dead_region(graph, [projection.node])
    return result
