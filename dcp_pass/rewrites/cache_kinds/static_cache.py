"""The Hugging Face static cache as a cache kind: its tensors, how they are read and written.

`generate(cache_implementation="static")` keeps the caches in a Cache object passed into the
forward: its tensors are graph inputs (`L['kwargs']['cache'].layers[0].keys`,
`[batch, kv heads, position, feature]`), written with `index_copy_(2, cache_position, new)`
and read whole (the mask hides unwritten positions). `STATIC_CACHE` is the kind's record: their
layout and write form, and their shard (state/shards.py's `static_cache_shard`); the attention
over them, and its reads of their shards, are recognisers/per_head.py's.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.axes import B, F, H, T
from dcp_pass.rewrites.cache_reads import CacheAccess, CacheKind, CacheRead, buffer_source
from dcp_pass.rewrites.fx_util import replace_node
from dcp_pass.runtime.decode import layout
from dcp_pass.state import shards

POSITION_AXIS = shards.STATIC_CACHE_POSITION_AXIS  # [batch, kv heads, position, feature]

# A Hugging Face static cache layer's tensors, as Dynamo names graph inputs reached through it
STATIC_CACHE_SOURCE = re.compile(r"\.layers\[\d+\]\.(keys|values)$")


# ----------------------------------------------------------------------------- the cache tensors


def static_cache_layout(node: fx.Node) -> Optional[tuple]:
    """[batch, kv heads (None when 1), position, feature] for a static cache layer's tensor."""
    source = buffer_source(node)
    shape = axes.shape_of(node)
    if not source or not STATIC_CACHE_SOURCE.search(source) or shape is None or len(shape) != 4:
        return None
    return (B, None if axes.known_equal(shape[1], 1) else H, T, F)


def is_static_cache(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder" and static_cache_layout(node) is not None


def whole_read(buffer: fx.Node, operand: fx.Node) -> CacheRead:
    """A whole static cache tensor read by the attention (every position; the mask hides the
    unwritten ones)."""
    shape = axes.shape_of(buffer)
    return CacheRead(operand, buffer, shape[0], 0, shape[POSITION_AXIS], None, [B, H, T, F], kind=STATIC_CACHE)


@dataclass
class IndexCopyWrite(CacheAccess):
    """`cache.index_copy_(2, positions, new)` (or `cache[:, :, positions] = new`)."""

    def describe(self) -> str:
        return "`index_copy_` along its position axis"

    def rewrite_write(self, graph: fx.Graph, local: fx.Node, entry) -> fx.Node:
        args = (local, self.value, self.positions, POSITION_AXIS, entry.c, entry.rank, entry.virtual_capacity)
        return replace_node(graph, self.node, layout.write_rows_at_, args, name="striped_write")


def index_copy_write(node: fx.Node) -> Optional[IndexCopyWrite]:
    if axes.is_method(node, "index_copy_") and is_static_cache(node.args[0]):
        buffer, dim, positions, value = (list(node.args) + [None] * 4)[:4]
        if (
            isinstance(dim, int)
            and axes.normalize_dim(dim, 4) == POSITION_AXIS
            and isinstance(positions, fx.Node)
            and isinstance(value, fx.Node)
        ):
            return IndexCopyWrite(node, buffer, axes.shape_of(buffer)[0], None, None, None, value, positions)
    if node.op == "call_function" and node.target is operator.setitem and is_static_cache(node.args[0]):
        buffer, index, value = node.args
        if (
            isinstance(index, tuple)
            and len(index) == 3
            and index[:2] == (slice(None),) * 2
            and isinstance(index[2], fx.Node)
            and isinstance(value, fx.Node)
        ):
            return IndexCopyWrite(node, buffer, axes.shape_of(buffer)[0], None, None, None, value, index[2])
    return None


STATIC_CACHE = CacheKind(
    "static_cache",
    "a Hugging Face static cache tensor",
    shards.STATIC_CACHE,
    None,
    layout=static_cache_layout,
    write_form=index_copy_write,
)
