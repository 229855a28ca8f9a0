"""MLA written with `F.scaled_dot_product_attention`.

    q = cat([q_nope @ w_uk, q_pe], -1).transpose(1, 2)               # [B, H, S, 576]
    k = cat([kv[:b, :end], pe[:b, :end]], -1).unsqueeze(1)          # [B, 1, T, 576]
    v = kv[:b, :end].unsqueeze(1)                                   # [B, 1, T, 512]
    o = F.scaled_dot_product_attention(q, k.expand(...), v.expand(...), attn_mask=mask, scale=s)
    # or the one latent head unexpanded with enable_gqa=True

Keys and values are any view chain of the cache tensors (`cache_reads.py`): keys may be one
fused latent||rotary cache or two caches concatenated along features; their head axis is
of size 1, unexpanded (`enable_gqa`) or expanded over the query heads. The query is split
to the key pieces (directly into the parts it was concatenated from, when it was). A
boolean `attn_mask` keeps where True, a float one is added; `is_causal` is SDPA's
top-left causal mask; the scale defaults to 1/sqrt(query feature size), as in SDPA.

SDPA over keys and values that are not cache reads (MHA prefill over the chunk's own
per-head K/V) is not MLA decode: it is left unchanged, said once in the report.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F_

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.axes import B, F, H, S, T
from dcp_pass.rewrites.cache_reads import CacheRead, ReadRefused, trace_cache_read
from dcp_pass.rewrites.match import (
    MaskTerm,
    MatchContext,
    MlaMatch,
    NearMiss,
    NotAttention,
    Recogniser,
    ScoreTerm,
    buffer_name,
    register,
)
from dcp_pass.rewrites.recognisers.softmax import check_terms, check_value_read

SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, F_.scaled_dot_product_attention}
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
QUERY_ROLES = [B, H, S, F]
SCORE_ROLES = [B, H, S, T]
KV_ROLES = [B, None, T, F]  # one latent "kv head", broadcast over the query heads


def sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    """SDPA's arguments by name, defaults filled in."""
    bound = dict(SDPA_DEFAULTS)
    bound.update(zip(SDPA_ARGS, node.args))
    bound.update(node.kwargs)
    return bound


def _reads(operand: Any, what: str) -> list[CacheRead]:
    try:
        reads = trace_cache_read(operand)
    except ReadRefused as why:
        raise NearMiss(f"the {what} are not a cache read ({why})", operand if isinstance(operand, fx.Node) else None)
    if reads[0].roles != KV_ROLES:
        raise NearMiss(f"the {what} are not laid out as [batch, one head, position, feature] over the cache", operand)
    return reads


def _query_parts(query: fx.Node, reads: list[CacheRead]) -> list[tuple[fx.Node, list[str], Optional[tuple[int, int]]]]:
    """(node, roles, columns) of the query for each key piece: the tensors the query was
    concatenated from when they line up with the pieces, else column ranges of the query."""
    ranges = [r.cols for r in reads]
    if len(reads) == 1:
        return [(query, QUERY_ROLES, None)]
    # walk back through axis moves to a concatenation along the query's feature axis
    node, order = query, list(range(4))
    for _ in range(8):
        cat = node.op == "call_function" and node.target in (torch.cat, torch.concat)
        if cat:
            tensors = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            rank = len(axes.shape_of(node))
            if isinstance(dim, int) and order.index(axes.normalize_dim(dim, rank)) == 3 and len(tensors) == len(reads):
                widths, offset, spans = [axes.shape_of(t)[dim] for t in tensors], 0, []
                for w in widths:
                    spans.append((offset, offset + w))
                    offset += w
                if spans == ranges:
                    roles_in = [None] * rank
                    for q_axis, src in enumerate(order):
                        roles_in[src] = QUERY_ROLES[q_axis]
                    return [(t, list(roles_in), None) for t in tensors]
            break
        step = axes.axis_moving_step(node)
        if step is None or any(o is None for o in step[1]):
            break
        node, src_axes = step
        order = [src_axes[o] for o in order]
    return [(query, QUERY_ROLES, cols) for cols in ranges]


def _mask(node: Any) -> list[MaskTerm]:
    if node is None:
        return []
    if not isinstance(node, fx.Node):
        raise NearMiss("attn_mask is not a tensor")
    shape = axes.shape_of(node)
    dtype = axes.example_value(node).dtype
    if shape is None or len(shape) > 4:
        raise NearMiss("attn_mask does not broadcast against the [batch, head, query, key] scores", node)
    kind = "keep" if dtype == torch.bool else "additive"
    return [MaskTerm(node, kind, 1.0, SCORE_ROLES[4 - len(shape) :])]


class SdpaRecogniser(Recogniser):
    name = "sdpa"

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]

    def match(self, node: fx.Node, ctx: MatchContext) -> MlaMatch:
        args = sdpa_arguments(node)
        query, key, value = args["query"], args["key"], args["value"]
        if not all(isinstance(x, fx.Node) for x in (query, key, value)):
            raise NotAttention()
        if not ctx.depends_on_cache(key) and not ctx.depends_on_cache(value):
            raise NotAttention(
                "scaled_dot_product_attention over keys and values computed in the graph, not read "
                "from a cache (MHA/GQA over per-head K/V): not MLA decode, left unchanged"
            )
        if args["dropout_p"] not in (0, 0.0):
            raise NearMiss(f"dropout_p={args['dropout_p']!r}: attention dropout is not decode")
        if not isinstance(args["is_causal"], bool):
            raise NearMiss("is_causal is not a constant")
        q_shape = axes.shape_of(query)
        if q_shape is None or len(q_shape) != 4:
            raise NearMiss("the query is not a 4-D [batch, head, query position, feature] tensor", query)
        keys = _reads(key, "keys")
        value_reads = _reads(value, "values")
        if len(value_reads) != 1:
            raise NearMiss("the values are concatenated from several caches", value)
        values = value_reads[0]
        terms = [ScoreTerm(q, roles, read, cols) for (q, roles, cols), read in zip(_query_parts(query, keys), keys)]
        check_terms(terms, node)
        v_width = check_value_read(terms, values)
        scale = args["scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(q_shape[-1])
        if not isinstance(scale, (int, float)):
            raise NearMiss("the scale is not a constant")
        out = axes.example_value(node)
        layer = buffer_name(keys[0].buffer).rsplit(".", 1)[0]
        return MlaMatch(
            layer,
            self.name,
            node,
            node,
            terms,
            values,
            v_width,
            float(scale),
            _mask(args["attn_mask"]),
            SCORE_ROLES,
            [B, H, S, F],
            out.dtype,
            causal=args["is_causal"],
        )


register(SdpaRecogniser())
