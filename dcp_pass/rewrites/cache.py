"""Striped cache writes and installation of the rank-local cache storage.

The model's full-size cache buffer stays a module buffer (so Dynamo's guards and the
model code are untouched), but its storage is released: the backend owns a compacted
shard `[max_batch, ceil(max_seq / c), D]` per rank, keyed by the buffer object and
reused by every later recompile. The graph reads and writes that shard through a
`get_attr` buffer of the compiled GraphModule.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

import operator

from dcp_pass.rewrites import axes
from dcp_pass.rewrites.match import CacheAccess
from dcp_pass.runtime import layout
from dcp_pass.runtime import ops as _ops  # noqa: F401  (registers torch.ops.dcp.*)


class DcpCacheError(RuntimeError):
    """A cache buffer was striped earlier but a graph uses it in a way DCP cannot serve."""


@dataclass
class LocalCache:
    """This rank's shard of one model cache buffer."""

    full_ref: "weakref.ref[torch.Tensor]"
    local: torch.Tensor
    virtual_capacity: int  # positions of the original buffer (its dim 1)
    c: int
    rank: int
    full_nbytes: int
    name: str

    @property
    def local_nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


_LOCAL_CACHES: dict[int, LocalCache] = {}


def lookup_local_cache(buffer: torch.Tensor) -> Optional[LocalCache]:
    entry = _LOCAL_CACHES.get(id(buffer))
    if entry is not None and entry.full_ref() is buffer:
        return entry
    return None


def shard_for(buffer: torch.Tensor, c: int, rank: int, name: str) -> LocalCache:
    """This rank's shard of `buffer`: the one installed earlier, or a new copy (nothing released yet)."""
    entry = lookup_local_cache(buffer)
    if entry is not None:
        if (entry.c, entry.rank) != (c, rank):
            raise DcpCacheError(
                f"cache {name} is already striped with dcp_size={entry.c}, rank {entry.rank}; "
                f"it cannot be recompiled with dcp_size={c}, rank {rank}"
            )
        return entry
    shard = layout.shard_full_cache(buffer.detach(), c, rank)  # keeps rows already written
    # One spare row: a windowed write (symbolic start) may touch row (start + n) // c,
    # one past the last owned row when max_seq is a multiple of c. Never read.
    local = shard.new_zeros((shard.shape[0], shard.shape[1] + 1, shard.shape[2]))
    local[:, : shard.shape[1]] = shard
    full_nbytes = buffer.numel() * buffer.element_size()
    return LocalCache(weakref.ref(buffer), local, buffer.shape[1], c, rank, full_nbytes, name)


def install(buffer: torch.Tensor, entry: LocalCache) -> None:
    """Make `entry` the owner of `buffer`'s rows and release the full-size storage (once)."""
    if lookup_local_cache(buffer) is entry:
        return
    # Shape, stride and dtype stay, so Dynamo's guards on the buffer still pass.
    buffer.untyped_storage().resize_(0)
    _LOCAL_CACHES[id(buffer)] = entry
    _mark_static(entry.local)


def _mark_static(local: torch.Tensor) -> None:
    # The shard lives as long as the model: let inductor treat it like a buffer
    # (a fixed address), so CUDA graphs may capture its in-place writes.
    try:
        torch._dynamo.mark_static_address(local)
    except Exception:
        pass


def local_for(buffer: torch.Tensor, c: int, rank: int, name: str) -> LocalCache:
    """The shard to pass for `buffer` on this call; installs one on first sight.

    One compiled graph serves every layer whose module shares the code (Dynamo passes
    each layer's buffers as inputs), so the shard is looked up per call, by buffer.
    """
    entry = lookup_local_cache(buffer)
    if entry is None:
        entry = shard_for(buffer, c, rank, name)
        install(buffer, entry)
    return entry


def is_released(buffer: torch.Tensor) -> bool:
    return lookup_local_cache(buffer) is not None


def static_placeholder(graph: fx.Graph, name: str, example: torch.Tensor) -> fx.Node:
    """A new trailing graph input that holds a long-lived tensor (a shard, a gathered weight).

    Marked static the way Dynamo marks buffers (no source, `_dynamo_static_input_type`),
    so inductor's CUDA graphs may read it in place and capture writes into it.
    """
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name)
    node.meta["example_value"] = example
    node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    node._dynamo_source = None
    return node


def local_cache_placeholder(graph: fx.Graph, index: int, example: torch.Tensor) -> fx.Node:
    """A new trailing graph input carrying the local shard of one cache buffer."""
    return static_placeholder(graph, f"dcp_local_cache_{index}", example)


def _arith(graph: fx.Graph, op, a, b, name=None):
    """`op(a, b)` folded for ints, a graph node for SymInt nodes."""
    if isinstance(a, int) and isinstance(b, int):
        return op(a, b)
    return graph.create_node("call_function", op, (a, b), {}, name=name)


def _seq_len(graph: fx.Graph, value: fx.Node):
    size = axes.shape_of(value)[1]
    return size if isinstance(size, int) else graph.call_method("size", (value, 1))


class CacheCapacityError(IndexError):
    """A write past the cache's positions (the model's max sequence length)."""


def rewrite_write(graph: fx.Graph, write: CacheAccess, local: fx.Node, entry: LocalCache) -> fx.Node:
    """`buffer[:b, s:e(, f0:f1)] = v`  ->  a striped write of v's owned tokens into `local`.

    The tokens of [s, e) that this rank owns are every c-th one, and they land on
    consecutive local rows. With a constant start that is one strided slice copy.
    With a symbolic start (decode after the first step) how many tokens this rank owns
    depends on the value of start, and a shape that depends on it would make Dynamo
    guard on it and recompile every step; so the write covers a fixed window of
    `n // c + 1` local rows from `start // c` and keeps the rows it does not own
    (`torch.where`), with the same shapes for every start.
    """
    c, rank, cap = entry.c, entry.rank, entry.virtual_capacity
    start, value = write.start, write.value
    feat = (slice(*write.feat),) if write.feat is not None else ()
    with graph.inserting_before(write.node):
        seq = _seq_len(graph, value)
        end = _arith(graph, operator.add, start, seq)
        if isinstance(end, int):
            if end > cap or (isinstance(start, int) and start < 0):
                raise CacheCapacityError(
                    f"dcp_pass: cache write of positions [{start}, {end}) is past the cache capacity ({cap} "
                    f"positions); raise the model's max sequence length"
                )
        else:
            graph.call_function(layout.check_write_capacity, (end, cap))
        if isinstance(start, int):
            new = _static_striped_write(graph, write, local, c, rank, start, seq, feat)
        else:
            new = _windowed_striped_write(graph, write, local, c, rank, start, seq, feat)
    write.node.replace_all_uses_with(new)
    graph.erase_node(write.node)
    return new


def _static_striped_write(graph, write, local, c, rank, start, seq, feat):
    first = _arith(graph, operator.mod, rank - start, c, "first_owned")
    count = _arith(graph, operator.floordiv, _arith(graph, operator.add, _arith(graph, operator.sub, seq, first), c - 1),
                   c, "n_owned")
    row0 = _arith(graph, operator.floordiv, _arith(graph, operator.add, start, first), c, "row0")
    row1 = _arith(graph, operator.add, row0, count, "row1")
    owned = graph.create_node("call_function", operator.getitem, (write.value, (slice(None), slice(first, None, c))),
                              {}, name="owned_tokens")
    index = (slice(None, write.bsz), slice(row0, row1)) + feat
    return graph.call_function(operator.setitem, (local, index, owned))


def _windowed_striped_write(graph, write, local, c, rank, start, seq, feat):
    window = _arith(graph, operator.add, _arith(graph, operator.floordiv, seq, c), 1, "window")
    row0 = _arith(graph, operator.floordiv, start, c, "row0")
    row1 = _arith(graph, operator.add, row0, window, "row1")
    # position (relative to start) of the token that would sit on local row row0 + i
    offset = _arith(graph, operator.sub, _arith(graph, operator.add, _arith(graph, operator.mul, row0, c), rank),
                    start, "offset")
    device = axes.example_value(write.value).device
    steps = graph.call_function(torch.arange, (window,), {"device": device})
    cand = graph.create_node("call_function", operator.add,
                             (graph.call_function(operator.mul, (steps, c)), offset), {}, name="token_index")
    owned = graph.create_node("call_function", operator.and_,
                              (graph.call_function(operator.ge, (cand, 0)), graph.call_function(operator.lt, (cand, seq))),
                              {}, name="owned")
    picked = graph.create_node("call_method", "index_select",
                               (write.value, 1, graph.call_method("clamp", (cand, 0, _arith(graph, operator.sub, seq, 1)))),
                               {}, name="owned_tokens")
    index = (slice(None, write.bsz), slice(row0, row1)) + feat
    rows = graph.call_function(operator.getitem, (local, index))
    keep = graph.call_function(operator.getitem, (owned, (None, slice(None), None)))
    merged = graph.create_node("call_function", torch.where,
                               (keep, graph.call_method("to", (picked, axes.example_value(local).dtype)), rows), {},
                               name="window_rows")
    return graph.call_function(operator.setitem, (local, index, merged))
