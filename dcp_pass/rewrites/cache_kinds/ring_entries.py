"""A window ring, then compressed entries, in one buffer (DeepSeek-V4's attention).

    kv_cache [batch, ring + entries, D]          # a module buffer
    kv_cache[:b, start_pos % ring] = kv          # a decode step's key, into its ring slot
    entries = kv_cache[:, ring:]                 # a view the compressor holds (a graph input)
    entries[:b, start_pos // m] = entry          # an entry, when a window of m tokens closes
    scores = q @ kv_cache[:b]^T + index_mask     # attention over the whole buffer

The ring (the last `ring` tokens) is bounded and stays whole on every rank; the entries
grow with the context and are striped by entry index: entry e lives on rank e % c at local
row ring + e // c (the shard: the ring, then the rank's entries, then one spare row:
state/shards.py's `ring_entries_shard`). Ring writes keep their rows; an entry write keeps
only the rank's entries (`layout.write_owned_tokens_` into the shard's entry rows). The
attention attends the shard's rows as they are: the model's mask over the buffer's rows is
mapped to the shard's rows (`shard_mask`), the ring's columns visible on rank 0 only (its
keys counted once in the merge), the other ranks' entries and the spare row never.

A buffer is this kind where a graph writes it at a position modulo a size smaller than its
rows (a decode step's ring write); the size is remembered for the buffer
(`store.RING_ROWS`), so graphs that show no ring write (a prefill) know it too. A
buffer whose rows are all ring (a sliding-window layer) is a flat cache written as a ring,
which the pass leaves whole.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F_nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.axes import B, F, T
from dcp_pass.rewrites.cache_reads import (
    CacheAccess,
    CacheKind,
    CacheRead,
    batch_rows,
    buffer_name,
    module_buffer_layout,
    slice_bounds,
)
from dcp_pass.rewrites.fx_util import call, method, node_value, replace_node, set_example_value
from dcp_pass.runtime.decode import layout
from dcp_pass.state import shards
from dcp_pass.state.store import RING_ROWS, DcpCacheError

KIND = "ring_entries"
_MODULO = {operator.mod, torch.remainder}


def _example(node: fx.Node) -> Optional[torch.Tensor]:
    """The real tensor Dynamo passed for a graph input, or None."""
    grapharg = node.meta.get("grapharg")
    try:
        value = getattr(grapharg, "example", None)
    except Exception:  # a dead weak reference: nothing to say about it
        return None
    return value if isinstance(value, torch.Tensor) else None


def _ring_write_size(buffer: fx.Node) -> Optional[int]:
    """The ring size of a write `buffer[:b, pos % size] = v` in the graph, else None."""
    for use in buffer.users:
        if not (use.op == "call_function" and use.target is operator.setitem and use.args[0] is buffer):
            continue
        index = use.args[1]
        if not (isinstance(index, tuple) and len(index) == 2 and isinstance(index[0], slice)):
            continue
        size = _modulus(index[1])
        if size is not None:
            return size
    return None


def _modulus(index: Any) -> Optional[int]:
    """m when `index` is `x % m` in the graph with an int m (a value in [0, m)), else None."""
    if (
        isinstance(index, fx.Node)
        and index.op == "call_function"
        and index.target in _MODULO
        and len(index.args) == 2
        and isinstance(index.args[1], int)
    ):
        return index.args[1]
    return None


def ring_entries_layout(node: fx.Node) -> Optional[tuple]:
    """(B, T, F) for a module buffer `[batch, ring + entries, D]` with a window ring of fewer
    rows than it has; records the ring's size for the buffer."""
    if module_buffer_layout(node) != (B, T, F):
        return None
    example = _example(node)
    if example is None:
        return None
    if example in RING_ROWS:
        return (B, T, F)
    ring, rows = _ring_write_size(node), axes.shape_of(node)[1]
    if ring is None or not (isinstance(rows, int) and 0 < ring < rows):
        return None
    RING_ROWS[example] = ring
    return (B, T, F)


def ring_rows(buffer: fx.Node) -> int:
    """The ring rows of a buffer of this kind."""
    return RING_ROWS[_example(buffer)]


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def entries_view(node: Any) -> Optional[tuple[fx.Node, int]]:
    """(the buffer, its ring rows) when graph input `node` is a view of a ring-then-entries
    buffer's rows past the ring (`kv_cache[:, ring:]`, held by the compressor), else None."""
    if not (isinstance(node, fx.Node) and node.op == "placeholder") or module_buffer_layout(node) is not None:
        return None
    view = _example(node)
    if view is None or view.dim() != 3:
        return None
    for other in node.graph.nodes:
        if other.op != "placeholder" or other is node:
            continue
        base = _example(other)
        if base is None or base.dim() != 3 or _storage_id(base) != _storage_id(view):
            continue
        if ring_entries_layout(other) is None:
            continue
        ring = RING_ROWS[base]
        if (
            tuple(view.shape) == (base.shape[0], base.shape[1] - ring, base.shape[2])
            and view.stride() == base.stride()
            and view.storage_offset() == base.storage_offset() + ring * base.stride(1)
        ):
            return other, ring
    return None


def _bound_in_ring(bound: Any, ring: int) -> bool:
    """Whether a slice bound lies in [0, ring]: an int, `x % ring`, or a size the trace's
    guards keep there (a prefill's `[:seqlen]` under `if seqlen <= window`)."""
    if isinstance(bound, int):
        return 0 <= bound <= ring
    if _modulus(bound) == ring:
        return True
    value = node_value(bound)
    return (
        isinstance(value, torch.SymInt) and statically_known_true(value >= 0) and statically_known_true(value <= ring)
    )


def _in_ring(index: Any, ring: int) -> bool:
    """Whether a position index addresses rows of the ring only: `pos % ring`, an int below
    it, or a slice whose bounds lie within it (a prefill's last `ring` keys, split at
    `seqlen % ring`)."""
    if isinstance(index, int):
        return 0 <= index < ring
    if isinstance(index, slice):
        bounds = slice_bounds(index)
        return bounds is not None and _bound_in_ring(bounds[0], ring) and _bound_in_ring(bounds[1], ring)
    return _modulus(index) == ring


@dataclass
class RingWrite(CacheAccess):
    """`buffer[:b, slot] = v` into the window ring: the same rows of the shard."""

    index: Any = None

    def describe(self) -> str:
        return "rows of its window ring (`cache[:b, pos % window] = v`)"

    def rewrite_write(self, graph: fx.Graph, local: fx.Node, entry) -> fx.Node:
        return replace_node(graph, self.node, operator.setitem, (local, self.index, self.value), name="ring_write")


@dataclass
class EntriesWrite(CacheAccess):
    """`entries[:b, e] = v` (one entry, `v` [b, D]) or `entries[:b, s:t] = v` through the view
    past the ring: the rank's own entries into the shard's entry rows."""

    ring: int = 0
    one: bool = False  # one entry at index `start`, without its position axis

    def describe(self) -> str:
        return "compressed entries through its view past the ring (`entries[:b, e] = v`)"

    def rewrite_write(self, graph: fx.Graph, local: fx.Node, entry) -> fx.Node:
        with graph.inserting_before(self.node):
            rows = call(graph, operator.getitem, local, (slice(None), slice(self.ring, None)), name="entry_rows")
            value = method(graph, "unsqueeze", self.value, 1, name="written_entry") if self.one else self.value
            for node in (rows, value):  # later passes (device positions) read their shapes
                if node_value(node) is None:
                    set_example_value(node)
        args = (rows, value, self.start, entry.c, entry.rank, entry.virtual_capacity, 0)
        return replace_node(graph, self.node, layout.write_owned_tokens_, args, name="striped_write")


@dataclass
class UnmappedWrite(CacheAccess):
    """A write of a ring-then-entries buffer that is neither ring rows nor entries."""

    def describe(self) -> str:
        return "rows that are neither its window ring nor its entries"

    def why(self, ring: int) -> str:
        return (
            f"{buffer_name(self.buffer)} holds a window ring of {ring} rows and then compressed entries; this "
            f"write addresses neither ring rows (`[:b, pos % {ring}]`) nor entries (through the view past the "
            f"ring), so DCP cannot map it to a rank's rows"
        )

    def as_kind(self, kind: CacheKind) -> Optional[CacheAccess]:
        """A near miss of the attention that reads the buffer (named at this write)."""
        from dcp_pass.rewrites.match import NearMiss

        raise NearMiss(self.why(ring_rows(self.buffer)), self.node)

    def rewrite_write(self, graph: fx.Graph, local: fx.Node, entry) -> fx.Node:
        from dcp_pass.rewrites.match import where_of

        raise DcpCacheError(f"{self.why(entry.ring_rows)} (at {where_of(self.node)}); its storage is striped already")


def ring_entries_write(node: fx.Node) -> Optional[CacheAccess]:
    if not (node.op == "call_function" and node.target is operator.setitem):
        return None
    target, index, value = node.args
    if not isinstance(value, fx.Node) or not isinstance(target, fx.Node):
        return None
    entries = list(index) if isinstance(index, tuple) else [index]
    if ring_entries_layout(target) is not None:
        ring = ring_rows(target)
        bsz = batch_rows(entries[0])
        if len(entries) == 2 and bsz is not None and _in_ring(entries[1], ring):
            return RingWrite(node, target, bsz, None, None, None, value=value, index=index)
        return UnmappedWrite(node, target, None, None, None, None, value=value)
    view = entries_view(target)
    if view is None:
        return None
    buffer, ring = view
    bsz = batch_rows(entries[0]) if len(entries) == 2 else None
    slot = entries[1] if len(entries) == 2 else None
    bounds = slice_bounds(slot)
    if bsz is not None and bounds is not None:
        return EntriesWrite(node, buffer, bsz, bounds[0], bounds[1], None, value=value, ring=ring)
    if bsz is not None and (
        isinstance(slot, int) or isinstance(slot, fx.Node) and not isinstance(node_value(slot), torch.Tensor)
    ):
        return EntriesWrite(node, buffer, bsz, slot, None, None, value=value, ring=ring, one=True)
    return UnmappedWrite(node, buffer, None, None, None, None, value=value)


def local_rows(graph: fx.Graph, local: fx.Node, access: CacheRead, name: str, c: int = 1) -> fx.Node:
    """The read's batch rows of the shard, every row (the ring, the rank's entries, the spare)."""
    first = None if isinstance(access.row0, int) and access.row0 == 0 else access.row0
    return call(graph, operator.getitem, local, (slice(first, access.bsz),), name=name)


def check_whole_read(read: CacheRead, c: int) -> Optional[str]:
    """A read of this kind is mapped to the shard only whole (the ring and every entry)."""
    rows = axes.shape_of(read.buffer)[1]
    if not (isinstance(read.start, int) and read.start == 0 and axes.known_equal(read.end, rows) and read.feat is None):
        return (
            f"{buffer_name(read.buffer)} (a window ring, then compressed entries) is read in part "
            f"(rows {read.start}:{read.end} of {rows}); DCP maps whole reads of it to the rank's rows only"
        )
    return None


def shard_mask(
    graph: fx.Graph, mask: Optional[fx.Node], read: CacheRead, c: int, rank: int, boolean: bool
) -> tuple[fx.Node, int]:
    """(the mask over the shard's rows [B, S, H, rows], the rows): the model's mask over the
    buffer's rows (`mask`, [B, S, H, ring + entries] or broadcastable, additive unless
    `boolean`; None: every row visible) taken at each shard row's row of the buffer. Ring rows
    count on rank 0 only; an entry row counts where it holds entry (row - ring) * c + rank of
    the buffer, the spare row and rows past the last entry never."""
    ring = ring_rows(read.buffer)
    rows = axes.shape_of(read.buffer)[1]
    local = ring + layout.local_capacity(rows - ring, c) + 1
    device = axes.example_value(read.node).device
    if mask is None:
        mask = call(graph, torch.zeros, rows, device=device)
    elif boolean:
        mask = call(graph, torch.where, mask, 0.0, float("-inf"))
    # one more column, never visible, for the rows this rank does not count
    padded = call(graph, F_nn.pad, mask, (0, 1), value=float("-inf"), name="mask_padded")
    row = call(graph, torch.arange, local, device=device, name="shard_row")
    entry = call(graph, operator.add, call(graph, operator.mul, row, c), ring * (1 - c) + rank, name="buffer_row")
    entry = call(graph, torch.where, call(graph, operator.lt, entry, rows), entry, rows)
    ring_row = row if rank == 0 else rows
    column = call(graph, torch.where, call(graph, operator.lt, row, ring), ring_row, entry, name="mask_column")
    return method(graph, "index_select", padded, -1, column, name="mask_shard"), local


RING_ENTRIES = CacheKind(
    KIND,
    "a window ring then compressed entries",
    shards.RING_ENTRIES,
    local_rows,
    layout=ring_entries_layout,
    write_form=ring_entries_write,
    stripe_check=check_whole_read,
    # the report's bytes per token count a buffer row: here one entry, which pools m tokens
    layer_note=", window ring + striped entries (the bytes per token count an entry row, m tokens)",
    shard_mask=shard_mask,
)
