"""Caches with rows by position: a module buffer `[batch, position, feature]`, or the same with
a singleton head axis (`[batch, position, 1, feature]`, `[batch, 1, position, feature]`).

Written by slices, position tensors or one position per request (`cache_reads.as_cache_write`;
the striped write is `cache_reads.rewrite_write`); each rank's shard holds the rows of the
positions it owns (state/shards.py's `flat_shard`, also as packed fp8 rows).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from dcp_pass.rewrites.axes import B, F, T
from dcp_pass.rewrites.cache_reads import CacheKind, CacheRead, as_cache_write, cache_layout, module_buffer_layout
from dcp_pass.rewrites.fx_util import call
from dcp_pass.state import shards


def local_rows(graph: fx.Graph, local: fx.Node, access: CacheRead, name: str, c: int = 1) -> fx.Node:
    """The batch rows (and feature columns) of a shard as [batch, position, feature]; key
    rows are bounded by the op. A singleton head axis of the cache is indexed away."""
    index: list = []
    for role in cache_layout(access.buffer):
        if role == B:
            first = None if isinstance(access.row0, int) and access.row0 == 0 else access.row0
            index.append(slice(first, access.bsz))
        elif role == F:
            index.append(slice(None) if access.feat is None else slice(*access.feat))
        else:
            index.append(slice(None) if role == T else 0)
    while index and index[-1] == slice(None):
        index.pop()
    return call(graph, operator.getitem, local, tuple(index), name=name)


FLAT = CacheKind(
    "flat", "rows by position", shards.FLAT, local_rows, layout=module_buffer_layout, write_form=as_cache_write
)
