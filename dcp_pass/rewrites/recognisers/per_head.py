"""Attention over per-head keys and values that are position-wise functions of cache reads.

Hugging Face models with a static cache (`generate(cache_implementation="static")`) keep
their caches in a Cache object passed into the forward: its tensors are graph inputs
(`L['kwargs']['cache'].layers[0].keys`, `[batch, kv heads, position, feature]`), written with
`index_copy_(2, cache_position, new)` and read whole (the mask hides unwritten positions):

    # Llama / Qwen2: the cache holds per-head K and V
    k = repeat_kv(cache.keys)      # [b, kvh, t, d] -> [b, h, t, d] (or SDPA's enable_gqa)
    # DeepseekV3 / Kimi: the cache holds the latent and the rotary key, re-expanded per step
    kv = kv_b_proj(cache.keys).view(b, t, h, nope + v).transpose(1, 2)
    k_nope, v = kv.split([nope, v], -1)
    k = new_empty(b, h, t, nope + rope); k[..., :nope] = k_nope; k[..., nope:] = cache.values.expand(b, h, t, rope)

    o = softmax(q @ k.transpose(2, 3) * scale + mask) @ v      # or SDPA(q, k, v, attn_mask=mask)

Every step between a cache tensor and K or V acts on each position alone (a linear map of
the feature axis, head splits, column slices, head broadcasts), so a rank can compute K and
V of its own stripe from its own cache rows. The rewrite (`PerHeadMatch.rewrite`) does
that: each rank runs the derivation (kv_b_proj included) on its ~1/c rows only, attends
with `dcp.local_attention` over them (global positions, the model's mask over global
positions: the op keeps the rank's columns), and the partials merge exactly through their
log-sum-exp (`attention.merge_local_attention`, as for absorbed MLA).

With option `absorb_kv_b_proj` (by default where options.absorb_kv_b_proj_auto says so:
decode on CUDA in 16-bit dtypes) a layer whose K and V are the two halves of one kv_b_proj
over the latent cache, beside a rotary cache broadcast over the heads (DeepseekV3, Kimi),
runs as absorbed MLA instead (`PerHeadMatch._rewrite_absorbed`): the key half folds into
the query, `dcp.mla_local_attention` attends over the cached latent and rotary rows as they
are, and the value half applies after the merge (before it, per rank, where
project_before_merge moves it), so no step re-expands the context.

The cache tensors (rewrites/cache_kinds/static_cache.py) are striped like module buffers
(state/shards.py): each rank keeps a shard `[batch, kv heads, ceil(T / c) + 1, feature]` (one
spare row that no read covers), the full-size storage is released and the tensor's class
becomes `StripedCacheTensor`. Only the cache's `keys` / `values` tensors are caches here: a
linear-attention layer's conv and recurrent states (Kimi's KDA) are other graph inputs, left
as they are.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, cache_reads, sinks
from dcp_pass.rewrites.axes import B, F, H, S, T
from dcp_pass.rewrites.cache_kinds.static_cache import (
    POSITION_AXIS,
    is_static_cache,
    static_cache_layout,
    whole_read,
)
from dcp_pass.rewrites.cache_reads import buffer_name, buffer_source
from dcp_pass.rewrites.fx_util import call, erase_dead_region, method, set_example_value
from dcp_pass.rewrites.match import (
    MaskTerm,
    MatchContext,
    MlaMatch,
    NearMiss,
    NotAttention,
    Recogniser,
    ScoreTerm,
    SinkTerm,
    register,
)
from dcp_pass.rewrites.recognisers.sdpa import SDPA_TARGETS, sdpa_arguments
from dcp_pass.rewrites.recognisers.softmax import reads_no_cache_rows, softmax_dim

QUERY_ROLES = [B, H, S, F]
SCORE_ROLES = [B, H, S, T]


# ----------------------------------------------------------------------------- K and V


@dataclass
class Projection:
    """`linear(latent cache, weight, bias)` split into `heads` heads of `head_dim` columns;
    the piece uses columns [d0, d1) of each head."""

    weight: fx.Node
    bias: Optional[fx.Node]
    heads: int
    head_dim: int
    cols: tuple[int, int]


@dataclass
class Piece:
    """Feature columns `cols` of K or V: a cache tensor's columns `feat` (or its projection),
    broadcast over the heads when the cache has one head."""

    cols: tuple[int, int]
    buffer: fx.Node
    feat: Optional[tuple[int, int]] = None
    projection: Optional[Projection] = None
    broadcast: bool = False


@dataclass
class KvOperand:
    """K or V of the attention as [batch, heads, position, width], made of `pieces`;
    `heads` is the head count before a repeat_kv expansion over the query heads."""

    node: fx.Node
    pieces: list[Piece]
    heads: int
    width: int
    copies: list[fx.Node] = field(default_factory=list)  # in-place fills of a new_empty (to erase)


def _whole(node: Any) -> bool:
    return isinstance(node, slice) and node == slice(None)


def _is_param(node: Any) -> bool:
    source = buffer_source(node) if isinstance(node, fx.Node) and node.op == "placeholder" else None
    return bool(source) and "_parameters[" in source


def _new_head_axis(node: Any) -> Optional[fx.Node]:
    """x when `node` is x [b, kvh, t, d] with a new axis of size 1 at 2 (`x[:, :, None]`,
    `x[:, :, None, :, :]`, `x[:, :, None, ...]`, `x.unsqueeze(2)`, `x.view(b, kvh, 1, t, d)`)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    base = node.args[0]
    shape, out = axes.shape_of(base), axes.shape_of(node)
    if shape is None or out is None or len(shape) != 4 or len(out) != 5:
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1]
        entries = list(index) if isinstance(index, tuple) else [index]
        if Ellipsis in entries:
            at = entries.index(Ellipsis)
            if Ellipsis in entries[at + 1 :]:
                return None
            real = sum(1 for e in entries if e is not None and e is not Ellipsis)
            entries[at : at + 1] = [slice(None)] * (4 - real)
        entries += [slice(None)] * (5 - len(entries))
        ok = len(entries) == 5 and entries[2] is None and all(_whole(e) for i, e in enumerate(entries) if i != 2)
        return base if ok else None
    if axes.is_method(node, "unsqueeze") or axes.is_function(node, torch.unsqueeze):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return base if isinstance(dim, int) and axes.normalize_dim(dim, 5) == 2 else None
    if axes.is_method(node, "view", "reshape") or axes.is_function(node, torch.reshape):
        same = all(axes.known_equal(a, b) for a, b in zip(shape, (out[0], out[1], out[3], out[4])))
        return base if same and axes.known_equal(out[2], 1) else None
    return None


def _repeat_kv_base(node: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """K or V broadcast from kv heads to the query heads, query head h reading kv head h // n:
    `x[:, :, None].expand(b, kvh, n, t, d).reshape(b, kvh * n, t, d)` (HF's repeat_kv; any
    spelling of the new axis, `flatten(1, 2)` for the reshape) or `x.repeat_interleave(n, dim=1)`
    -> (x, n)."""
    if axes.is_method(node, "repeat_interleave") or axes.is_function(node, torch.repeat_interleave):
        base = node.args[0]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        shape = axes.shape_of(base) if isinstance(base, fx.Node) else None
        if (
            shape is None
            or len(shape) != 4
            or not isinstance(repeats, int)
            or not isinstance(dim, int)
            or axes.normalize_dim(dim, 4) != 1
        ):
            return None
        return base, repeats
    merged = (
        axes.is_method(node, "reshape", "view")
        or axes.is_function(node, torch.reshape)
        or (
            (axes.is_method(node, "flatten") or axes.is_function(node, torch.flatten))
            and tuple(node.args[1:3]) == (1, 2)
        )
    )
    if not merged or not isinstance(node.args[0], fx.Node):
        return None
    expand = node.args[0]
    if not axes.is_method(expand, "expand") or not isinstance(expand.args[0], fx.Node):
        return None
    base = _new_head_axis(expand.args[0])
    if base is None:
        return None
    shape, big, out = axes.shape_of(base), axes.shape_of(expand), axes.shape_of(node)
    if shape is None or big is None or out is None or len(big) != 5 or len(out) != 4:
        return None
    repeat = int(big[2])
    # the kv-head and repeat axes merged, in that order: query head h reads kv head h // repeat
    if not (
        axes.known_equal(out[1], shape[1] * repeat)
        and all(axes.known_equal(a, b) for a, b in zip((out[0], *out[2:]), (shape[0], *shape[2:])))
    ):
        return None
    return base, repeat


def _column_range(node: fx.Node) -> Optional[tuple[fx.Node, tuple[int, int]]]:
    """`split(x, sizes, -1)[i]` or `x[..., a:b]` -> (x, (a, b))."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    src, index = node.args
    if not isinstance(src, fx.Node):
        return None
    if (
        isinstance(index, int)
        and src.op == "call_function"
        and src.target in (torch.split, torch.functional.split)
        or isinstance(index, int)
        and axes.is_method(src, "split")
    ):
        x = src.args[0]
        sizes = src.args[1] if len(src.args) > 1 else src.kwargs.get("split_size_or_sections")
        dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
        width = axes.shape_of(x)[-1]
        if axes.normalize_dim(dim, len(axes.shape_of(x))) != len(axes.shape_of(x)) - 1:
            return None
        if isinstance(sizes, int):
            sizes = [sizes] * -(-width // sizes)
        if not all(isinstance(s, int) for s in sizes):
            return None
        start = sum(sizes[:index])
        return x, (start, min(start + sizes[index], width))
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice):
        cut = index[1]
        width = axes.shape_of(src)[-1]
        if cut.step not in (None, 1) or not all(isinstance(v, (int, type(None))) for v in (cut.start, cut.stop)):
            return None
        lo, hi, _ = cut.indices(width)
        return src, (lo, hi)
    return None


def _projection(node: fx.Node) -> Optional[tuple[fx.Node, Projection]]:
    """`linear(cache, w, b).view(b, t, h, d).transpose(1, 2)` ([batch, heads, position, d])
    -> (cache, projection over all d columns)."""
    if not axes.is_method(node, "transpose") or tuple(axes.normalize_dim(d, 4) for d in node.args[1:3]) not in (
        (1, 2),
        (2, 1),
    ):
        return None
    view = node.args[0]
    if not isinstance(view, fx.Node) or not axes.is_method(view, "view", "reshape"):
        return None
    linear = view.args[0]
    if not (
        isinstance(linear, fx.Node)
        and linear.op == "call_function"
        and linear.target in (torch._C._nn.linear, torch.nn.functional.linear)
    ):
        return None
    cache = linear.args[0]
    weight = linear.args[1]
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    if not is_static_cache(cache) or static_cache_layout(cache)[1] is not None:
        return None
    if not _is_param(weight) or (bias is not None and not _is_param(bias)):
        raise NearMiss("the latent cache is projected by a weight that is not a module parameter", linear)
    cache_shape, out = axes.shape_of(cache), axes.shape_of(view)
    if (
        out is None
        or len(out) != 4
        or not (axes.known_equal(out[0], cache_shape[0]) and axes.known_equal(out[1], cache_shape[POSITION_AXIS]))
    ):
        raise NearMiss("the projected latent cache is not viewed as [batch, position, heads, head_dim]", view)
    heads, head_dim = int(out[2]), int(out[3])
    if heads * head_dim != axes.shape_of(weight)[0]:
        raise NearMiss("the projected latent cache is not split into [heads, head_dim] of its features", view)
    return cache, Projection(weight, bias, heads, head_dim, (0, head_dim))


def _trace_piece(node: fx.Node, cols: tuple[int, int]) -> Piece:
    """The piece of K or V that `node` ([batch, heads, position, width]) is."""
    broadcast = False
    if axes.is_method(node, "expand") and isinstance(node.args[0], fx.Node):
        src_shape = axes.shape_of(node.args[0])
        if src_shape is None or len(src_shape) != 4 or not axes.known_equal(src_shape[1], 1):
            raise NearMiss("a key or value piece expanded along an axis other than a single head", node)
        node, broadcast = node.args[0], True
    if is_static_cache(node):
        if broadcast and static_cache_layout(node)[1] is not None:
            raise NearMiss("a per-head cache expanded over heads", node)
        return Piece(cols, node, None, None, broadcast)
    ranged = _column_range(node)
    if ranged is not None:
        src, (lo, hi) = ranged
        if is_static_cache(src):
            return Piece(cols, src, (lo, hi), None, broadcast)
        found = _projection(src)
        if found is not None:
            cache, proj = found
            proj.cols = (lo, hi)
            return Piece(cols, cache, None, proj, broadcast)
    found = _projection(node)
    if found is not None:
        return Piece(cols, found[0], None, found[1], broadcast)
    raise NearMiss(
        "a key or value is computed from a cache by ops that are not position-wise projections, "
        "column slices and head broadcasts",
        node,
    )


def _filled_pieces(node: fx.Node, reader: fx.Node) -> Optional[tuple[list[Piece], list[fx.Node]]]:
    """`k = x.new_empty(...); k[..., a:b].copy_(p1); k[..., b:c].copy_(p2)` read by `reader`."""
    if not axes.is_method(node, "new_empty", "empty_like", "zeros_like") and not (
        node.op == "call_function" and node.target in (torch.empty, torch.zeros)
    ):
        return None
    width = axes.shape_of(node)[-1]
    pieces, copies = [], []
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for user in node.users:
        if user is reader:
            continue
        ranged = _column_range(user)
        fills = list(user.users)
        if ranged is None or len(fills) != 1 or not axes.is_method(fills[0], "copy_") or fills[0].args[0] is not user:
            raise NearMiss("a key tensor filled by something other than column copies", user)
        if reader is not None and order[fills[0]] > order[reader]:
            raise NearMiss("a key tensor is filled after the attention reads it", fills[0])
        pieces.append(_trace_piece(fills[0].args[1], ranged[1]))
        copies.append(fills[0])
    pieces.sort(key=lambda p: p.cols)
    edges = [0] + [c for p in pieces for c in p.cols] + [width]
    if not pieces or any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2)):
        raise NearMiss("the column copies do not fill the key tensor exactly once", node)
    return pieces, copies


def trace_kv(node: fx.Node, reader: fx.Node) -> KvOperand:
    """K or V ([batch, heads, position, width], read by `reader`) in terms of cache pieces."""
    shape = axes.shape_of(node)
    if shape is None or len(shape) != 4:
        raise NearMiss("a key or value operand is not [batch, heads, position, feature]", node)
    width = int(shape[-1])
    base, repeat = node, 1
    repeated = _repeat_kv_base(node)
    if repeated is not None:
        base, repeat = repeated
    copies: list[fx.Node] = []
    filled = _filled_pieces(base, reader if base is node else None)
    cat = cache_reads._cat_inputs(base)
    if filled is not None:
        pieces, copies = filled
    elif cat is not None:
        tensors, dim = cat
        if axes.normalize_dim(dim, 4) != 3:
            raise NearMiss("keys concatenated along an axis other than the feature axis", base)
        pieces, offset = [], 0
        for t in tensors:
            w = int(axes.shape_of(t)[-1])
            pieces.append(_trace_piece(t, (offset, offset + w)))
            offset += w
    else:
        pieces = [_trace_piece(base, (0, width))]
    heads = int(axes.shape_of(base)[1])
    return KvOperand(node, pieces, heads, width, copies)


# ----------------------------------------------------------------------------- the match record


@dataclass
class PerHeadMatch(MlaMatch):
    """Attention over per-head K/V derived position-wise from static cache tensors."""

    query: Optional[fx.Node] = None
    keys: Optional[KvOperand] = None
    values: Optional[KvOperand] = None
    kv_len: int = 0

    absorbed: Optional["Absorbed"] = None  # set where option absorb_kv_b_proj absorbs this layer
    absorb_decided: bool = False

    def check_plan(self, plan) -> Optional[str]:
        """Why `plan` cannot run this layer (before anything is striped), or None. With
        absorb_kv_b_proj it also settles whether this layer is absorbed: the merged output is
        then the latent width wide (what the passes after the attention read as `v_dim`)."""
        if plan.absorb_kv_b_proj is not False and not self.absorb_decided:
            self.absorb_decided = True
            found = absorbable(self)
            if isinstance(found, Absorbed) and plan.absorb_kv_b_proj is None:
                found = self._absorb_auto(found)
            if isinstance(found, Absorbed):
                self.absorbed, self.v_dim = found, found.rank
            elif plan.absorb_kv_b_proj or self._has_projection():  # "auto" says nothing where nothing is projected
                self.rewrite_notes.append(f"kv_b_proj not absorbed ({found})")
        if plan.head_sharded:
            return (
                f"layer {self.layer}: attention over per-head keys and values ({self.family} form) with "
                f"tp_size > 1: the pass would all-gather the query heads of the DCP group, but this model's "
                f"heads are not sharded across ranks (a Hugging Face model holds every head on every rank). "
                f"Pass options={{'tp_size': 1}} (tp_size defaults to the world size)"
            )
        return None

    def _absorb_auto(self, found: "Absorbed"):
        """`found`, or why option absorb_kv_b_proj "auto" leaves it (options.absorb_kv_b_proj_auto)."""
        from dcp_pass.options import absorb_kv_b_proj_auto

        cache = axes.example_value(found.latent)
        decode = axes.known_equal(axes.shape_of(self.query)[2], 1)
        why = absorb_kv_b_proj_auto(cache.device.type, str(cache.dtype).replace("torch.", ""), decode)
        return found if why is None else why

    def _has_projection(self) -> bool:
        return any(p.projection is not None for p in self.keys.pieces + self.values.pieces)

    def rewrite(self, gm: fx.GraphModule, plan, local_nodes: dict[fx.Node, fx.Node], query_override=None):
        from dcp_pass.rewrites.attention import causal_positions, merge_local_attention, score_mask

        if query_override is not None:
            raise NearMiss("per-head attention takes no replicated query projection")
        graph = gm.graph
        why = self.check_plan(plan)
        if why is not None:
            raise NearMiss(why)
        if self.absorbed is not None:
            return self._rewrite_absorbed(graph, plan, local_nodes, self.absorbed)
        with graph.inserting_before(self.anchor):
            memo: dict = {}
            k = local_kv(graph, self.keys, local_nodes, memo, "k_local")
            v = local_kv(graph, self.values, local_nodes, memo, "v_local")
            q = method(graph, "transpose", self.query, 1, 2, name="q_bshd")
            mask = score_mask(graph, self, q)
            cap = causal_positions(graph, self, q)
            attn = call(
                graph,
                torch.ops.dcp.local_attention.default,
                q,
                k,
                v,
                self.kv_len,
                plan.c,
                plan.rank,
                float(self.scale),
                mask,
                plan.lse_base,
                plan.attn_backend,
                name="local_attention",
                **({"q_pos": cap} if cap is not None else {}),
            )
            merged = merge_local_attention(graph, attn, self, plan)
        self.output.replace_all_uses_with(merged.result)
        erase_dead_region(graph, [self.output] + self.lse_outputs + self.keys.copies + self.values.copies)
        return merged

    def _rewrite_absorbed(self, graph: fx.Graph, plan, local_nodes: dict, ab: "Absorbed"):
        """Absorbed MLA: q_lat = q_nope . W_k per head attends over the latent rows and the
        rotary key as they are cached, and W_v applies to the merged latent output. Exact:
        q_nope . (W_k c_t) = (q_nope W_k) . c_t, and sum_t p_t W_v c_t = W_v sum_t p_t c_t; a
        key bias adds one constant per query row (the softmax and the merge ignore it), a
        value bias is added after the merge (the probabilities sum to 1)."""
        from dcp_pass.rewrites.attention import CANON_Q, causal_positions, merge_local_attention, score_mask

        proj, nope, rope, v = ab.projection, ab.nope, ab.rope, ab.v_dim

        def value_half(merged: fx.Node) -> fx.Node:
            result = call(graph, torch.einsum, "bshr,hvr->bshv", merged, w_v, name="merged_v")
            # [B, S, H, v]: the model's attention output, reordered (project_before_merge reads it)
            result.meta["example_value"] = axes.example_value(self.output).permute(
                *[self.out_roles.index(r) for r in CANON_Q]
            )
            if proj.bias is not None:
                b = method(graph, "view", proj.bias, proj.heads, proj.head_dim)
                b_v = call(graph, operator.getitem, b, (slice(None), slice(nope, nope + v)), name="b_v")
                for node in (b, b_v):
                    set_example_value(node)
                result = call(graph, operator.add, result, b_v, name="merged_v_bias")
            return result

        with graph.inserting_before(self.anchor):
            w = method(graph, "view", proj.weight, proj.heads, proj.head_dim, -1, name="kv_b_heads")
            w_k = call(graph, operator.getitem, w, (slice(None), slice(0, nope)), name="w_k")
            w_v = call(graph, operator.getitem, w, (slice(None), slice(nope, nope + v)), name="w_v")
            for node in (w, w_k, w_v):  # the value projection's weight is read by project_before_merge
                set_example_value(node)
            q = method(graph, "transpose", self.query, 1, 2, name="q_bshd")
            q_nope = call(graph, operator.getitem, q, (Ellipsis, slice(0, nope)), name="q_nope")
            q_rope = call(graph, operator.getitem, q, (Ellipsis, slice(nope, nope + rope)), name="q_rope")
            q_lat = call(graph, torch.einsum, "bshd,hdr->bshr", q_nope, w_k, name="q_lat")
            kv = call(graph, operator.getitem, local_nodes[ab.latent], (slice(None), 0), name="kv_local")
            pe = call(graph, operator.getitem, local_nodes[ab.rotary], (slice(None), 0), name="pe_local")
            mask = score_mask(graph, self, q_lat)
            cap = causal_positions(graph, self, q_lat)
            attn = call(
                graph,
                torch.ops.dcp.mla_local_attention.default,
                q_lat,
                q_rope,
                kv,
                pe,
                kv_len=self.kv_len,
                c=plan.c,
                rank=plan.rank,
                v_dim=ab.rank,
                scale=float(self.scale),
                mask=mask,
                lse_base=plan.lse_base,
                backend=plan.attn_backend,
                name="local_attention",
                **({"q_pos": cap} if cap is not None else {}),
            )
            merged = merge_local_attention(graph, attn, self, plan, value_half)
        self.output.replace_all_uses_with(merged.result)
        erase_dead_region(graph, [self.output] + self.lse_outputs + self.keys.copies + self.values.copies)
        self.rewrite_notes.append(f"kv_b_proj absorbed ({flops_note(self, ab, local_nodes)})")
        return merged


@dataclass
class Absorbed:
    """K = W_k(latent) || rotary broadcast, V = W_v(latent), both halves of one kv_b_proj."""

    projection: Projection
    latent: fx.Node
    rotary: fx.Node
    nope: int
    rope: int
    v_dim: int
    rank: int  # the latent width


def absorbable(match: PerHeadMatch):
    """The `Absorbed` structure of `match`'s keys and values, or why it has none."""
    k, v = match.keys.pieces, match.values.pieces
    if len(k) != 2 or len(v) != 1 or k[0].projection is None or k[1].projection is not None or v[0].projection is None:
        return "keys and values are not one kv_b_proj's halves over a latent cache beside a rotary key cache"
    pk, pv = k[0].projection, v[0].projection
    if (k[0].buffer, pk.weight, pk.bias) != (v[0].buffer, pv.weight, pv.bias):
        return "keys and values come from different projections"
    nope, rope = pk.cols[1] - pk.cols[0], k[1].cols[1] - k[1].cols[0]
    if pk.cols != (0, nope) or pv.cols != (nope, pk.head_dim) or k[0].broadcast or v[0].broadcast:
        return "the projection's columns are not the key half then the value half"
    if not k[1].broadcast or k[1].feat is not None or static_cache_layout(k[1].buffer)[1] is not None:
        return "the rotary key is not one cached head broadcast over the query heads"
    rank = int(axes.shape_of(k[0].buffer)[-1])
    return Absorbed(pk, k[0].buffer, k[1].buffer, nope, rope, pk.head_dim - nope, rank)


def flops_note(match: PerHeadMatch, ab: Absorbed, local_nodes: dict) -> str:
    """Multiply-add flops a step on this rank with and without the absorption (this layer)."""
    q_shape = axes.shape_of(match.query)
    rows = axes.shape_of(local_nodes[ab.latent])[POSITION_AXIS]
    try:
        b, h, s, rows = int(q_shape[0]), int(q_shape[1]), int(q_shape[2]), int(rows)
    except TypeError:
        return "flops: symbolic shapes"
    expanded = 2 * b * rows * ab.rank * h * (ab.nope + ab.v_dim) + 2 * b * s * h * rows * (ab.nope + ab.rope + ab.v_dim)
    folded = 2 * b * s * h * ab.rank * (ab.nope + ab.v_dim) + 2 * b * s * h * rows * (2 * ab.rank + ab.rope)
    return f"{expanded} -> {folded} flops a step on this rank"


def local_kv(graph: fx.Graph, operand: KvOperand, local_nodes: dict, memo: dict, name: str) -> fx.Node:
    """This rank's K or V, [batch, local rows, heads, width], from its cache shards: the
    model's position-wise derivation applied to the shard's rows only."""
    parts = []
    for piece in operand.pieces:
        shard = local_nodes[piece.buffer]  # [batch, kv heads, local rows, feature]
        proj = piece.projection
        if proj is None:
            x = shard if piece.feat is None else call(graph, operator.getitem, shard, (Ellipsis, slice(*piece.feat)))
        else:
            key = (piece.buffer, proj.weight, proj.bias)
            if key not in memo:
                latent = call(graph, operator.getitem, shard, (slice(None), 0), name="latent_rows")
                y = call(graph, torch._C._nn.linear, latent, proj.weight, proj.bias, name="kv_rows")
                y = method(graph, "unflatten", y, -1, (proj.heads, proj.head_dim))
                memo[key] = method(graph, "transpose", y, 1, 2, name="kv_heads")
            x = memo[key]
            if proj.cols != (0, proj.head_dim):
                x = call(graph, operator.getitem, x, (Ellipsis, slice(*proj.cols)))
        if piece.broadcast:
            x = method(graph, "expand", x, -1, operand.heads, -1, -1)
        parts.append(x)
    kv = parts[0] if len(parts) == 1 else call(graph, torch.cat, parts, -1)
    return method(graph, "transpose", kv, 1, 2, name=name)


# ----------------------------------------------------------------------------- recognition


def _layer_of(operands: list[KvOperand]) -> str:
    name = buffer_name(operands[0].pieces[0].buffer)
    return name.rsplit(".", 1)[0]


def _check_operands(query: fx.Node, keys: KvOperand, values: KvOperand, anchor: fx.Node) -> int:
    """The global key count; NearMiss when the operands do not fit one attention call."""
    q_shape = axes.shape_of(query)
    if q_shape is None or len(q_shape) != 4:
        raise NearMiss("the query is not [batch, heads, query position, feature]", query)
    pieces = keys.pieces + values.pieces
    lengths = {int(axes.shape_of(p.buffer)[POSITION_AXIS]) for p in pieces}
    k_shape, v_shape = axes.shape_of(keys.node), axes.shape_of(values.node)
    if len(lengths) != 1 or not all(axes.known_equal(s[2], next(iter(lengths))) for s in (k_shape, v_shape)):
        raise NearMiss("keys and values do not cover every position of their caches", anchor)
    if keys.heads != values.heads:
        raise NearMiss(f"keys have {keys.heads} heads and values {values.heads}", anchor)
    if q_shape[1] % keys.heads:
        raise NearMiss(f"{q_shape[1]} query heads do not group over {keys.heads} key heads", anchor)
    if keys.width != q_shape[-1]:
        raise NearMiss("the query and key widths differ", anchor)
    return next(iter(lengths))


def _check_query(query: Any, keys: KvOperand, values: KvOperand, ctx: MatchContext) -> None:
    """The query may depend on earlier layers' caches (through the hidden states), not on
    the caches this attention reads."""
    if not isinstance(query, fx.Node):
        raise NearMiss("the query is not a tensor")
    own = {p.buffer for p in keys.pieces + values.pieces}
    if own & ctx.cache_tensors_under(query):
        raise NearMiss("the query is computed from the cache this attention reads", query)


def _mask_term(mask: Any, kv_len: int, kind: Optional[str] = None) -> list[MaskTerm]:
    if mask is None:
        return []
    if not isinstance(mask, fx.Node):
        raise NearMiss("the attention mask is not a tensor")
    shape = axes.shape_of(mask)
    if shape is None or len(shape) > 4 or not (axes.known_equal(shape[-1], kv_len) or axes.known_equal(shape[-1], 1)):
        raise NearMiss("the attention mask does not cover the cache's positions", mask)
    if kind is None:
        kind = "keep" if axes.example_value(mask).dtype == torch.bool else "additive"
    return [MaskTerm(mask, kind, 1.0, SCORE_ROLES[4 - len(shape) :])]


def _record(
    family: str,
    anchor: fx.Node,
    output: fx.Node,
    query: fx.Node,
    keys: KvOperand,
    values: KvOperand,
    scale: float,
    masks: list[MaskTerm],
    kv_len: int,
    causal: bool = False,
) -> PerHeadMatch:
    buffers = []
    for piece in keys.pieces + values.pieces:
        if piece.buffer not in buffers:
            buffers.append(piece.buffer)
    terms = [ScoreTerm(query, QUERY_ROLES, whole_read(b, keys.node)) for b in buffers]
    value_read = whole_read(values.pieces[0].buffer, values.node)
    out = axes.example_value(output)
    return PerHeadMatch(
        _layer_of([keys]),
        family,
        anchor,
        output,
        terms,
        value_read,
        values.width,
        float(scale),
        masks,
        SCORE_ROLES,
        [B, H, S, F],
        out.dtype,
        causal=causal,
        query=query,
        keys=keys,
        values=values,
        kv_len=kv_len,
    )


def _reads_static_cache(ctx: MatchContext, *nodes: Any) -> bool:
    return any(isinstance(n, fx.Node) and any(is_static_cache(c) for c in ctx.cache_tensors_under(n)) for n in nodes)


class PerHeadSdpa(Recogniser):
    """`scaled_dot_product_attention(q, k, v, attn_mask=...)` over per-head K/V from static caches."""

    name = "per_head_sdpa"
    priority = -1  # before the MLA SDPA form, which would report these calls as near misses

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]

    def match(self, node: fx.Node, ctx: MatchContext) -> PerHeadMatch:
        args = sdpa_arguments(node)
        query, key, value = args["query"], args["key"], args["value"]
        if not all(isinstance(x, fx.Node) for x in (query, key, value)) or not _reads_static_cache(ctx, key, value):
            raise NotAttention()
        if args["dropout_p"] not in (0, 0.0):
            raise NearMiss("dropout in the attention")
        if args["is_causal"] not in (True, False):
            raise NearMiss("is_causal is not a constant")
        keys, values = trace_kv(key, node), trace_kv(value, node)
        _check_query(query, keys, values, ctx)
        _check_mask(args["attn_mask"], keys, values, ctx)
        kv_len = _check_operands(query, keys, values, node)
        scale = args["scale"]
        scale = 1.0 / math.sqrt(axes.shape_of(query)[-1]) if scale is None else scale
        if not isinstance(scale, (int, float)):
            raise NearMiss("the scale is not a constant")
        return _record(
            "per-head sdpa",
            node,
            node,
            query,
            keys,
            values,
            scale,
            _mask_term(args["attn_mask"], kv_len),
            kv_len,
            causal=args["is_causal"],
        )


class PerHeadFlex(Recogniser):
    """`flex_attention(q, k, v, score_mod=..., block_mask=...)` over per-head K/V from static
    caches (Hugging Face's flex path: a BlockMask whose mask_mod holds the causal, padding and
    window conditions, a score_mod that adds a mask or returns the score). The mods become
    one dense additive mask over global key positions, as in the MLA flex form
    (recognisers/flex.py); where the model reads the call's LSE (return_lse, e.g. to fold a
    sink in afterwards), it reads the merged LSE, so the sink counts once, after the merge."""

    name = "per_head_flex"
    priority = -1  # before the MLA flex form, which would report these calls as near misses

    def anchors(self, graph: fx.Graph):
        from dcp_pass.rewrites.recognisers.flex import flex_calls

        return flex_calls(graph)

    def match(self, node: fx.Node, ctx: MatchContext) -> PerHeadMatch:
        from dcp_pass.rewrites.recognisers import flex

        query, key, value, score_mod_node, block_mask, scale, _, score_buffers, mask_buffers = (
            list(node.args) + [None] * 9
        )[:9]
        if not all(isinstance(x, fx.Node) for x in (query, key, value)) or not _reads_static_cache(ctx, key, value):
            raise NotAttention()
        score_mod, mask_mod = flex.flex_mods(node, score_mod_node, block_mask)
        outputs = flex.flex_outputs(node)
        keys, values = trace_kv(key, node), trace_kv(value, node)
        _check_query(query, keys, values, ctx)
        kv_len = _check_operands(query, keys, values, node)
        for buffers in (score_buffers, mask_buffers):  # tensors the mods read (a padding mask, positions)
            for extra in buffers or ():
                _check_mask(extra, keys, values, ctx)
        scale = 1.0 / math.sqrt(axes.shape_of(query)[-1]) if scale is None else scale
        if not isinstance(scale, (int, float)):
            raise NearMiss("the scale is not a constant")
        match = _record("per-head flex", node, outputs[0][0], query, keys, values, scale, [], kv_len)
        # the LSE flex returns with return_lse: base 2, [B, H, S]; the model's uses read the merged LSE
        match.lse_outputs, match.lse_roles, match.lse_out_base = outputs.get(1, []), [B, H, S], "2"
        if score_mod is not None or mask_mod is not None:
            device = axes.example_value(query).device
            match.mask_builder = flex._dense_mask(
                score_mod,
                mask_mod,
                list(score_buffers or ()),
                list(mask_buffers or ()),
                match.value_cache,
                axes.shape_of(query)[1],
                device,
            )
            match.mask_per_head = flex._uses_heads(score_mod, 2) or flex._uses_heads(mask_mod, 1)
        return match


_ADDS = {operator.add, torch.add}
_MULS = {operator.mul, torch.mul}
_DIVS = {operator.truediv, torch.div}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _scores(node: fx.Node, ctx: MatchContext) -> tuple[fx.Node, float, Optional[fx.Node]]:
    """softmax input `matmul(q, kT) * scale + mask` -> (matmul, scale, mask)."""
    mask = None
    if node.op == "call_function" and node.target in _ADDS and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and isinstance(b, fx.Node):
            # a mask may depend on other caches (a sparse-attention index mask from an indexer's
            # cache, or from an earlier layer's); `_check_mask` refuses one that reads this
            # attention's own caches
            scores, mask = (
                (a, b) if _is_score_product(a) or not _is_score_product(b) and ctx.depends_on_cache(a) else (b, a)
            )
            node = scores
    scale = 1.0
    if node.op == "call_function" and node.target in _MULS | _DIVS and len(node.args) == 2:
        a, b = node.args
        if node.target in _DIVS and _number(b):
            node, scale = a, 1.0 / b
        elif _number(b):
            node, scale = a, float(b)
        elif _number(a) and node.target in _MULS:
            node, scale = b, float(a)
    if not (node.op == "call_function" and node.target is torch.matmul):
        raise NearMiss("the attention scores are not matmul(query, keys^T) * scale + mask", node)
    return node, scale, mask


def _is_score_product(node: Any) -> bool:
    """`matmul(q, k^T)`, or it scaled by a constant."""
    if (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target in _MULS | _DIVS
        and len(node.args) == 2
    ):
        tensors = [x for x in node.args if isinstance(x, fx.Node)]
        if len(tensors) == 1 and any(_number(x) for x in node.args):
            node = tensors[0]
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.matmul


def _check_mask(mask: Optional[fx.Node], keys: KvOperand, values: KvOperand, ctx: MatchContext) -> None:
    """A mask computed from the caches this attention reads is not a mask: refuse it."""
    own = {p.buffer for p in keys.pieces + values.pieces}
    if isinstance(mask, fx.Node) and own & ctx.cache_tensors_under(mask):
        raise NearMiss("a term computed from this attention's own cache is added to the attention scores", mask)


def _keys_transposed(node: Any) -> Optional[fx.Node]:
    if isinstance(node, fx.Node) and axes.is_method(node, "transpose"):
        dims = tuple(axes.normalize_dim(d, 4) for d in node.args[1:3])
        if dims in ((2, 3), (3, 2)):
            return node.args[0]
    return None


def _value_matmul(softmax: fx.Node, sink_side: Optional[str] = None) -> fx.Node:
    """The `matmul(probs, v)` the probabilities feed (through casts and eval-mode dropout;
    with a sink, first the slice that drops the sink's column)."""
    node = softmax
    if sink_side is not None:
        node = sinks.sink_column_dropped(node, sink_side)
    for _ in range(4):
        users = list(node.users)
        if len(users) != 1:
            raise NearMiss("the attention probabilities have several uses", node)
        user = users[0]
        if user.op == "call_function" and user.target is torch.matmul and user.args[0] is node:
            return user
        dropout = user.op == "call_function" and user.target is torch.nn.functional.dropout
        if dropout:
            p = user.kwargs.get("p", user.args[1] if len(user.args) > 1 else 0.5)
            training = user.kwargs.get("training", user.args[2] if len(user.args) > 2 else True)
            if p not in (0, 0.0) and training is not False:
                raise NearMiss("attention dropout in training mode", user)
        elif not axes.is_dtype_cast(user):
            raise NearMiss(f"the attention probabilities feed `{user.target}`, not the value matmul", user)
        node = user
    raise NearMiss("no value matmul after the softmax", softmax)


class PerHeadEager(Recogniser):
    """`softmax(q @ k.transpose(2, 3) * scale + mask) @ v` over per-head K/V from static caches."""

    name = "per_head_eager"
    priority = -1  # before the MLA softmax form

    def anchors(self, graph: fx.Graph):
        return [n for n in graph.nodes if softmax_dim(n) is not None]

    def match(self, node: fx.Node, ctx: MatchContext) -> PerHeadMatch:
        if not isinstance(node.args[0], fx.Node) or not _reads_static_cache(ctx, node.args[0]):
            raise NotAttention()
        if reads_no_cache_rows(node.args[0]):  # a mixing matrix's or a pooling's softmax after attention
            raise NotAttention()
        dim = softmax_dim(node)
        if not isinstance(dim, int) or axes.normalize_dim(dim, 4) != 3:
            raise NearMiss("softmax over an axis other than the key positions", node)
        scores, sink, side = sinks.split_sink(sinks.peel_row_max(node.args[0]), ctx.depends_on_cache)
        qk, scale, mask = _scores(scores, ctx)
        query, k_t = qk.args[0], _keys_transposed(qk.args[1])
        if k_t is None:
            raise NearMiss("the scores do not contract the query with keys.transpose(2, 3)", qk)
        pv = _value_matmul(node, side)
        keys, values = trace_kv(k_t, qk.args[1]), trace_kv(pv.args[1], pv)
        _check_query(query, keys, values, ctx)
        _check_mask(mask, keys, values, ctx)
        kv_len = _check_operands(query, keys, values, node)
        match = _record("per-head eager", node, pv, query, keys, values, scale, _mask_term(mask, kv_len), kv_len)
        if sink is not None:
            match.sink = SinkTerm(sink, sinks.sink_roles(sink, SCORE_ROLES))
        return match


register(PerHeadEager())
register(PerHeadSdpa())
register(PerHeadFlex())
