"""The allocation of a Hugging Face static cache layer's tensors inside a compiled graph.

`StaticLayer.lazy_initialization` runs on the layer's first update, which under
`generate(cache_implementation="static")` is inside the compiled prefill:

    keys = torch.zeros((b, kv heads, T, d), dtype=..., device=...)       # likewise values
    cache_position = torch.arange(n) + layer.cumulative_length
    keys.index_copy_(2, cache_position, key_states)                      # or keys[:, :, cache_position] = ...

The layer is named by the `cumulative_length` input its write positions come from, the
tensor by the attribute it is assigned to (Dynamo names the node after it). The source
name given (`L['kwargs']['cache'].layers[0].keys`) is the one the later graphs take the
tensor by, so the per-head recognisers read it as a static cache (rewrites/cache_kinds/static_cache.py)
tensor; rewrites/allocation.py does the rest.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch.fx as fx

from dcp_pass.rewrites import allocation, axes, fx_util

POSITION_AXIS = 2
_LENGTH_SOURCE = re.compile(r"^(.*\.layers\[\d+\])\.cumulative_length$")
_ATTRIBUTE = re.compile(r"^(keys|values)(_\d+)?$")
_SEARCH_DEPTH = 6  # nodes between the write positions and the cumulative_length input


def _write_positions(node: fx.Node) -> Optional[fx.Node]:
    """The positions of a write into `node` along the position axis, if one exists."""
    for user in node.users:
        if axes.is_method(user, "index_copy_") and user.args[0] is node and len(user.args) >= 3:
            dim = user.args[1]
            if (
                isinstance(dim, int)
                and axes.normalize_dim(dim, 4) == POSITION_AXIS
                and isinstance(user.args[2], fx.Node)
            ):
                return user.args[2]
        if user.op == "call_function" and user.target is operator.setitem and user.args[0] is node:
            index = user.args[1]
            if (
                isinstance(index, tuple)
                and len(index) == 3
                and isinstance(index[2], fx.Node)
                and all(isinstance(i, slice) and i == slice(None) for i in index[:2])
            ):
                return index[2]
    return None


def _layer_source(positions: fx.Node) -> Optional[str]:
    """`L[...].layers[i]` of the `cumulative_length` input the positions are computed from."""
    work: list[Any] = [(positions, 0)]
    seen = set()
    while work:
        node, depth = work.pop()
        if node in seen or depth > _SEARCH_DEPTH:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found = _LENGTH_SOURCE.match(fx_util.dynamo_source_name(node) or "")
            if found:
                return found.group(1)
            continue
        work.extend((n, depth + 1) for n in node.all_input_nodes)
    return None


def static_cache_allocation(node: fx.Node) -> Optional[str]:
    """The source name of the static cache layer tensor that `node` (a factory call) creates, or None."""
    shape = axes.shape_of(node)
    attribute = _ATTRIBUTE.match(node.name)
    if shape is None or len(shape) != 4 or attribute is None:
        return None
    positions = _write_positions(node)
    layer = _layer_source(positions) if positions is not None else None
    return f"{layer}.{attribute.group(1)}" if layer is not None else None


allocation.ALLOCATION_FORMS.append(static_cache_allocation)
