"""Rewrite of one matched MLA attention into shard-local attention + collective merge.

Emitted (before the softmax, in this order):
  local cache shards   local[row0:bsz(, :, f0:f1)]
  canonical queries    q.permute(...) -> [B, S, H, D]
  query heads          gather_heads (query all-gather)  | replicated projection | as is
  mask                 the model's mask in [B, S, H, T] order, over global key positions
  dcp.mla_local_attention(global key count, c, rank) -> (partial output, lse)
Nothing emitted has a rank-dependent shape or symbolic expression: the op takes the
global key count and the unstriped mask and keeps its stripe itself, so every rank's
graph guards on the same things and recompiles at the same calls. (A cache kind whose
shard rows are not striped by position, a window ring then entries, maps the mask to its
shard's rows itself, `CacheKind.shard_mask`: a shape the same on every rank, the rank only
in constants; the op then attends the rows as given.)
  exchange             exchange_a2a | exchange_ag_rs | exchange_replicated | exchange_fi_a2a
  sink                 fold_sink(merged fp32, merged LSE, sink logits): a per-head sink logit counted
                       once, after the merge (each rank's partial leaves it out)
  model's LSE          the merged LSE in the model's base and layout, where the model reads the
                       attention's LSE (flex_attention's return_lse)
  output layout        permute back to the model's layout
The value contraction's users then read the merged output; the old nodes die. (The next
pass, rewrites/project_merge.py, may move the value up-projection that follows before the
exchange.)
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, causal_masks
from dcp_pass.rewrites.axes import B, F, H, S, T
from dcp_pass.rewrites.cache_reads import CacheRead
from dcp_pass.rewrites.fx_util import call, erase_dead_region, method
from dcp_pass.rewrites.match import MaskTerm, MlaMatch, NearMiss, ScoreTerm
from dcp_pass.runtime.decode import comm
from dcp_pass.runtime.decode import ops as _ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_pass.runtime.decode.backends import ATTENTION_BACKENDS, AUTO, COMM_BACKENDS
from dcp_pass.runtime.decode.merge import fold_sink

CANON_Q = [B, S, H, F]
CANON_SCORES = [B, S, H, T]


@dataclass(frozen=True)
class AttentionPlan:
    """Decisions shared by every layer of one compile."""

    c: int
    rank: int
    group_name: str
    comm_backend: str  # "a2a" | "ag_rs" | "fi_a2a"
    head_sharded: bool
    lse_base: str
    attn_backend: str
    # per-head attention over a re-expanded latent (recognisers/per_head.py); None: "auto"
    absorb_kv_b_proj: Optional[bool] = False


@dataclass(frozen=True)
class MergedOutput:
    """What `rewrite_attention` leaves where the attention was."""

    exchange: fx.Node  # the exchange call: the merged output as [B, S, H, F]
    result: fx.Node  # the merged output in the model's layout (what the model's code reads)


def ordered_terms(match: MlaMatch):
    """(latent term, rotary term or None): the latent term reads the value columns."""
    value = match.value_cache
    latent = [
        t
        for t in match.terms
        if t.cache.buffer is value.buffer and (t.cache.feat or (0,))[0] == (value.feat or (0,))[0]
    ]
    if len(latent) != 1:
        raise NearMiss("cannot tell the latent score term from the rotary one")
    rope = [t for t in match.terms if t is not latent[0]]
    return latent[0], (rope[0] if rope else None)


def check_mask_heads(match: MlaMatch, plan: AttentionPlan) -> None:
    """Per-head masks would need their own head gather; refuse them rather than guess."""
    if not plan.head_sharded:
        return
    if match.mask_per_head:
        raise NearMiss("the attention mask differs per head; DCP with head-sharded queries needs a head-broadcast mask")
    for mask in match.masks:
        shape = axes.shape_of(mask.node)
        if H in mask.roles and not axes.known_equal(shape[mask.roles.index(H)], 1):
            raise NearMiss(
                "the attention mask differs per head; DCP with head-sharded queries needs a head-broadcast mask"
            )


def layer_backend(match: MlaMatch, plan: AttentionPlan) -> str:
    """The attention backend of this layer's op: the plan's, except that a masked layer under a
    backend without additive masks (the table's ``takes_mask``: FlashInfer) runs on "auto"'s
    kernels, as serving engines run their prefill on another kernel than their decode; the
    layer's report says so."""
    entry = ATTENTION_BACKENDS.get(plan.attn_backend)
    if match.masks and entry is not None and not entry.takes_mask:
        note = f"masked: attention {AUTO} ({plan.attn_backend} takes no additive score mask)"
        if note not in match.rewrite_notes:
            match.rewrite_notes.append(note)
        return AUTO
    return plan.attn_backend


def local_slice(graph: fx.Graph, local: fx.Node, access: CacheRead, name: str, c: int = 1) -> fx.Node:
    """This rank's rows of a read from its shard `local`, as [batch, position, feature] (the
    read's cache kind says how)."""
    kind = access.kind
    if kind.local_read is None:
        raise NearMiss(f"a cache of kind {kind.name} ({kind.words}) is read only by its own recogniser's rewrite")
    return kind.local_read(graph, local, access, name, c)


def canonical_query(graph: fx.Graph, node: fx.Node, term: ScoreTerm, name: Optional[str] = None) -> fx.Node:
    """`node` (the term's query, or a copy of it) as [B, S, H, D], cut to the term's columns."""
    q = to_canonical(graph, node, term.query_roles, CANON_Q, None if term.query_cols else name)
    if term.query_cols is None:
        return q
    return call(graph, operator.getitem, q, (Ellipsis, slice(*term.query_cols)), name=name)


def to_canonical(
    graph: fx.Graph, node: fx.Node, roles: list[Optional[str]], canonical: list[str], name: Optional[str] = None
) -> fx.Node:
    perm = axes.permutation_to(roles, canonical)
    if perm is None:
        raise NearMiss(f"{node.name} has axes {roles}, cannot order them as {canonical}")
    return node if perm == list(range(len(perm))) else method(graph, "permute", node, *perm, name=name)


def causal_positions(graph: fx.Graph, match: MlaMatch, q_lat: fx.Node) -> Optional[fx.Node]:
    """The op's causal cap, int64 [1, S] global query positions (a key at global position p is
    visible to query s when p <= cap[s]), or None. From SDPA's `is_causal` (query i sees keys
    j <= i of the read, top-left aligned: start + i for a read from `start`), or from a
    multi-token mask that compares query and key positions (causal_masks.py: the comparison
    leaves the mask). A cap, not an additive mask: the mask would be an [S, T] fp32 tensor
    (16 GiB for a 64K-token prefill), the cap is S integers."""
    read = match.value_cache
    if match.causal:
        device = axes.example_value(match.terms[0].query).device
        rows = method(graph, "size", q_lat, 1, name="query_rows")
        query_pos = call(graph, torch.arange, rows, device=device, name="causal_rows")
    else:
        split, _ = causal_masks.causal_splits(match.masks)
        if split is None:
            return None
        query_pos = split.query_index
        if not (isinstance(split.key_offset, int) and split.key_offset == 0):
            query_pos = call(graph, operator.sub, query_pos, split.key_offset, name="causal_rows_of_read")
        query_pos = method(graph, "reshape", query_pos, -1, name="causal_rows")
    if read.windowed:
        query_pos = call(graph, operator.add, query_pos, read.start, name="causal_rows_global")
    return method(graph, "unsqueeze", query_pos, 0, name="causal_q_pos")


def masks_to_add(match: MlaMatch) -> list[MaskTerm]:
    """The match's masks less a causal comparison that `causal_positions` turns into the cap."""
    return list(match.masks) if match.causal else causal_masks.causal_splits(match.masks)[1]


def _in_score_order(
    graph: fx.Graph, match: MlaMatch, mask: MaskTerm, node: fx.Node, name: Optional[str] = None
) -> fx.Node:
    """`node` (a mask term's tensor, or a function of it) with the scores' missing leading axes
    added and its axes ordered [B, S, H, T]."""
    missing = len(match.score_roles) - len(mask.roles)
    if missing:
        node = call(graph, operator.getitem, node, (None,) * missing + (Ellipsis,))
    return to_canonical(graph, node, match.score_roles, CANON_SCORES, name=name)


def _boolean_mask(match: MlaMatch) -> bool:
    """Whether `score_mask` gives the match's one boolean keep mask as it is."""
    masks = masks_to_add(match)
    if match.mask_builder is None and len(masks) == 1 and masks[0].kind == "keep" and masks[0].multiplier == 1.0:
        value = axes.example_value(masks[0].node)
        return isinstance(value, torch.Tensor) and value.dtype == torch.bool
    return False


def score_mask(graph: fx.Graph, match: MlaMatch, q_lat: Optional[fx.Node] = None) -> Optional[fx.Node]:
    """Sum of the score masks as one additive fp32 tensor in [B, S, H, T] order (global
    key positions: the op keeps this rank's columns); one boolean keep mask alone goes as it
    is, in that order (the op reads it in place: as fp32 it would be 4x its size)."""
    masks = masks_to_add(match)
    if _boolean_mask(match):
        return _in_score_order(graph, match, masks[0], masks[0].node, name="mask_keep")
    total = match.mask_builder(graph, q_lat) if match.mask_builder is not None else None
    for mask in masks:
        node = mask.node
        if mask.kind == "bool":
            node = call(graph, torch.where, node, float("-inf"), 0.0)
        elif mask.kind == "keep":
            node = call(graph, torch.where, node, 0.0, float("-inf"))
        if mask.multiplier != 1.0:
            node = call(graph, operator.mul, node, mask.multiplier)
        node = method(graph, "float", _in_score_order(graph, match, mask, node), name="mask_f32")
        total = node if total is None else call(graph, operator.add, total, node)
    return total


def merge_local_attention(
    graph: fx.Graph,
    attn: fx.Node,
    match: MlaMatch,
    plan: AttentionPlan,
    project: Optional[Callable[[fx.Node], fx.Node]] = None,
) -> MergedOutput:
    """The tail of every rewritten attention: the partial output and LSE of the local attention
    op `attn`, exchanged and merged across the DCP group ([B, S, H, F], `emit_exchange`), mapped
    by `project` when given (absorbed MLA's value half), back in the model's layout."""
    out = call(graph, operator.getitem, attn, 0, name="partial_out")
    lse = call(graph, operator.getitem, attn, 1, name="partial_lse")
    merged = emit_exchange(graph, out, lse, match, plan)
    result = merged if project is None else project(merged)
    back = [CANON_Q.index(r) for r in match.out_roles]
    if back != list(range(4)):
        result = method(graph, "permute", result, *back, name="merged_layout")
    return MergedOutput(merged, result)


def emit_exchange(graph: fx.Graph, out: fx.Node, lse: fx.Node, match: MlaMatch, plan: AttentionPlan) -> fx.Node:
    """The merged output [B, S, H, F] in the model's dtype; with a sink, the sink counted in
    it after the merge (`fold_sink` over the merged fp32 output and merged LSE). Where the
    model reads the attention's LSE (`match.lse_outputs`), those nodes' users read the
    merged LSE instead."""
    if match.sink is not None or match.lse_outputs:
        out_dtype = torch.float32 if match.sink is not None else match.out_dtype
        merged, merged_lse = emit_exchange_with_lse(graph, out, lse, match, plan, out_dtype)
        if match.lse_outputs:
            model_lse = lse_for_model(graph, merged_lse, match, plan)
            for node in match.lse_outputs:
                node.replace_all_uses_with(model_lse)
            if "merged LSE to the model" not in match.rewrite_notes:
                match.rewrite_notes.append("merged LSE to the model")
        if match.sink is None:
            return merged
        if "sink after the merge" not in match.rewrite_notes:
            match.rewrite_notes.append("sink after the merge")
        return call(
            graph,
            fold_sink,
            merged,
            merged_lse,
            sink_logits(graph, match),
            plan.lse_base,
            match.out_dtype,
            name="merged_sink",
        )
    if plan.c == 1:  # one rank holds every key (the single-GPU fast path): its partial is the output
        return method(graph, "to", out, match.out_dtype, name="merged")
    common = dict(base=plan.lse_base, out_dtype=match.out_dtype)
    backend = COMM_BACKENDS[plan.comm_backend]
    if not plan.head_sharded:
        return call(
            graph,
            comm.exchange_replicated,
            out,
            lse,
            plan.group_name,
            plan.c,
            method=backend.replicated_method,
            name="merged",
            **common,
        )
    return call(graph, backend.exchange, out, lse, plan.group_name, plan.c, name="merged", **common)


def emit_exchange_with_lse(
    graph: fx.Graph, out: fx.Node, lse: fx.Node, match: MlaMatch, plan: AttentionPlan, out_dtype: torch.dtype
) -> tuple[fx.Node, fx.Node]:
    """(merged output [B, S, H, F] in `out_dtype`, merged LSE [B, S, H] in the plan's base)."""
    if plan.c == 1:
        return method(graph, "to", out, out_dtype, name="merged"), lse
    common = dict(base=plan.lse_base, out_dtype=out_dtype, return_lse=True)
    backend = COMM_BACKENDS[plan.comm_backend]
    if not plan.head_sharded:
        both = call(
            graph,
            comm.exchange_replicated,
            out,
            lse,
            plan.group_name,
            plan.c,
            method=backend.replicated_method,
            name="merged_both",
            **common,
        )
    else:
        both = call(graph, backend.exchange, out, lse, plan.group_name, plan.c, name="merged_both", **common)
    return (
        call(graph, operator.getitem, both, 0, name="merged"),
        call(graph, operator.getitem, both, 1, name="merged_lse"),
    )


def lse_for_model(graph: fx.Graph, merged_lse: fx.Node, match: MlaMatch, plan: AttentionPlan) -> fx.Node:
    """The merged LSE [B, S, H] (the plan's base) as the model read the attention's: its
    base, layout and dtype."""
    node = merged_lse
    if plan.lse_base != match.lse_out_base:  # log2(x) = ln(x) * log2(e)
        node = call(
            graph,
            operator.mul,
            node,
            math.log2(math.e) if match.lse_out_base == "2" else math.log(2.0),
            name="merged_lse_base",
        )
    perm = [CANON_SCORES.index(r) for r in match.lse_roles]
    if perm != sorted(perm):
        node = method(graph, "permute", node, *perm, name="merged_lse_layout")
    dtype = axes.example_value(match.lse_outputs[0]).dtype
    return method(graph, "to", node, dtype, name="merged_lse_model")


def sink_logits(graph: fx.Graph, match: MlaMatch) -> fx.Node:
    """The match's sink logits as [B, S, H] (size-1 axes where the model broadcasts), the
    merged LSE's layout."""
    node, roles = match.sink.node, list(match.sink.roles)
    for role in CANON_SCORES:
        if role not in roles:
            node = method(graph, "unsqueeze", node, -1)
            roles.append(role)
    node = to_canonical(graph, node, roles, CANON_SCORES)
    return call(graph, operator.getitem, node, (Ellipsis, 0), name="sink_bsh")


def gather_queries(graph: fx.Graph, q_lat: fx.Node, q_rope: Optional[fx.Node], plan: AttentionPlan, d_lat: int):
    """One all-gather carries both query parts of the DCP group, in DCP-rank (= head) order."""
    packed = q_lat if q_rope is None else call(graph, torch.cat, [q_lat, q_rope], -1, name="q_packed")
    gathered = call(graph, comm.gather_heads, packed, plan.group_name, plan.c, name="q_group")
    if q_rope is None:
        return gathered, None
    lat = call(graph, operator.getitem, gathered, (Ellipsis, slice(None, d_lat)), name="q_lat_group")
    rope = call(graph, operator.getitem, gathered, (Ellipsis, slice(d_lat, None)), name="q_rope_group")
    return lat, rope


def rewrite_attention(
    gm: fx.GraphModule,
    match: MlaMatch,
    plan: AttentionPlan,
    local_nodes: dict[fx.Node, fx.Node],
    query_override: Optional[tuple[fx.Node, Optional[fx.Node]]] = None,
) -> MergedOutput:
    """Replace `match` in `gm.graph`; returns the exchange and the merged output in the
    model's layout.

    `query_override` supplies full DCP-group queries computed locally (replicated
    q-projection); without it, head-sharded models all-gather their queries.
    """
    graph = gm.graph
    latent, rope = ordered_terms(match)
    check_mask_heads(match, plan)
    backend = layer_backend(match, plan)
    value_node = match.output
    kv_local = local_nodes[latent.cache.buffer]
    kv_format = kv_local.meta.get("dcp_kv_format", "")
    with graph.inserting_before(match.anchor):
        if kv_format:  # packed fp8 rows, read whole (the op takes latent, scales and packed rope apart)
            kv = local_slice(graph, kv_local, replace(latent.cache, feat=None), "kv_local", plan.c)
            rope_packed = rope is not None and rope.cache.buffer is latent.cache.buffer
            pe = (
                None
                if rope is None or rope_packed
                else local_slice(graph, local_nodes[rope.cache.buffer], rope.cache, "pe_local", plan.c)
            )
        else:
            kv = local_slice(graph, kv_local, latent.cache, "kv_local", plan.c)
            pe = local_slice(graph, local_nodes[rope.cache.buffer], rope.cache, "pe_local", plan.c) if rope else None
        if query_override is not None:
            q_lat, q_rope = query_override
        else:
            q_lat = canonical_query(graph, latent.query, latent, "q_lat_bshd")
            q_rope = canonical_query(graph, rope.query, rope, "q_rope_bshd") if rope else None
            if plan.head_sharded:
                d_lat = latent.cache.width
                q_lat, q_rope = gather_queries(graph, q_lat, q_rope, plan, d_lat)
        mask = score_mask(graph, match, q_lat)
        kv_len, c, rank = match.value_cache.end, plan.c, plan.rank
        shard_mask = match.value_cache.kind.shard_mask
        if shard_mask is not None:  # rows not striped by position: the op attends the shard's rows as given
            if any(t.cache.kind is not match.value_cache.kind for t in match.terms):
                raise NearMiss("score terms read caches of different kinds")
            mask, kv_len = shard_mask(graph, mask, match.value_cache, plan.c, plan.rank, _boolean_mask(match))
            c, rank = 1, 0
        window = {"kv_start": match.value_cache.start} if match.value_cache.windowed else {}
        q_pos = causal_positions(graph, match, q_lat)
        if q_pos is not None:
            window["q_pos"] = q_pos
        if kv_format:
            window["kv_format"] = kv_format
        attn = call(
            graph,
            torch.ops.dcp.mla_local_attention.default,
            q_lat,
            q_rope,
            kv,
            pe,
            kv_len=kv_len,
            c=c,
            rank=rank,
            v_dim=match.v_dim,
            scale=float(match.scale),
            mask=mask,
            lse_base=plan.lse_base,
            backend=backend,
            name="local_attention",
            **window,
        )
        merged = merge_local_attention(graph, attn, match, plan)
    value_node.replace_all_uses_with(merged.result)
    erase_dead_region(graph, [value_node] + match.lse_outputs)
    return merged
