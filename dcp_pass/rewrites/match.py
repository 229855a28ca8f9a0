"""Finding absorbed-MLA attention in a torch-level (Dynamo) FX graph.

A match is anchored on a softmax whose scores are contractions of query tensors
with slices of module cache buffers, and whose probabilities are contracted with
a cache slice again (the absorbed value product). The scores may be a sum of two
contractions (latent + rotary caches) or one (a fused latent||rotary cache), scaled
before or after an additive or `masked_fill` mask. Contractions may be einsums or
matmuls in any axis layout (see `axes.py`).

A softmax that never touches a cache buffer is not attention (e.g. an MoE gate) and
is ignored silently; one that touches a cache in a way we cannot rewrite exactly is
a *near miss*, reported with its reason and left unchanged.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, fx_util
from dcp_pass.rewrites.axes import B, F, H, S, T

SizeArg = Union[int, fx.Node]
BUFFER_SOURCE = re.compile(r"_buffers\[")


class NotAttention(Exception):
    """The softmax is not over a cache-backed attention score."""


class NearMiss(Exception):
    """Cache-backed attention that cannot be rewritten safely; the message says why."""


@dataclass
class CacheAccess:
    """`buffer[:bsz, start:end, f0:f1]` on a module cache buffer (read or write)."""

    node: fx.Node
    buffer: fx.Node
    bsz: SizeArg
    start: SizeArg
    end: SizeArg
    feat: Optional[tuple[int, int]]  # absolute feature columns, None = all
    value: Optional[fx.Node] = None  # the written tensor, for writes
    positions: Optional[fx.Node] = None  # a LongTensor of positions, for `buffer[:b, pos] = v`

    def rewrite_write(self, graph: fx.Graph, local: fx.Node, entry) -> fx.Node:
        """Replace this write by a striped write into the shard `local` (`cache.rewrite_write`)."""
        from dcp_pass.rewrites.cache import rewrite_write

        return rewrite_write(graph, self, local, entry)


@dataclass
class ScoreTerm:
    contraction: axes.Contraction
    query: fx.Node
    query_roles: list[str]
    cache: CacheAccess
    cache_label_roles: dict[str, str]  # label -> role of the cache operand's traced axes


@dataclass
class MaskTerm:
    node: fx.Node
    kind: str  # "additive" | "bool"
    multiplier: float
    roles: list[Optional[str]]  # role of each mask axis (right-aligned with the scores)


@dataclass
class MlaMatch:
    layer: str
    softmax: fx.Node
    terms: list[ScoreTerm]
    scale: float
    masks: list[MaskTerm]
    score_roles: list[str]
    value: axes.Contraction
    value_cache: CacheAccess
    out_roles: list[str]
    out_dtype: torch.dtype
    v_dim: int
    writes: list[CacheAccess] = field(default_factory=list)

    @property
    def buffers(self) -> list[fx.Node]:
        seen: list[fx.Node] = []
        for access in [t.cache for t in self.terms] + [self.value_cache]:
            if access.buffer not in seen:
                seen.append(access.buffer)
        return seen

    def rewrite(self, gm: fx.GraphModule, plan, local_nodes: dict[fx.Node, fx.Node],
                query_override: Optional[tuple[fx.Node, Optional[fx.Node]]] = None) -> fx.Node:
        """Replace this attention by shard-local attention + merge (`attention.rewrite_attention`);
        returns the node holding the merged output."""
        from dcp_pass.rewrites.attention import rewrite_attention

        return rewrite_attention(gm, self, plan, local_nodes, query_override)


# ----------------------------------------------------------------------------- buffers


def buffer_source(node: fx.Node) -> Optional[str]:
    """Dynamo's source name of a placeholder (e.g. L['self']._modules['attn']._buffers['kv_cache'])."""
    return fx_util.dynamo_source_name(node)


def is_cache_buffer(node: Any) -> bool:
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return False
    name = buffer_source(node)
    shape = axes.shape_of(node)
    return bool(name and BUFFER_SOURCE.search(name)) and shape is not None and len(shape) == 3


def module_path(source: Optional[str]) -> str:
    """`L['self']._modules['layers']._modules['0']._modules['attn']._buffers['kv_cache']` -> `layers.0.attn.kv_cache`."""
    if not source:
        return "?"
    keys = re.findall(r"\['([^']*)'\]", source)
    return ".".join(k for k in keys if k != "self") or source


def _slice_bounds(index: Any) -> Optional[tuple[SizeArg, SizeArg]]:
    if not isinstance(index, slice) or index.step not in (None, 1):
        return None
    start = 0 if index.start is None else index.start
    return start, index.stop


def _batch_rows(index: Any) -> Optional[SizeArg]:
    """`bsz` for a `:bsz` batch slice, else None."""
    bounds = _slice_bounds(index)
    return bounds[1] if bounds is not None and bounds[0] == 0 else None


def parse_cache_index(buffer: fx.Node, index: Any) -> Optional[tuple[SizeArg, SizeArg, SizeArg, Optional[tuple[int, int]]]]:
    """(bsz, start, end, feat) for `buffer[:bsz, start:end(, f0:f1)]`, else None.

    `buffer[:bsz]` reads every position (static-shape models that mask the unwritten ones).
    """
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if isinstance(index, slice):
        bsz = _batch_rows(index)
        return None if bsz is None else (bsz, 0, axes.shape_of(buffer)[1], None)
    if not isinstance(index, tuple) or len(index) not in (2, 3):
        return None
    bsz = _batch_rows(index[0])
    seq = _slice_bounds(index[1])
    if bsz is None or seq is None or seq[1] is None:
        return None
    feat = None
    if len(index) == 3:
        bounds = _slice_bounds(index[2])
        width = axes.shape_of(buffer)[2]
        if bounds is None or not isinstance(bounds[0], int) or not isinstance(bounds[1] or 0, int):
            return None
        f0, f1 = bounds[0], width if bounds[1] is None else bounds[1]
        f0, f1 = (f0 + width if f0 < 0 else f0), (f1 + width if f1 < 0 else min(f1, width))
        feat = None if (f0, f1) == (0, width) else (f0, f1)
    return bsz, seq[0], seq[1], feat


def as_cache_read(node: fx.Node) -> Optional[CacheAccess]:
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    if is_cache_buffer(node.args[0]):
        parsed = parse_cache_index(node.args[0], node.args[1])
        if parsed is not None and parsed[1] == 0:
            return CacheAccess(node, node.args[0], *parsed)
        return None
    # `read[..., f0:f1]` of a cache read (e.g. the latent columns of a fused cache)
    inner = node.args[0] if isinstance(node.args[0], fx.Node) else None
    base = as_cache_read(inner) if inner is not None else None
    columns = _feature_slice(node.args[1])
    if base is None or columns is None:
        return None
    width = (base.feat[1] - base.feat[0]) if base.feat else axes.shape_of(base.buffer)[2]
    f0, f1 = columns[0], width if columns[1] is None else min(columns[1], width)
    if not (isinstance(f0, int) and isinstance(f1, int)) or f0 < 0 or f1 < 0:
        return None
    offset = base.feat[0] if base.feat else 0
    feat = (offset + f0, offset + f1)
    full = (0, axes.shape_of(base.buffer)[2])
    return CacheAccess(node, base.buffer, base.bsz, base.start, base.end, None if feat == full else feat)


def _feature_slice(index: Any) -> Optional[tuple]:
    """(f0, f1) for `[..., f0:f1]` or `[:, :, f0:f1]`."""
    if not isinstance(index, tuple) or not index:
        return None
    if len(index) == 2 and index[0] is Ellipsis:
        last = index[1]
    elif len(index) == 3 and all(i == slice(None) for i in index[:2]):
        last = index[2]
    else:
        return None
    return _slice_bounds(last)


def as_cache_write(node: fx.Node) -> Optional[CacheAccess]:
    if node.op == "call_function" and node.target is operator.setitem and is_cache_buffer(node.args[0]):
        buffer, index, value = node.args
        if not isinstance(value, fx.Node):
            return None
        parsed = parse_cache_index(buffer, index)
        if parsed is not None:
            return CacheAccess(node, buffer, *parsed, value=value)
        # `buffer[:b, positions] = v` with a position tensor (static-shape decode)
        if isinstance(index, tuple) and len(index) == 2 and isinstance(index[1], fx.Node):
            bsz = _batch_rows(index[0])
            positions = axes.example_value(index[1])
            if (bsz is not None and isinstance(positions, torch.Tensor)
                    and positions.dim() == 1 and not positions.is_floating_point()):
                return CacheAccess(node, buffer, bsz, None, None, None, value=value, positions=index[1])
    return None


def cache_writes(graph: fx.Graph) -> dict[fx.Node, list[CacheAccess]]:
    writes: dict[fx.Node, list[CacheAccess]] = {}
    for node in graph.nodes:
        access = as_cache_write(node)
        if access is not None:
            writes.setdefault(access.buffer, []).append(access)
    return writes


# ----------------------------------------------------------------------------- scores


def _softmax_dim(node: fx.Node) -> Optional[Any]:
    if axes.is_method(node, "softmax") or axes.is_function(
            node, torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax):
        return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    return None


def is_softmax(node: fx.Node) -> bool:
    return _softmax_dim(node) is not None


ADDS = {operator.add, operator.iadd, torch.add}
MULS = {operator.mul, operator.imul, torch.mul}
DIVS = {operator.truediv, operator.itruediv, torch.div}
MASK_FILL_FLOOR = -1e4  # a fill at or below this is -inf after exp() in fp32: same as an additive -inf


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _binary(node: fx.Node) -> Optional[tuple[str, Any, Any]]:
    if node.op == "call_function":
        kind = "add" if node.target in ADDS else "mul" if node.target in MULS else "div" if node.target in DIVS else None
    elif node.op == "call_method":
        kind = {"add": "add", "add_": "add", "__add__": "add", "__iadd__": "add", "mul": "mul", "mul_": "mul",
                "__mul__": "mul", "div": "div", "div_": "div", "__truediv__": "div"}.get(node.target)
    else:
        kind = None
    if kind is None or len(node.args) != 2 or set(node.kwargs) - {"out"}:
        return None
    return kind, node.args[0], node.args[1]


class _ScoreParser:
    """Decomposes a softmax input into sum_i mult_i * contraction_i + sum_j mult_j * mask_j."""

    def __init__(self, depends_on_cache):
        self.depends_on_cache = depends_on_cache
        self.terms: list[tuple[axes.Contraction, float]] = []
        self.masks: list[tuple[fx.Node, str, float]] = []

    def parse(self, node: Any, mult: float, split: Optional[tuple[list[int], fx.Node]] = None) -> None:
        """`split` = (candidate axes, view node) under a view that splits (seq*heads) back apart."""
        if not isinstance(node, fx.Node):
            raise NearMiss(f"constant {node!r} added to attention scores")
        if not self.depends_on_cache(node):
            if split is not None:
                raise NearMiss(f"mask {node.name} added to flattened scores")
            self.masks.append((node, "additive", mult))
            return
        contraction = axes.as_contraction(node)
        if contraction is not None:
            if split is not None:
                candidates = [axes.unflatten_contraction(contraction, a, split[1]) for a in split[0]]
                candidates = [c for c in candidates if c is not None]
                contraction = candidates[0] if len(candidates) == 1 else None
                if contraction is None:
                    raise NearMiss(f"{node.name} contracts flattened operands that cannot be unflattened")
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
            if not _is_number(fill) or fill > MASK_FILL_FLOOR:
                raise NearMiss(f"masked_fill with value {fill!r} on attention scores (only -inf-like fills are exact)")
            self.parse(node.args[0], mult)
            self.masks.append((node.args[1], "bool", 1.0))
            return
        binary = _binary(node)
        if binary is None:
            raise NearMiss(f"unsupported op {node.format_node()} between the score contractions and softmax")
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
            raise NearMiss(f"attention scores scaled by a tensor ({node.format_node()}); only constant scales are supported")


def _assign_query_roles(
    query: fx.Node, labels: list[str], label_role: dict[str, str], query_len: Optional[Any]
) -> list[str]:
    """Roles of the query axes: B and F come from the cache labels, S vs H from sizes or layout."""
    roles: list[Optional[str]] = [label_role.get(label) for label in labels]
    unknown = [i for i, r in enumerate(roles) if r is None]
    if len(unknown) != 2 or sorted(r for r in roles if r) != [B, F]:
        raise NearMiss(f"query operand {query.name} has axes {labels}; expected batch, seq, heads, feature")
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


def _cache_operand_roles(operand: fx.Node) -> Optional[tuple[CacheAccess, list[Optional[str]]]]:
    traced = axes.trace_axes(operand, stop=lambda n: as_cache_read(n) is not None)
    if traced is None:
        return None
    read_node, order = traced
    access = as_cache_read(read_node)
    return access, [None if o is None else (B, T, F)[o] for o in order]


def _score_term(contraction: axes.Contraction, query_len_of) -> ScoreTerm:
    node = contraction.node
    cache_side = [(op, _cache_operand_roles(op)) for op in (contraction.lhs, contraction.rhs)]
    cache_side = [(op, r) for op, r in cache_side if r is not None]
    if len(cache_side) != 1:
        raise NearMiss(f"score contraction {node.name} does not contract a query with exactly one cache slice")
    cache_operand, (access, cache_roles) = cache_side[0]
    labels = contraction.operand_labels(cache_operand)
    label_role = {label: role for label, role in zip(labels, cache_roles) if role is not None}
    if set(label_role.values()) != {B, T, F}:
        raise NearMiss(f"cache slice in {node.name} lost an axis")
    role_label = {r: l for l, r in label_role.items()}
    if role_label[F] in contraction.out_labels or role_label[T] not in contraction.out_labels:
        raise NearMiss(f"{node.name} does not contract the cache feature axis into key positions")
    query = contraction.other(cache_operand)
    q_labels = contraction.operand_labels(query)
    q_roles = _assign_query_roles(query, q_labels, label_role, query_len_of(access.buffer))
    return ScoreTerm(contraction, query, q_roles, access, label_role)


def _labels_to_roles(contraction: axes.Contraction, known: dict[str, str]) -> list[Optional[str]]:
    return [known.get(label) for label in contraction.out_labels]


def _mask_roles(mask: fx.Node, score_roles: list[str]) -> list[Optional[str]]:
    shape = axes.shape_of(mask)
    if shape is None or len(shape) > len(score_roles):
        raise NearMiss(f"mask {mask.name} does not broadcast against the scores")
    return score_roles[len(score_roles) - len(shape):]


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


def match_softmax(
    softmax: fx.Node, depends_on_cache, query_len_of
) -> MlaMatch:
    """Match one softmax; raises NotAttention or NearMiss."""
    parser, scale, terms = _score_terms(softmax, depends_on_cache, query_len_of)
    score_roles = _score_roles(terms)
    probs, value_node, value = _value_contraction(softmax)
    cache_operand, value_cache, cache_roles, out_roles = _value_roles(probs, value_node, value, score_roles)
    first = terms[0].cache
    v_width = _check_value_cache(terms, value_cache, cache_operand, cache_roles)
    masks = _mask_terms(parser, score_roles)
    out_dtype = axes.example_value(value_node).dtype
    layer = module_path(buffer_source(first.buffer)).rsplit(".", 1)[0]
    return MlaMatch(layer, softmax, terms, scale, masks, score_roles, value, value_cache, out_roles,
                    out_dtype, v_width)


def _score_terms(softmax: fx.Node, depends_on_cache, query_len_of) -> tuple[_ScoreParser, float, list[ScoreTerm]]:
    """The softmax input as `scale * sum(q_i . k_i) + masks`: (parser with the masks, scale, terms)."""
    scores = softmax.args[0]
    if not isinstance(scores, fx.Node) or not depends_on_cache(scores):
        raise NotAttention()
    rank = len(axes.shape_of(scores) or ())
    dim = _softmax_dim(softmax)
    if not isinstance(dim, int) or axes.normalize_dim(dim, rank) != rank - 1:
        raise NearMiss(f"softmax over dim {dim} of a rank-{rank} score; only the last (key) axis is supported")
    parser = _ScoreParser(depends_on_cache)
    parser.parse(scores, 1.0)
    if not parser.terms:
        raise NotAttention()
    mults = {m for _, m in parser.terms}
    if len(mults) != 1:
        raise NearMiss(f"score terms scaled differently ({sorted(mults)})")
    scale = mults.pop()
    terms = [_score_term(contraction, query_len_of) for contraction, _ in parser.terms]
    if len(terms) > 2:
        raise NearMiss(f"{len(terms)} score contractions; expected latent (+ rotary)")
    return parser, scale, terms


def _score_roles(terms: list[ScoreTerm]) -> list[Optional[str]]:
    """Roles of the score tensor: same layout for every term."""
    layouts = []
    for term in terms:
        known = dict(zip(term.contraction.operand_labels(term.query), term.query_roles))
        known.update(term.cache_label_roles)
        layouts.append(_labels_to_roles(term.contraction, known))
    score_roles = layouts[0]
    if any(layout != score_roles for layout in layouts) or sorted(map(str, score_roles)) != sorted([B, S, H, T]):
        raise NearMiss(f"score terms have layouts {layouts}; expected one [batch, seq, heads, keys] layout")
    if terms[0].cache.buffer is (terms[1].cache.buffer if len(terms) > 1 else None) and terms[0].cache.feat == terms[1].cache.feat:
        raise NearMiss("both score terms read the same cache columns")
    return score_roles


def _value_contraction(softmax: fx.Node) -> tuple[fx.Node, fx.Node, axes.Contraction]:
    """softmax -> casts -> value contraction: (probabilities after casts, value node, its contraction)."""
    probs = softmax
    while len(probs.users) == 1 and axes.is_dtype_cast(next(iter(probs.users))):
        probs = next(iter(probs.users))
    if len(probs.users) != 1:
        raise NearMiss("attention probabilities are used outside the value product")
    value_node = next(iter(probs.users))
    value = axes.as_contraction(value_node)
    if value is None:
        value = _flattened_value_contraction(probs, value_node)
    if value is None or (value.lhs is not probs and value.rhs is not probs):
        raise NearMiss(f"attention probabilities feed {value_node.format_node()}, not a value contraction")
    return probs, value_node, value


def _value_roles(probs: fx.Node, value_node: fx.Node, value: axes.Contraction, score_roles: list[Optional[str]]):
    """(cache operand, its cache access, its roles, output roles) of the value contraction."""
    cache_operand = value.other(probs)
    cached = _cache_operand_roles(cache_operand)
    if cached is None:
        raise NearMiss(f"value contraction {value_node.name} does not read a cache slice")
    value_cache, cache_roles = cached
    known = {l: r for l, r in zip(value.operand_labels(probs), score_roles)}
    cache_labels = value.operand_labels(cache_operand)
    for label, role in zip(cache_labels, cache_roles):
        if role is not None:
            if role in (B, T) and known.get(label) != role:
                raise NearMiss(f"value contraction {value_node.name} does not pair batch/key axes")
            known[label] = role
    out_roles = _labels_to_roles(value, known)
    if sorted(map(str, out_roles)) != sorted([B, S, H, F]):
        raise NearMiss(f"value contraction output has axes {out_roles}; expected batch, seq, heads, feature")
    return cache_operand, value_cache, cache_roles, out_roles


def _check_value_cache(terms: list[ScoreTerm], value_cache: CacheAccess, cache_operand: fx.Node,
                       cache_roles: list[Optional[str]]) -> Any:
    """The values must be the leading latent columns over the scores' rows; returns their width."""
    first = terms[0].cache
    f0 = first.feat[0] if first.feat else 0
    v_width = axes.shape_of(cache_operand)[cache_roles.index(F)]
    v_feat = value_cache.feat or (0, axes.shape_of(value_cache.buffer)[2])
    if value_cache.buffer is not first.buffer or v_feat[0] != f0:
        raise NearMiss("values are not the leading columns of the latent cache read by the first score term")
    for term in terms:
        if not (axes.known_equal(term.cache.bsz, value_cache.bsz) and axes.known_equal(term.cache.end, value_cache.end)) and (
            term.cache.bsz is not value_cache.bsz or term.cache.end is not value_cache.end
        ):
            raise NearMiss("score and value cache slices cover different batch/positions")
    return v_width


def _mask_terms(parser: _ScoreParser, score_roles: list[Optional[str]]) -> list[MaskTerm]:
    masks = []
    for node, kind, mult in parser.masks:
        if mult <= 0:
            raise NearMiss("mask multiplied by a non-positive scale")
        masks.append(MaskTerm(node, kind, mult, _mask_roles(node, score_roles)))
    return masks


@dataclass
class GraphMatches:
    matches: list[MlaMatch]
    near_misses: list[tuple[str, str]]  # (where, reason)
    writes: dict[fx.Node, list[CacheAccess]]


def find_mla(graph: fx.Graph) -> GraphMatches:
    """All absorbed-MLA attention blocks of a graph, plus near misses with reasons."""
    writes = cache_writes(graph)
    cache_dependent: dict[fx.Node, bool] = {}

    def depends_on_cache(node: fx.Node) -> bool:
        # iterative DFS over inputs; memoized across the whole graph
        stack = [node]
        while stack:
            n = stack[-1]
            if n in cache_dependent:
                stack.pop()
                continue
            if is_cache_buffer(n):
                cache_dependent[n] = True
                stack.pop()
                continue
            pending = [i for i in n.all_input_nodes if i not in cache_dependent]
            if pending:
                stack.extend(pending)
                continue
            cache_dependent[n] = any(cache_dependent[i] for i in n.all_input_nodes)
            stack.pop()
        return cache_dependent[node]

    def query_len_of(buffer: fx.Node) -> Optional[Any]:
        for write in writes.get(buffer, []):
            shape = axes.shape_of(write.value)
            if shape is not None and len(shape) >= 2:
                return shape[1]
        return None

    matches, near = [], []
    for node in graph.nodes:
        if not is_softmax(node):
            continue
        try:
            match = match_softmax(node, depends_on_cache, query_len_of)
        except NotAttention:
            continue
        except NearMiss as miss:
            near.append((node.name, str(miss)))
            continue
        match.writes = [w for buf in match.buffers for w in writes.get(buf, [])]
        matches.append(match)
    return GraphMatches(matches, near, writes)
