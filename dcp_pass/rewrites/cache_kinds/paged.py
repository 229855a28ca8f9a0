"""Paged KV pools: a pool `[pages, P, D]` read through a per-request block table.

    slots = block_table[b, pos // P] * P + pos % P
    pool.view(-1, D)[slots] = kv                       # or pool[slots // P, slots % P] = kv
    keys = pool[block_table[:b, :n]].flatten(1, 2)[:, :end]     # [b, n * P, D] -> [b, end, D]

The pool is striped by the same owner rule as a flat cache (position p on rank p % c): a model
page of P slots is one virtual page of P / c slots on each of c ranks, so slot v of the
pool lives on rank v % c at local slot v // c, and since P % c == 0 that is position
p % c == rank of every request, whatever pages the block table hands out. Block tables
and slot mappings keep their meaning: each rank gathers its own slots of the same
pages (local position k of a request is global position k * c + rank, as in a flat
shard) and writes only the slots it owns (the others go to one spare slot no read covers).

`PAGED` is the kind's record: its read and write forms, the rank-local gather, the check that
pages split evenly, and its shard (state/shards.py's `paged_shard`); the attention itself is
matched by whichever recogniser sees it (softmax, SDPA).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, cache_reads
from dcp_pass.rewrites.axes import B, F, T
from dcp_pass.rewrites.cache_kinds import flat
from dcp_pass.rewrites.cache_reads import CacheAccess, CacheKind, _Axis, _Piece, cache_layout
from dcp_pass.rewrites.fx_util import call, method, replace_node, set_example_value
from dcp_pass.runtime.decode import layout
from dcp_pass.state import shards

TPAGE, TIN = "pages", "slots"
# sources of a gathered read's axes: table rows, table columns, slots of a page, features,
# and the positions the (pages, slots) axes make once merged
PAGE_LAYOUT = (B, TPAGE, TIN, F, T)


def _pool(node: Any) -> bool:
    return cache_layout(node) == (B, T, F)


def _int_tensor(node: Any, rank: Optional[int] = None) -> bool:
    value = axes.example_value(node)
    return (
        isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and value.dtype != torch.bool
        and (rank is None or value.dim() == rank)
    )


def paged_base(node: fx.Node) -> Optional[_Piece]:
    """`pool[table]` with a 2-D integer table: the start of a paged read."""
    if not (node.op == "call_function" and node.target is operator.getitem and _pool(node.args[0])):
        return None
    index = node.args[1]
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if not (isinstance(index, fx.Node) and _int_tensor(index, 2)):
        return None
    pool, table = node.args[0], index
    rows, cols = axes.shape_of(table)
    _, page, width = axes.shape_of(pool)
    return _Piece(
        pool,
        [_Axis(0), _Axis(1), _Axis(2), _Axis(3)],
        {},
        None,
        layout=PAGE_LAYOUT,
        shape=(rows, cols, page, width, cols * page),
        pages=table,
        page_size=int(page),
        merges={(1, 2): 4},
    )


class PagedWrite(CacheAccess):
    """`pool.view(-1, D)[slots] = value` (`positions`: the pool slot of each written row), or
    `pool[pages, offsets] = value` (`page_offset`: the two index tensors)."""

    page_offset: Optional[tuple[fx.Node, fx.Node]] = None

    def describe(self) -> str:
        if self.page_offset is not None:
            return "pages and in-page offsets (`pool[pages, offsets] = v`)"
        return "pool slots (`pool.view(-1, D)[slots] = v`)"

    def rewrite_write(self, graph: fx.Graph, local: fx.Node, entry) -> fx.Node:
        with graph.inserting_before(self.node):
            slots = self.positions
            if self.page_offset is not None:
                page = axes.shape_of(self.buffer)[1]
                pages, offsets = self.page_offset
                slots = call(graph, operator.add, call(graph, operator.mul, pages, page), offsets, name="pool_slot")
            shard = method(graph, "unsqueeze", local, 0, name="pool_slots")
            rows = method(graph, "unsqueeze", self.value, 0, name="written_slots")
            for node in (shard, rows):  # later passes (device positions) read their shapes
                set_example_value(node)
        args = (shard, rows, slots, entry.c, entry.rank, entry.virtual_capacity, 0)
        return replace_node(graph, self.node, layout.write_tokens_at_, args, name="striped_write")


def _flat_view_of_pool(node: Any) -> Optional[fx.Node]:
    """The pool when `node` is `pool.view(-1, D)` / `pool.reshape(-1, D)` / `pool.flatten(0, 1)`."""
    if not isinstance(node, fx.Node) or not node.args or not _pool(node.args[0]):
        return None
    shape = axes.shape_of(node)
    if axes.is_method(node, "view", "reshape", "flatten") and shape is not None and len(shape) == 2:
        pool_shape = axes.shape_of(node.args[0])
        if axes.known_equal(shape[1], pool_shape[2]):
            return node.args[0]
    return None


def paged_write(node: fx.Node) -> Optional[CacheAccess]:
    if node.op == "call_function" and node.target is operator.setitem:
        target, index, value = node.args
        if not isinstance(value, fx.Node):
            return None
        pool = _flat_view_of_pool(target)
        if pool is not None and isinstance(index, fx.Node) and _int_tensor(index, 1):
            return PagedWrite(node, pool, None, None, None, None, value=value, positions=index)
    if axes.is_method(node, "index_copy_") and len(node.args) == 4 and node.args[1] == 0:
        pool = _flat_view_of_pool(node.args[0])
        if pool is not None and _int_tensor(node.args[2], 1) and isinstance(node.args[3], fx.Node):
            return PagedWrite(node, pool, None, None, None, None, value=node.args[3], positions=node.args[2])
    return None


def pages_and_offsets(write: CacheAccess) -> Optional[PagedWrite]:
    """`cache[a, b] = v` (two index vectors) into a cache that is read as a paged pool: `a`
    are pages and `b` offsets in them (read as a flat cache they are requests and positions)."""
    if write.rows is None:
        return None
    paged = PagedWrite(write.node, write.buffer, None, None, None, None, value=write.value)
    paged.page_offset = (write.rows, write.positions)
    return paged


def local_pages(graph: fx.Graph, local: fx.Node, read: cache_reads.CacheRead, name: str, c: int) -> fx.Node:
    """This rank's slots of the pages the model gathers, as [batch, position, feature]."""
    pages, page, width = axes.shape_of(read.buffer)
    per_rank = page // c
    pool = call(graph, operator.getitem, local, slice(None, pages * per_rank), name="pool_local")
    pool = method(graph, "view", pool, pages, per_rank, width, name="pages_local")
    gathered = call(graph, operator.getitem, pool, read.pages, name="gathered_local")
    rows = method(graph, "flatten", gathered, 1, 2, name=name if read.feat is None else None)
    if read.feat is not None:
        rows = call(graph, operator.getitem, rows, (Ellipsis, slice(*read.feat)), name=name)
    return rows


def check_paged(read: cache_reads.CacheRead, c: int) -> Optional[str]:
    """Why a paged read cannot be striped over `c` ranks (None when it can)."""
    if read.page_size % c:
        return (
            f"the paged pool {cache_reads.buffer_name(read.buffer)} has pages of {read.page_size} slots, not a "
            f"multiple of dcp_size={c}"
        )
    return None


PAGED = CacheKind(
    "paged",
    "a paged pool read through a block table",
    shards.PAGED,
    local_pages,
    read_base=paged_base,
    write_form=paged_write,
    write_conversions=((flat.FLAT, pages_and_offsets),),  # `cache[a, b] = v`: (page, offset) here
    stripe_check=check_paged,
    layer_note=", paged pool",
)
