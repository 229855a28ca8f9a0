"""Softmax-spelled MLA: scores from einsum / matmul contractions, `softmax`, a value contraction.

    scores = (einsum(q_nope, kv[:b, :end]) + einsum(q_pe, pe[:b, :end])) * scale + mask
    o = einsum(softmax(scores, -1), kv[:b, :end])

The softmax input is parsed as `scale * sum(q_i . k_i) + masks`: the contractions may be
einsums or matmuls in any axis layout (`axes.py`), the keys any view chain of one or
several cache tensors (`cache_reads.py`: fused latent||rotary caches, a singleton kv-head
axis broadcast over the query heads, keys concatenated from two caches), the scale a
constant multiplied or divided in before or after an additive or `masked_fill` mask.
The probabilities feed one contraction with the leading latent columns of the cache. A sink
column concatenated to the scores (and dropped from the probabilities) becomes the match's
`SinkTerm`, and a row-max subtraction before the softmax is read through (`rewrites/sinks.py`).

A softmax whose input touches no cache is not attention over a cache (an MoE gate, or
attention over per-head K/V computed in the graph); the latter is said once in the report.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, sinks
from dcp_pass.rewrites.axes import B, F, H, S, T
from dcp_pass.rewrites.cache_reads import CacheRead, ReadRefused, is_cache_tensor, trace_cache_read
from dcp_pass.rewrites.match import (
    MaskTerm,
    MatchContext,
    MlaMatch,
    NearMiss,
    NotAttention,
    Recogniser,
    ScoreTerm,
    SinkTerm,
    buffer_name,
    register,
)


def softmax_dim(node: fx.Node) -> Optional[Any]:
    if axes.is_method(node, "softmax") or axes.is_function(
        node, torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax
    ):
        return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    return None


def is_softmax(node: fx.Node) -> bool:
    return softmax_dim(node) is not None


ADDS = {operator.add, operator.iadd, torch.add}
MULS = {operator.mul, operator.imul, torch.mul}
DIVS = {operator.truediv, operator.itruediv, torch.div}
MASK_FILL_FLOOR = -1e4  # a fill at or below this is -inf after exp() in fp32: same as an additive -inf


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _binary(node: fx.Node) -> Optional[tuple[str, Any, Any]]:
    if node.op == "call_function":
        kind = (
            "add" if node.target in ADDS else "mul" if node.target in MULS else "div" if node.target in DIVS else None
        )
    elif node.op == "call_method":
        kind = {
            "add": "add",
            "add_": "add",
            "__add__": "add",
            "__iadd__": "add",
            "mul": "mul",
            "mul_": "mul",
            "__mul__": "mul",
            "div": "div",
            "div_": "div",
            "__truediv__": "div",
        }.get(node.target)
    else:
        kind = None
    if kind is None or len(node.args) != 2 or set(node.kwargs) - {"out"}:
        return None
    return kind, node.args[0], node.args[1]


class ScoreParser:
    """Decomposes a softmax input into sum_i mult_i * contraction_i + sum_j mult_j * mask_j."""

    def __init__(self, depends_on_cache):
        self.depends_on_cache = depends_on_cache
        self.terms: list[tuple[axes.Contraction, float]] = []
        self.masks: list[tuple[fx.Node, str, float]] = []
        # cache-dependent addends that are not score terms: masks, if they turn out not to
        # depend on the caches the scores read (a sparse-attention index mask computed from
        # the indexer's own key cache); else the near miss they would be
        self.maybe_masks: list[tuple[fx.Node, float, NearMiss]] = []

    def parse(self, node: Any, mult: float, split: Optional[tuple[list[int], fx.Node]] = None) -> None:
        """`split` = (candidate axes, view node) under a view that splits (seq*heads) back apart."""
        if not isinstance(node, fx.Node):
            raise NearMiss(f"a constant ({node!r}) is added to the attention scores")
        if not self.depends_on_cache(node):
            if split is not None:
                raise NearMiss("a mask is added to flattened scores", node)
            self.masks.append((node, "additive", mult))
            return
        contraction = axes.as_contraction(node)
        if contraction is not None:
            if split is not None:
                candidates = [axes.unflatten_contraction(contraction, a, split[1]) for a in split[0]]
                candidates = [c for c in candidates if c is not None]
                contraction = candidates[0] if len(candidates) == 1 else None
                if contraction is None:
                    raise NearMiss("a score contraction of flattened operands cannot be unflattened", node)
            self.terms.append((contraction, mult))
            return
        if split is None and axes.is_method(node, "view", "reshape") and isinstance(node.args[0], fx.Node):
            candidates = axes.split_axes(node, node.args[0])
            if candidates:
                self.parse(node.args[0], mult, (candidates, node))
                return
        if axes.is_dtype_cast(node):
            self.parse(node.args[0], mult, split)
            return
        if axes.is_method(node, "masked_fill", "masked_fill_") or axes.is_function(node, torch.masked_fill):
            fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
            # the fill as the softmax sees it, after the scales applied to it later
            if not _is_number(fill) or fill > MASK_FILL_FLOOR or fill * mult > MASK_FILL_FLOOR:
                raise NearMiss(
                    f"masked_fill with value {fill!r} on the attention scores"
                    + (f", scaled by {mult!r} before the softmax" if _is_number(fill) and mult != 1.0 else "")
                    + " (only -inf-like fills are exact)",
                    node,
                )
            self.parse(node.args[0], mult)
            self.masks.append((node.args[1], "bool", 1.0))
            return
        binary = _binary(node)
        if binary is None:
            if split is None:
                self.maybe_masks.append(
                    (
                        node,
                        mult,
                        NearMiss(
                            f"`{_op(node)}` between the score contractions and the softmax (only sums, constant scales "
                            f"and masks are understood)",
                            node,
                        ),
                    )
                )
                return
            raise NearMiss(
                f"`{_op(node)}` between the score contractions and the softmax (only sums, constant "
                f"scales and masks are understood)",
                node,
            )
        kind, a, b = binary
        if kind == "add":
            self.parse(a, mult, split)
            self.parse(b, mult, split)
        elif kind == "mul" and _is_number(b):
            self.parse(a, mult * b, split)
        elif kind == "mul" and _is_number(a):
            self.parse(b, mult * a, split)
        elif kind == "div" and _is_number(b):
            self.parse(a, mult / b, split)
        else:
            raise NearMiss("the attention scores are scaled by a tensor; only constant scales are supported", node)


def _op(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def assign_query_roles(
    query: fx.Node, labels: list[str], label_role: dict[str, str], query_len: Optional[Any]
) -> list[str]:
    """Roles of the query axes: B and F come from the cache labels, S vs H from sizes or layout."""
    roles: list[Optional[str]] = [label_role.get(label) for label in labels]
    unknown = [i for i, r in enumerate(roles) if r is None]
    if len(unknown) != 2 or sorted(r for r in roles if r) != [B, F]:
        raise NearMiss("the query does not have one batch, query-position, head and feature axis", query)
    shape = axes.shape_of(query)
    x, y = unknown
    x_is_seq = None
    if query_len is not None:
        x_len, y_len = axes.known_equal(shape[x], query_len), axes.known_equal(shape[y], query_len)
        if x_len != y_len:
            x_is_seq = x_len
    if x_is_seq is None:
        # Sizes cannot tell (e.g. seq == heads): the axis that comes first in the tensor
        # the query was laid out in ([b, s, h, d] in DeepSeek-style models) is the sequence.
        _, origin = axes.trace_to_base(query)
        ox, oy = origin[x], origin[y]
        x_is_seq = True if ox is None or oy is None else ox < oy
    roles[x], roles[y] = (S, H) if x_is_seq else (H, S)
    return roles  # type: ignore[return-value]


def _reads_a_cache(contraction: axes.Contraction) -> bool:
    for operand in (contraction.lhs, contraction.rhs):
        try:
            trace_cache_read(operand)
            return True
        except ReadRefused:
            continue
    return False


def _cache_side(contraction: axes.Contraction) -> tuple[fx.Node, list[CacheRead]]:
    found = []
    for operand in (contraction.lhs, contraction.rhs):
        try:
            found.append((operand, trace_cache_read(operand)))
        except ReadRefused:
            continue
    if len(found) != 1:
        raise NearMiss("a score contraction does not multiply a query with exactly one cache read", contraction.node)
    return found[0]


def _score_terms_of(contraction: axes.Contraction, ctx: MatchContext) -> tuple[list[ScoreTerm], dict[str, str]]:
    """The score terms of one contraction (one per cache piece of its key operand) and the
    roles its labels carry."""
    node = contraction.node
    cache_operand, reads = _cache_side(contraction)
    labels = contraction.operand_labels(cache_operand)
    label_role = {label: role for label, role in zip(labels, reads[0].roles) if role is not None}
    if set(label_role.values()) != {B, T, F}:
        raise NearMiss("a cache read in the scores lost its batch, position or feature axis", node)
    role_label = {role: label for label, role in label_role.items()}
    if role_label[F] in contraction.out_labels or role_label[T] not in contraction.out_labels:
        raise NearMiss("a score contraction does not contract the cache's features into key positions", node)
    query = contraction.other(cache_operand)
    q_roles = assign_query_roles(
        query, contraction.operand_labels(query), label_role, ctx.query_len_of(reads[0].buffer)
    )
    terms = [ScoreTerm(query, q_roles, read, read.cols) for read in reads]
    known = dict(zip(contraction.operand_labels(query), q_roles))
    known.update(label_role)
    return terms, known


def _mask_roles(mask: fx.Node, score_roles: list[str]) -> list[Optional[str]]:
    shape = axes.shape_of(mask)
    if shape is None or len(shape) > len(score_roles):
        raise NearMiss("a mask does not broadcast against the scores", mask)
    return score_roles[len(score_roles) - len(shape) :]


def _flattened_value_contraction(probs: fx.Node, flat: fx.Node) -> Optional[axes.Contraction]:
    """`matmul(probs.flatten(1, 2), values).view(b, s, h, d)` as one contraction on probs."""
    source = axes.flatten_source(flat)
    if source is None or source[0] is not probs or len(flat.users) != 1:
        return None
    mm = next(iter(flat.users))
    contraction = axes.as_contraction(mm)
    if contraction is None or len(mm.users) != 1:
        return None
    view = next(iter(mm.users))
    found = [axes.unflatten_contraction(contraction, a, view) for a in axes.split_axes(view, mm)]
    found = [c for c in found if c is not None]
    return found[0] if len(found) == 1 else None


def _value_contraction(softmax: fx.Node, sink_side: Optional[str] = None) -> tuple[fx.Node, fx.Node, axes.Contraction]:
    """softmax -> (the sink's column dropped) -> casts -> value contraction: (probabilities
    after casts, value node, its contraction)."""
    probs = softmax
    if sink_side is not None:
        probs = sinks.sink_column_dropped(probs, sink_side)
    while len(probs.users) == 1 and axes.is_dtype_cast(next(iter(probs.users))):
        probs = next(iter(probs.users))
    if len(probs.users) != 1:
        raise NearMiss("attention probabilities are used outside the value product")
    value_node = next(iter(probs.users))
    value = axes.as_contraction(value_node)
    if value is None:
        value = _flattened_value_contraction(probs, value_node)
    if value is None or (value.lhs is not probs and value.rhs is not probs):
        raise NearMiss(
            f"the attention probabilities feed `{_op(value_node)}`, not a product with the values", value_node
        )
    return probs, value_node, value


def _value_read(probs: fx.Node, value: axes.Contraction, score_roles: list[str]) -> tuple[CacheRead, list[str]]:
    """The values' cache read and the output roles of the value contraction."""
    operand = value.other(probs)
    try:
        reads = trace_cache_read(operand)
    except ReadRefused as why:
        raise NearMiss(f"the values are not a cache read ({why})", operand) from None
    if len(reads) != 1:
        raise NearMiss("the values are concatenated from several caches", operand)
    read = reads[0]
    known = {label: role for label, role in zip(value.operand_labels(probs), score_roles)}
    for label, role in zip(value.operand_labels(operand), read.roles):
        if role is not None:
            if role in (B, T) and known.get(label) != role:
                raise NearMiss(
                    "the value product does not pair the batch and key axes of scores and values", value.node
                )
            known[label] = role
    out_roles = [known.get(label) for label in value.out_labels]
    if sorted(map(str, out_roles)) != sorted([B, S, H, F]):
        raise NearMiss(
            "the value product's output is not [batch, query position, head, feature] in some order", value.node
        )
    return read, out_roles


def check_value_read(terms: list[ScoreTerm], value: CacheRead) -> int:
    """The values must be the leading latent columns over the scores' rows; returns their width."""
    latent = [
        t for t in terms if t.cache.buffer is value.buffer and (t.cache.feat or (0,))[0] == (value.feat or (0,))[0]
    ]
    if not latent:
        raise NearMiss("the values are not the leading columns of the latent cache the scores read", value.node)
    for term in terms:
        same_rows = (
            (axes.known_equal(term.cache.bsz, value.bsz) or term.cache.bsz is value.bsz)
            and (axes.known_equal(term.cache.row0, value.row0) or term.cache.row0 is value.row0)
            and (axes.known_equal(term.cache.end, value.end) or term.cache.end is value.end)
            and (axes.known_equal(term.cache.start, value.start) or term.cache.start is value.start)
        )
        if not same_rows:
            raise NearMiss("the scores and the values read different rows or positions of the cache", value.node)
    return value.width


def check_terms(terms: list[ScoreTerm], where: fx.Node) -> None:
    if len(terms) > 2:
        raise NearMiss(f"{len(terms)} score terms; expected latent (+ rotary)", where)
    if (
        len(terms) == 2
        and terms[0].cache.buffer is terms[1].cache.buffer
        and terms[0].cache.feat == terms[1].cache.feat
    ):
        raise NearMiss("both score terms read the same cache columns", where)


def _attention_shaped(softmax: fx.Node) -> bool:
    """A softmax of a product of two tensors whose probabilities feed another product
    (attention), as opposed to a gate's softmax over a linear layer's output."""
    node = softmax.args[0]
    for _ in range(8):
        if axes.as_contraction(node) is not None:
            break
        binary = _binary(node) if isinstance(node, fx.Node) else None
        if isinstance(node, fx.Node) and axes.is_dtype_cast(node):
            node = node.args[0]
        elif binary is not None and binary[0] in ("add", "mul", "div") and isinstance(binary[1], fx.Node):
            node = binary[1]
        else:
            return False
    else:
        return False
    try:
        _value_contraction(softmax)
    except NearMiss:
        return False
    return True


_SCORE_WALK_LIMIT = 512  # nodes visited before the question is left undecided
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
# ops through which the walk below follows every operand: elementwise functions (a norm's rsqrt,
# a gate's sigmoid) and joins of tensors (pooling weights concatenated from a state's halves)
_WALKED_FUNCTIONS = {
    torch.rsqrt,
    torch.sqrt,
    torch.exp,
    torch.log,
    torch.sigmoid,
    torch.tanh,
    torch.relu,
    torch.abs,
    torch.neg,
    torch.square,
    torch.clamp,
    torch.where,
    torch.topk,  # a router's top-k logits (gpt-oss): a selection of the scores, walked to them
    torch.sub,
    operator.sub,
    operator.neg,
    torch.cat,
    torch.stack,
    torch.unflatten,
    torch.flatten,
    torch.reshape,
    torch.nn.functional.relu,
    torch.nn.functional.silu,
    torch.nn.functional.softplus,
}


def _reaches_cache_directly(node: fx.Node, seen: set) -> bool:
    """Whether `node` is computed from a cache tensor along some path that crosses no
    contraction and no softmax (key rows, or per-head keys projected from them by a linear)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if len(seen) > _SCORE_WALK_LIMIT:
            return True  # undecided: count it as a cache read (the recogniser then says why not)
        if is_cache_tensor(n):
            return True
        if axes.as_contraction(n) is not None or is_softmax(n) or _is_attention_call(n):
            continue
        stack.extend(n.all_input_nodes)
    return False


def _is_attention_call(node: fx.Node) -> bool:
    """SDPA or flex_attention: another attention's output, like a product or a softmax."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return "scaled_dot_product_attention" in name or "flex_attention" in name


_STATISTICS = {torch.mean, torch.sum, torch.var, torch.linalg.vector_norm, torch.norm}


def _is_norm_statistic(node: fx.Node) -> bool:
    """A reduction that keeps its axis (`x.square().mean(-1, keepdim=True)`): a norm's statistic
    of hidden states, which scales rows and holds no keys."""
    if not (
        axes.is_method(node, "mean", "sum", "var", "norm")
        or (node.op == "call_function" and node.target in _STATISTICS)
    ):
        return False
    return node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False) is True


def reads_no_cache_rows(scores: fx.Node) -> bool:
    """True when the scores certainly contract no cache rows: every product reached from them
    through the ops scores are built with (sums, scales, casts, masks, views) has no operand
    that comes from a cache without crossing another product or softmax (attention contracts
    queries with keys). An MoE router (`linear(hidden)`), Sinkhorn normalisation of a small
    mixing matrix, and pooling weights over a state's slots (a state read with no product)
    are such softmaxes: downstream of attention layers, but not attention. The walk stops at
    graph inputs, linear projections and norm statistics (what scales hidden states is not
    a key)."""
    products, seen, stack = [], set(), [scores]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if len(seen) > _SCORE_WALK_LIMIT:
            return False
        if axes.as_contraction(n) is not None:
            products.append(n)
        elif (
            n.op == "placeholder"
            or (n.op == "call_function" and n.target in _LINEAR)
            or _is_norm_statistic(n)
            or isinstance(axes.example_value(n), (int, torch.SymInt))
        ):  # sizes: symbolic ints, not keys
            continue  # a graph input, a projection of hidden states (a router's logits), a norm's statistic
        elif (
            _binary(n) is not None
            or axes.is_dtype_cast(n)
            or axes.is_method(n, "masked_fill", "masked_fill_")
            or n.op == "call_method"
            or (n.op == "call_function" and n.target is operator.getitem)
            or (n.op == "call_function" and n.target in _WALKED_FUNCTIONS)
        ):
            stack.extend(n.all_input_nodes)
        else:
            return False  # an op the walk does not know: undecided
    walked: set = set()
    for product in products:
        contraction = axes.as_contraction(product)
        if any(_reaches_cache_directly(o, walked) for o in (contraction.lhs, contraction.rhs)):
            return False
    return True


class SoftmaxRecogniser(Recogniser):
    name = "softmax"

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if is_softmax(n)]

    def match(self, softmax: fx.Node, ctx: MatchContext) -> MlaMatch:
        scores = softmax.args[0]
        if not isinstance(scores, fx.Node):
            raise NotAttention()
        if not ctx.depends_on_cache(scores):
            if _attention_shaped(softmax):
                raise NotAttention(
                    "attention over keys and values computed in the graph, not read from a cache "
                    "(MHA/GQA over per-head K/V): not MLA decode, left unchanged"
                )
            raise NotAttention()
        if reads_no_cache_rows(scores):  # computed after attention layers, but not attention itself
            raise NotAttention()
        rank = len(axes.shape_of(scores) or ())
        dim = softmax_dim(softmax)
        if not isinstance(dim, int) or axes.normalize_dim(dim, rank) != rank - 1:
            raise NearMiss(
                f"the softmax runs over dim {dim} of rank-{rank} scores; only the last (key) axis is supported"
            )
        parser = ScoreParser(ctx.depends_on_cache)
        inner, sink, sink_side = sinks.split_sink(sinks.peel_row_max(scores), ctx.depends_on_cache)
        parser.parse(inner, 1.0)
        if not parser.terms or not any(_reads_a_cache(c) for c, _ in parser.terms):
            if _attention_shaped(softmax):
                raise NotAttention(
                    "attention over keys and values computed in the graph, not read from a cache "
                    "(MHA/GQA over per-head K/V): not MLA decode, left unchanged"
                )
            raise NotAttention()
        mults = {m for _, m in parser.terms}
        if len(mults) != 1:
            raise NearMiss(f"the score terms are scaled differently ({sorted(mults)})")
        scale = mults.pop()
        terms: list[ScoreTerm] = []
        layouts = []
        for contraction, _ in parser.terms:
            found, known = _score_terms_of(contraction, ctx)
            terms.extend(found)
            layouts.append([known.get(label) for label in contraction.out_labels])
        check_terms(terms, softmax)
        read_buffers = {t.cache.buffer for t in terms}
        for node, mult, miss in parser.maybe_masks:
            if ctx.cache_tensors_under(node) & read_buffers:
                raise miss
            parser.masks.append((node, "additive", mult))
        score_roles = layouts[0]
        if any(layout != score_roles for layout in layouts) or sorted(map(str, score_roles)) != sorted([B, S, H, T]):
            raise NearMiss("the score terms are not laid out as one [batch, query position, head, key] tensor")
        if score_roles[-1] != T:  # the softmax normalises the last axis: it must be the keys'
            raise NearMiss(
                f"the softmax runs over the last axis of scores laid out as "
                f"[{', '.join(map(str, score_roles))}], which is not the key axis"
            )
        probs, value_node, value = _value_contraction(softmax, sink_side)
        value_read, out_roles = _value_read(probs, value, score_roles)
        v_width = check_value_read(terms, value_read)
        masks = []
        for node, kind, mult in parser.masks:
            if mult <= 0:
                raise NearMiss("a mask is multiplied by a non-positive scale", node)
            masks.append(MaskTerm(node, kind, mult, _mask_roles(node, score_roles)))
        out_dtype = axes.example_value(value_node).dtype
        layer = buffer_name(terms[0].cache.buffer).rsplit(".", 1)[0]
        match = MlaMatch(
            layer,
            self.name,
            softmax,
            value.node,
            terms,
            value_read,
            v_width,
            scale,
            masks,
            score_roles,
            out_roles,
            out_dtype,
        )
        if sink is not None:
            match.sink = SinkTerm(sink, sinks.sink_roles(sink, score_roles))
        return match


register(SoftmaxRecogniser())
