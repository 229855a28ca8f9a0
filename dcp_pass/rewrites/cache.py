"""Striped cache writes and installation of the rank-local cache storage.

The model's full-size cache buffer stays a module buffer (so Dynamo's guards and the
model code are untouched), but its storage is released: the backend owns a compacted
shard `[max_batch, ceil(max_seq / c) + 1, D]` per rank (one spare row), keyed by the
buffer object and reused by every later recompile. The graph takes the shard as a
trailing static input, resolved per call from the buffer passed (see backend.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from dcp_pass.report import log
from dcp_pass.rewrites.match import CacheAccess
from dcp_pass.runtime import layout


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
    if owns_storage(buffer):
        # Shape, stride and dtype stay, so Dynamo's guards on the buffer still pass.
        buffer.untyped_storage().resize_(0)
    else:
        # The storage also backs other tensors (e.g. latent and rotary caches carved out of
        # one allocation): releasing it would destroy them. Keep it; only this buffer's
        # rows move to the shard.
        log.warning("dcp_pass: %s shares its storage with other tensors; its full-size memory is kept",
                    entry.name)
        entry.full_nbytes = entry.local_nbytes  # report no saving that did not happen
    _LOCAL_CACHES[id(buffer)] = entry


def owns_storage(buffer: torch.Tensor) -> bool:
    """Whether `buffer` is the whole of its storage (so releasing it frees nothing else)."""
    storage = buffer.untyped_storage()
    return buffer.storage_offset() == 0 and storage.nbytes() == buffer.numel() * buffer.element_size()


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


def rewrite_write(graph: fx.Graph, write: CacheAccess, local: fx.Node, entry: LocalCache) -> fx.Node:
    """`buffer[:b, s:e(, f0:f1)] = v` -> `write_owned_tokens_(shard, v, s, c, rank, capacity, f0)`,
    `buffer[:b, positions(, f0:f1)] = v` -> `write_tokens_at_(shard, v, positions, ...)`.

    Traceable runtime functions, not custom ops: the inner compiler sees (and fuses) the
    plain tensor ops inside, with no opaque call on the decode path. Both check the
    capacity themselves (a constant start fails while the graph is traced).
    """
    if write.positions is not None:
        fn, where = layout.write_tokens_at_, write.positions
    else:
        fn, where = layout.write_owned_tokens_, write.start
    args = (local, write.value, where, entry.c, entry.rank, entry.virtual_capacity, write.feat[0] if write.feat else 0)
    with graph.inserting_before(write.node):
        new = graph.create_node("call_function", fn, args, {}, name="striped_write")
    write.node.replace_all_uses_with(new)
    graph.erase_node(write.node)
    return new
