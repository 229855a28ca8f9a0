"""The MLA match record, the recogniser registry, and `find_mla`.

A recogniser finds one way of writing absorbed-MLA attention (softmax over einsum or
matmul scores, `scaled_dot_product_attention`, ...) and fills one `MlaMatch`: which
query parts meet which cache reads, the values, the scale, the masks and causality,
where new nodes go and which node's users read the result. The record says nothing of
how the attention was spelled; one rewrite (`attention.rewrite_attention`) consumes it,
unless a record of its own kind defines `rewrite` (per-head attention does).

Recognisers live one per module in `dcp_pass/rewrites/recognisers/` and register
themselves with `register`; `find_mla` runs every registered recogniser over a graph.
A recogniser raises `NotAttention` for a node that is not attention over a cache (an
MoE gate's softmax) and `NearMiss` for cache-backed attention it cannot rewrite
exactly; a near miss is reported in the user's terms (the source line and the operand
that blocked), never as an FX node.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.cache_reads import (  # noqa: F401  (re-exported: the record's vocabulary)
    BUFFER_SOURCE,
    GROWING_CACHE,
    OFFLOADED_CACHE,
    CacheAccess,
    CacheRead,
    SizeArg,
    as_cache_write,
    buffer_name,
    buffer_source,
    cache_layout,
    cache_writes,
    growing_cache,
    growing_cache_reason,
    is_cache_tensor,
    module_path,
    offloaded_cache,
    parse_cache_index,
)


class NotAttention(Exception):
    """The node is not attention over a cache."""


class NearMiss(Exception):
    """Cache-backed attention that cannot be rewritten safely.

    `reason` says why in the user's terms; `node`, when given, is the operand that
    blocked the match: its source line is added to the report.
    """

    def __init__(self, reason: str, node: Optional[fx.Node] = None):
        super().__init__(reason)
        self.reason = reason
        self.node = node


# ----------------------------------------------------------------------------- the record


@dataclass
class ScoreTerm:
    """One query part contracted with the cache columns it meets.

    `query_cols`: the columns of the query's feature axis this term uses (a query built
    as latent || rotary against keys built the same way), None for the whole axis.
    """

    query: fx.Node
    query_roles: list[str]  # role of each query axis: B, S, H, F
    cache: CacheRead
    query_cols: Optional[tuple[int, int]] = None


@dataclass
class MaskTerm:
    """An additive or boolean mask added to the scores.

    kind "additive" adds the tensor (times `multiplier`); "bool" sets -inf where it is
    True (`masked_fill`); "keep" sets -inf where it is False (SDPA's boolean `attn_mask`).
    `roles`: the role of each mask axis, right-aligned with the scores.
    """

    node: fx.Node
    kind: str
    multiplier: float
    roles: list[Optional[str]]


@dataclass
class SinkTerm:
    """A learned logit per head that joins the softmax's denominator and adds no value
    (gpt-oss's attention sink): softmax over [scores, s_h] with the sink's column then
    dropped, or an output rescaled by exp(lse - logaddexp(lse, s_h)). The rewrite counts it
    once, after the merge, from the merged log-sum-exp.

    `node`: the sink logits (natural-log units, like the scores); `roles`: the role of each of
    its axes, right-aligned with the scores (a key axis, if any, has size 1).
    """

    node: fx.Node
    roles: list[Optional[str]]


@dataclass
class MlaMatch:
    """One absorbed-MLA attention, whatever its spelling.

    New nodes go before `anchor`; the users of `output` then read the merged output,
    laid out as `out_roles`. Keys: `terms` (latent first, then rotary); values: the
    leading `v_dim` latent columns read by `value_cache`. `score_roles` is the layout
    the masks are given in. `causal`: query i also sees only keys j <= i of the read
    (SDPA's `is_causal`, top-left aligned).
    """

    layer: str
    family: str
    anchor: fx.Node
    output: fx.Node
    terms: list[ScoreTerm]
    value_cache: CacheRead
    v_dim: int
    scale: float
    masks: list[MaskTerm]
    score_roles: list[str]
    out_roles: list[str]
    out_dtype: torch.dtype
    causal: bool = False
    writes: list[CacheAccess] = field(default_factory=list)
    # a mask the rewrite builds in the graph ((graph, canonical queries) -> additive [B, S, H, T]
    # over global key positions, or None), for forms whose mask is a function (flex_attention)
    mask_builder: Optional[Any] = None
    mask_per_head: bool = False  # whether that mask differs per query head
    rewrite_notes: list[str] = field(default_factory=list)  # what the rewrite chose, for the layer's report
    sink: Optional[SinkTerm] = None  # a per-head logit in the softmax's denominator only
    # nodes whose value is the attention's log-sum-exp as the model reads it (flex_attention's
    # return_lse), laid out as `lse_roles`, in base `lse_out_base`: they read the merged LSE
    lse_outputs: list[fx.Node] = field(default_factory=list)
    lse_roles: list[str] = field(default_factory=list)
    lse_out_base: str = "e"

    @property
    def buffers(self) -> list[fx.Node]:
        seen: list[fx.Node] = []
        for access in [t.cache for t in self.terms] + [self.value_cache]:
            if access.buffer not in seen:
                seen.append(access.buffer)
        return seen

    @property
    def softmax(self) -> fx.Node:
        """The insertion point (the softmax for softmax-spelled attention)."""
        return self.anchor

    def check_plan(self, plan) -> Optional[str]:
        """Why this layer cannot run under `plan` (an error raised before any cache is striped), or None."""
        return None


# ----------------------------------------------------------------------------- user terms


def source_of(node: Any) -> Optional[str]:
    """`model.py:301 scores = scores.softmax(dim=-1)`: the user's line that made `node`."""
    if not isinstance(node, fx.Node):
        return None
    trace = node.meta.get("stack_trace") or ""
    lines = trace.splitlines()
    # the innermost frame outside this package's rewrites and state (a striped cache's
    # __torch_function__, which Dynamo traces through, is not where the user read it)
    frames = [
        i
        for i, line in enumerate(lines)
        if line.strip().startswith("File ") and not any(own in line for own in _OWN_FRAMES)
    ]
    if not frames:
        return None
    at = frames[-1]
    last = lines[at].strip()
    code = lines[at + 1].strip() if at + 1 < len(lines) else ""
    try:
        path = last.split('"')[1]
        lineno = last.split("line ")[1].split(",")[0]
    except IndexError:
        return None
    where = f"{os.path.basename(path)}:{lineno}"
    return f"{where} `{code}`" if code else where


_OWN_FRAMES = (os.path.join("dcp_pass", "rewrites", ""), os.path.join("dcp_pass", "state", ""))


def where_of(node: fx.Node) -> str:
    """Where a match or near miss is, for reports: the source line, else the op."""
    return source_of(node) or f"a {_op_word(node)} call"


def _op_word(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def near_miss_text(miss: NearMiss) -> str:
    """The reason, with the blocking operand's source line when it differs from the anchor's."""
    blocked = source_of(miss.node) if miss.node is not None else None
    return f"{miss.reason} (at {blocked})" if blocked else miss.reason


# ----------------------------------------------------------------------------- the registry


@dataclass
class MatchContext:
    """What recognisers of one graph share: the graph, its cache writes, and memoised facts."""

    graph: fx.Graph
    writes: dict[fx.Node, list[CacheAccess]]
    # outputs of the attention matched so far: each becomes the exact merged output, the same
    # on every rank, so what is computed from it reads no rank's stripe (a later layer's query
    # over the same cache, as in layers that share one cache)
    merged_outputs: set[fx.Node] = field(default_factory=set)
    _cache_dependent: dict[fx.Node, bool] = field(default_factory=dict)

    def depends_on_cache(self, node: fx.Node) -> bool:
        """Whether `node` is computed from a cache tensor (iterative DFS, memoised per graph)."""
        memo = self._cache_dependent
        stack = [node]
        while stack:
            n = stack[-1]
            if n in memo:
                stack.pop()
                continue
            if is_cache_tensor(n):
                memo[n] = True
                stack.pop()
                continue
            pending = [i for i in n.all_input_nodes if i not in memo]
            if pending:
                stack.extend(pending)
                continue
            memo[n] = any(memo[i] for i in n.all_input_nodes)
            stack.pop()
        return memo[node]

    def cache_tensors_under(self, node: fx.Node) -> set[fx.Node]:
        """The cache tensors `node` is computed from, other than through a matched attention's output."""
        found, seen, stack = set(), set(), [node]
        while stack:
            n = stack.pop()
            if n in seen or n in self.merged_outputs:
                continue
            seen.add(n)
            if is_cache_tensor(n):
                found.add(n)
            elif self.depends_on_cache(n):
                stack.extend(n.all_input_nodes)
        return found

    def query_len_of(self, buffer: fx.Node) -> Optional[Any]:
        """The number of tokens written into `buffer` per call (the query length), if known."""
        for write in self.writes.get(buffer, []):
            if write.bsz is None:  # a pool's slot writes have no batch axis
                continue
            shape = axes.shape_of(write.value)
            if shape is not None and len(shape) >= 2:
                return shape[1]
        return None


class Recogniser:
    """One way of writing MLA attention. Subclasses set `name` and implement both methods."""

    name = "?"
    # lower runs first: a form whose anchors overlap another's (a softmax, an SDPA call) and
    # that accepts fewer graphs claims its anchors before the more general recogniser sees them
    priority = 0

    def anchors(self, graph: fx.Graph) -> Iterable[fx.Node]:
        """The nodes a match of this form is anchored on (softmax calls, SDPA calls, ...)."""
        raise NotImplementedError

    def match(self, node: fx.Node, ctx: MatchContext) -> MlaMatch:
        """The match anchored on `node`; raises NotAttention or NearMiss."""
        raise NotImplementedError


RECOGNISERS: dict[str, Recogniser] = {}


def register(recogniser: Recogniser) -> Recogniser:
    """Add a recogniser (by its name; a second one of the same name replaces the first)."""
    RECOGNISERS[recogniser.name] = recogniser
    return recogniser


def load_recognisers() -> dict[str, Recogniser]:
    """Import every module of `dcp_pass/rewrites/recognisers/` (each registers its form)."""
    from dcp_pass.rewrites import recognisers

    for info in sorted(pkgutil.iter_modules(recognisers.__path__), key=lambda i: i.name):
        importlib.import_module(f"{recognisers.__name__}.{info.name}")
    return RECOGNISERS


@dataclass
class GraphMatches:
    matches: list[MlaMatch]
    near_misses: list[tuple[str, str]]  # (where, reason), both in the user's terms
    writes: dict[fx.Node, list[CacheAccess]]
    notes: list[str] = field(default_factory=list)  # attention that is not MLA, said once


def find_mla(graph: fx.Graph) -> GraphMatches:
    """Every MLA attention of a graph that a registered recogniser finds, plus near misses."""
    recognisers = load_recognisers()  # first: a module may also register cache read and write forms
    ctx = MatchContext(graph, cache_writes(graph))
    matches: list[MlaMatch] = []
    near: list[tuple[str, str]] = []
    said_at: set[tuple[fx.Node, str]] = set()
    notes: list[str] = []
    claimed: set[fx.Node] = set()
    order = {n: i for i, n in enumerate(graph.nodes)}
    for recogniser in sorted(recognisers.values(), key=lambda r: r.priority):
        for node in list(recogniser.anchors(graph)):
            if node in claimed:
                continue
            try:
                match = recogniser.match(node, ctx)
                writes = _writes_as_read(match, ctx)
                _check_no_write_between_reads(match, ctx, order)
                moved = offloaded_cache(node)
                if moved is not None:
                    raise NearMiss(OFFLOADED_CACHE, moved)
            except NotAttention as why:
                # attention-shaped (the recogniser says why it is not attention over a cache) over a
                # growing cache whose stored rows it does not see as a cache (a quantized cache's
                # empty residual): a near miss, with the cache's reason
                grown = growing_cache(node) if str(why) else None
                if grown is not None:
                    _add_near_miss(near, said_at, node, NearMiss(growing_cache_reason(grown), grown))
                elif str(why):
                    notes.append(f"{where_of(node)}: {why}")
                continue
            except NearMiss as miss:
                # said in the user's terms, whatever op the recogniser stopped at
                said = miss
                grown = growing_cache(node)
                moved = offloaded_cache(node) if grown is None else None
                if grown is not None:
                    said = NearMiss(growing_cache_reason(grown), grown)
                elif moved is not None:
                    said = NearMiss(OFFLOADED_CACHE, moved)
                _add_near_miss(near, said_at, node, said)
                continue
            claimed.update((match.anchor, match.output))
            ctx.merged_outputs.add(match.output)
            ctx.writes.update(writes)
            match.writes = [w for buf in match.buffers for w in ctx.writes.get(buf, [])]
            matches.append(match)
    matches.sort(key=lambda m: order[m.anchor])
    return GraphMatches(matches, near, ctx.writes, notes)


def _add_near_miss(near: list[tuple[str, str]], said: set, anchor: fx.Node, miss: NearMiss) -> None:
    """Record a near miss at `anchor`, once: a second recogniser that stops at the same anchor
    for the same reason (a cache's, said whatever op each stopped at) adds nothing. Anchors of
    several layers share a source line: `said` holds (anchor, reason) pairs."""
    text = near_miss_text(miss)
    if (anchor, text) not in said:
        said.add((anchor, text))
        near.append((where_of(anchor), text))


def _writes_as_read(match: MlaMatch, ctx: MatchContext) -> dict[fx.Node, list[CacheAccess]]:
    """The writes of each cache the match reads, as writes into the layout the attention reads
    (`cache[a, b] = v` is (request, position) for a flat read, (page, offset) for a paged one);
    NearMiss naming the write when the write and the read disagree about the cache's layout."""
    reads: dict[fx.Node, CacheRead] = {}
    for read in [t.cache for t in match.terms] + [match.value_cache]:
        reads.setdefault(read.buffer, read)
    found: dict[fx.Node, list[CacheAccess]] = {}
    for buffer, read in reads.items():
        kind = read.kind
        converted = []
        for write in ctx.writes.get(buffer, []):
            as_read = write.as_kind(kind)
            if as_read is None:
                raise NearMiss(
                    f"{buffer_name(buffer)} is written as {write.kind.words} "
                    f"({write.describe()}) but read as {kind.words}: the write and the read "
                    f"disagree about the cache's layout; write and read it the same way",
                    write.node,
                )
            converted.append(as_read)
        found[buffer] = converted
    return found


def _read_time(read: fx.Node, writes: set, order: dict[fx.Node, int]) -> Optional[int]:
    """Where in graph order `read` is read: the node itself, or for a graph input its first use
    that is not one of the cache's writes."""
    if read not in order:
        return None
    if read.op != "placeholder":
        return order[read]
    uses = [order[u] for u in read.users if u not in writes and u in order]
    return min(uses) if uses else order[read]


def _check_no_write_between_reads(match: MlaMatch, ctx: MatchContext, order: dict[fx.Node, int]) -> None:
    """NearMiss when a cache the match reads is written between its first read and its output
    (after the scores, before the values read it again): the rewrite attends over the shard as
    it is at one point, before the softmax."""
    writes = {w.node for buffer in match.buffers for w in ctx.writes.get(buffer, [])}
    # when a read is the cache tensor itself (a whole static cache read as it is), its contents
    # are read where the ops using it run, not where the graph input sits in graph order
    found = [_read_time(n, writes, order) for n in [t.cache.node for t in match.terms] + [match.value_cache.node]]
    times = [t for t in found if t is not None]
    first = min(times)
    last = max(times + [order.get(match.output, -1)])
    for buffer in match.buffers:
        for write in ctx.writes.get(buffer, []):
            if first < order.get(write.node, -1) < last:
                raise NearMiss(
                    f"{buffer_name(buffer)} is written between its reads by this attention (its scores "
                    f"and its values would see different contents)",
                    write.node,
                )
