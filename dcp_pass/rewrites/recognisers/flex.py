"""MLA written with `flex_attention` (a score_mod, a BlockMask, or both).

    k = cache[:b, :end].unsqueeze(1); v = k[..., :rank]
    flex_attention(q, k, v, score_mod=..., block_mask=..., scale=s, enable_gqa=True)

Dynamo captures the call as the `flex_attention` higher-order op whose score_mod and
mask_mod are small graphs of (score, b, h, q_idx, kv_idx). A score_mod that only adds a
bias to the score or sets it to -inf where a condition holds (causal, sliding window,
ALiBi-style biases, prefix masks) is `score + bias(b, h, q_idx, kv_idx)`, and the mask_mod
is a condition of the indices; both are evaluated densely in the graph over the keys the
call reads (global key positions, the same indices flex uses) and become one additive mask,
which the shard-local attention stripes like the keys. The block mask's sparsity tensors
only skip work the mask_mod already excludes. A score_mod that does anything else with
the score (tanh soft-capping, a product with the score) cannot be expressed as a mask: a
near miss names that op and its source line. Where the model reads the call's LSE
(`return_lse=True`, e.g. to fold an attention sink in afterwards), it reads the merged LSE.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.axes import B, F, H, S
from dcp_pass.rewrites.cache_reads import ReadRefused, trace_cache_read
from dcp_pass.rewrites.fx_util import call, method
from dcp_pass.rewrites.match import (
    MatchContext,
    MlaMatch,
    NearMiss,
    NotAttention,
    Recogniser,
    ScoreTerm,
    buffer_name,
    register,
    source_of,
)
from dcp_pass.rewrites.recognisers.sdpa import KV_ROLES, SCORE_ROLES, _query_parts
from dcp_pass.rewrites.recognisers.softmax import check_terms, check_value_read

_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)
_ADDS, _SUBS = {operator.add, torch.add}, {operator.sub, torch.sub}
_WHERES = {torch.where}


def flex_calls(graph: fx.Graph) -> list[fx.Node]:
    """The graph's flex_attention calls (none where this torch has no flex_attention)."""
    if _FLEX is None:
        return []
    return [n for n in graph.nodes if n.op == "call_function" and n.target is _FLEX]


def flex_mods(node: fx.Node, score_mod_node: Any, block_mask: Any) -> tuple[Optional[fx.GraphModule], Any]:
    """(score_mod, mask_mod) of a flex_attention call, as the graph's submodules: score_mod None
    when absent or the identity; a score_mod that biases scores by something other than a mask
    is a near miss."""
    gm = node.graph.owning_module
    score_mod = _submodule(gm, score_mod_node)
    if score_mod is not None:
        why = _score_is_biased(score_mod)
        if why is not None:
            raise NearMiss(why, node)
        if not any(u.op == "call_function" for u in score_mod.graph.nodes):
            score_mod = None  # the identity
    mask_mod = _submodule(gm, block_mask[-1]) if isinstance(block_mask, tuple) and block_mask else None
    return score_mod, mask_mod


def flex_outputs(node: fx.Node) -> dict[int, list[fx.Node]]:
    """The uses of a flex_attention call's outputs by index (0: the attention output, used once;
    1: its LSE); any other use is a near miss."""
    outputs: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
            raise NearMiss("flex_attention's outputs are used other than one by one", user)
        outputs.setdefault(user.args[1], []).append(user)
    if set(outputs) - {0, 1}:
        raise NearMiss("flex_attention's row maxima (return_aux max_scores) are used by the model", node)
    if len(outputs.get(0, [])) != 1:
        raise NearMiss("flex_attention's attention output is not used once", node)
    return outputs


def _submodule(gm: fx.GraphModule, node: Any) -> Optional[fx.GraphModule]:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        sub = getattr(gm, node.target, None)
        return sub if isinstance(sub, fx.GraphModule) else None
    return None


def _score_is_biased(score_mod: fx.GraphModule) -> Optional[str]:
    """None when score_mod(score, ...) == score + bias(...) (bias may be -inf); else why not."""
    placeholders = [n for n in score_mod.graph.nodes if n.op == "placeholder"]
    kind: dict[fx.Node, str] = {placeholders[0]: "score"}  # "score": score + bias; "free": no score

    def of(x: Any) -> str:
        if isinstance(x, fx.Node):
            return kind.get(x, "free")
        return "-inf" if isinstance(x, float) and x == -math.inf else "free"

    for node in score_mod.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            result = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
            return None if of(result) == "score" else "score_mod does not return the score (plus a bias)"
        inputs = [of(a) for a in node.args] + [of(v) for v in node.kwargs.values()]
        if "score" not in inputs:
            continue
        target = node.target
        # `alpha` scales the second operand (add(b, s, alpha=2) is b + 2 s): only the plain sum is a bias
        plain = len(node.args) == 2 and not node.kwargs
        if node.op == "call_function" and target in _ADDS and plain and sorted(inputs[:2]) == ["free", "score"]:
            kind[node] = "score"
        elif node.op == "call_function" and target in _SUBS and plain and inputs[:2] == ["score", "free"]:
            kind[node] = "score"
        elif (
            node.op == "call_function"
            and target in _WHERES
            and len(node.args) == 3
            and inputs[0] == "free"
            and set(inputs[1:3]) <= {"score", "-inf"}
        ):
            kind[node] = "score"
        else:
            what = getattr(target, "__name__", str(target)) if node.op == "call_function" else f".{target}()"
            where = source_of(node)
            return (
                f"score_mod applies `{what}` to the score"
                + (f" (at {where})" if where else "")
                + ": only a bias added to the score or a -inf mask can be striped"
            )
    return "score_mod has no output"


def _inline(graph: fx.Graph, sub: fx.GraphModule, inputs: list) -> fx.Node:
    """Copy `sub`'s graph into `graph` with its placeholders bound to `inputs`; returns its output."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            out = node.args[0]
            return env[out[0]] if isinstance(out, (list, tuple)) else env[out]
        elif node.op == "get_attr":
            raise NearMiss("a flex_attention mod holds module attributes")
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    raise NearMiss("a flex_attention mod has no output")


def _uses_heads(mod: Optional[fx.GraphModule], head_arg: int) -> bool:
    if mod is None:
        return False
    placeholders = [n for n in mod.graph.nodes if n.op == "placeholder"]
    return len(placeholders) > head_arg and bool(placeholders[head_arg].users)


def _dense_mask(score_mod, mask_mod, score_buffers, mask_buffers, read, heads: int, device):
    """A builder of the additive [B, S, H, T] mask (each axis possibly 1) that score_mod and
    mask_mod amount to, over the keys `read` reads and the call's queries."""

    def build(graph: fx.Graph, q_lat: fx.Node) -> Optional[fx.Node]:
        keys = read.end if not read.windowed else call(graph, operator.sub, read.end, read.start, name="flex_keys")
        rows = method(graph, "size", q_lat, 1, name="flex_query_rows")

        def index(size, axis, name):
            shape = [1, 1, 1, 1]
            shape[axis] = -1
            idx = call(graph, torch.arange, size, dtype=torch.int32, device=device, name=f"flex_{name}")
            return method(graph, "view", idx, *shape, name=f"flex_{name}_4d")

        batch = (
            read.bsz
            if isinstance(read.row0, int) and read.row0 == 0
            else call(graph, operator.sub, read.bsz, read.row0, name="flex_batch")
        )
        indices = [index(batch, 0, "b"), index(heads, 1, "h"), index(rows, 2, "q"), index(keys, 3, "kv")]
        total = None
        if score_mod is not None:
            zero = call(graph, torch.zeros, (), dtype=torch.float32, device=device, name="flex_zero_score")
            bias = _inline(graph, score_mod, [zero, *indices, *score_buffers])
            total = method(graph, "float", bias, name="flex_score_bias")
        if mask_mod is not None:
            keep = _inline(graph, mask_mod, [*indices, *mask_buffers])
            additive = call(graph, torch.where, keep, 0.0, float("-inf"), name="flex_mask_f32")
            total = additive if total is None else call(graph, operator.add, total, additive, name="flex_mask_sum")
        if total is None:
            return None
        return method(graph, "permute", total, 0, 2, 1, 3, name="flex_mask_bshd")  # [B, H, S, T] -> [B, S, H, T]

    return build


class FlexRecogniser(Recogniser):
    name = "flex"

    def anchors(self, graph: fx.Graph):
        return flex_calls(graph)

    def match(self, node: fx.Node, ctx: MatchContext) -> MlaMatch:
        query, key, value, score_mod_node, block_mask, scale, kernel_options, score_buffers, mask_buffers = (
            list(node.args) + [None] * 9
        )[:9]
        if not all(isinstance(x, fx.Node) for x in (query, key, value)):
            raise NotAttention()
        if not ctx.depends_on_cache(key) and not ctx.depends_on_cache(value):
            raise NotAttention(
                "flex_attention over keys and values computed in the graph, not read from a cache "
                "(MHA/GQA over per-head K/V): not MLA decode, left unchanged"
            )
        score_mod, mask_mod = flex_mods(node, score_mod_node, block_mask)
        outputs = flex_outputs(node)
        users = outputs[0]
        try:
            keys = trace_cache_read(key)
            values = trace_cache_read(value)
        except ReadRefused as why:
            raise NearMiss(f"the keys or values are not a cache read ({why})", key) from None
        if keys[0].roles != KV_ROLES or values[0].roles != KV_ROLES or len(values) != 1:
            raise NearMiss("the keys or values are not [batch, one head, position, feature] over the cache", key)
        q_shape = axes.shape_of(query)
        terms = [ScoreTerm(q, roles, read, cols) for (q, roles, cols), read in zip(_query_parts(query, keys), keys)]
        check_terms(terms, node)
        v_width = check_value_read(terms, values[0])
        if scale is None:
            scale = 1.0 / math.sqrt(q_shape[-1])
        device = axes.example_value(query).device
        match = MlaMatch(
            buffer_name(keys[0].buffer).rsplit(".", 1)[0],
            self.name,
            node,
            users[0],
            terms,
            values[0],
            v_width,
            float(scale),
            [],
            SCORE_ROLES,
            [B, H, S, F],
            axes.example_value(users[0]).dtype,
        )
        # the LSE flex returns with return_lse: base 2 (the public function scales it by ln 2
        # after the call), [B, H, S]; the model's uses of it read the merged LSE
        match.lse_outputs, match.lse_roles, match.lse_out_base = outputs.get(1, []), [B, H, S], "2"
        if score_mod is not None or mask_mod is not None:
            match.mask_builder = _dense_mask(
                score_mod, mask_mod, list(score_buffers or ()), list(mask_buffers or ()), values[0], q_shape[1], device
            )
            match.mask_per_head = _uses_heads(score_mod, 2) or _uses_heads(mask_mod, 1)
        return match


register(FlexRecogniser())
