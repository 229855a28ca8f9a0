"""The striped-cache store: which cache tensors DCP striped or deferred, and this rank's shard of each.

Keyed weakly by the tensor object: when a model (or a Hugging Face Cache object) is deleted,
its shards go with it. `shards.py` fills the store, `guards.py` reads it to refuse eager use
of a tensor without full-size data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary


class DcpCacheError(RuntimeError):
    """A cache buffer has no full-size data (striped by DCP, or deferred) and was used as if it had."""


@dataclass(frozen=True)
class ShardKind:
    """The run-time half of a cache kind (the whole kind: rewrites/cache_kinds/): how this
    rank's shard of such a cache tensor is made, and what eager code may do with the tensor
    once it is striped. One record per kind, beside its shard maker (state/shards.py)."""

    name: str
    # (buffer, c, rank, name, packed fp8 layout or None) -> this rank's new shard
    make: Callable[..., "LocalCache"]
    # its shard can hold packed fp8 rows (option kv_cache_dtype): rows by position
    takes_fp8_rows: bool
    # axis 0 of the shard is the batch (a paged pool's is its pages): StripedCacheTensor applies
    # eager batch reorders (beam search) to it
    batch_reorderable: bool
    # an eager zero_() of the striped tensor (a reset of the cache object that holds it,
    # outside any graph: Cache.reset() between generations) zeroes the rank's shard; any other
    # eager use raises
    resettable: bool
    # its tensors are new objects for every generation (a Hugging Face Cache's): a graph
    # compiled for them must guard on the plain tensor class they arrive with, else every new
    # generation's first call would compile the graph again. Their shards are installed
    # (storage released, class changed) at the graph's first call, after Dynamo has built its
    # guards, instead of during the compile; the next call then compiles once for the striped
    # class. No module owns them: there is no owner to guard.
    installed_at_first_call: bool


@dataclass
class LocalCache:
    """This rank's shard of one model cache buffer."""

    local: torch.Tensor
    virtual_capacity: int  # positions of the original buffer (its dim 1)
    c: int
    rank: int
    full_nbytes: int
    name: str
    kind: ShardKind
    # "" (the buffer's dtype) or a packed fp8 layout's spec (runtime/decode/kv_format.py): then
    # `local` is uint8 [..., row_bytes], one packed row per owned position
    kv_format: str = ""
    # leading rows every rank keeps whole (a window ring before compressed entries,
    # state/shards.py's `ring_entries_shard`): bounded, so neither striped nor counted
    ring_rows: int = 0

    @property
    def local_nbytes(self) -> int:
        """Bytes of the rank's striped rows (its rows kept whole, a ring's, not counted)."""
        ring = self.local.shape[0] * self.ring_rows * self.local.shape[-1] if self.ring_rows else 0
        return (self.local.numel() - ring) * self.local.element_size()

    @property
    def token_rows(self) -> Optional[int]:
        """Token rows (requests x positions) the buffer holds without DCP, for the report's bytes
        per token; None for a kind whose axis 0 is not the batch (a paged pool's pages)."""
        if not self.kind.batch_reorderable:
            return None
        return self.local.shape[0] * self.virtual_capacity


@dataclass
class DeferredCache:
    """A cache buffer created without storage by `dcp_pass.deferred_caches()`."""

    name: str
    fill: Optional[float]  # 0.0 for torch.zeros, None for torch.empty
    owner: str  # class name of the module that registered it


# buffer -> its LocalCache (installed: the buffer's own storage is released)
STRIPED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# buffer -> its DeferredCache (built without storage, not striped yet)
DEFERRED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# buffer -> its LocalCache, made at compile and installed at the graph's first call
PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()
# buffer -> the rows of its window ring, for a buffer that holds a ring and then compressed
# entries (rewrites/cache_kinds/ring_entries.py records it where a graph shows the ring)
RING_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def lookup_local_cache(buffer: torch.Tensor) -> Optional[LocalCache]:
    return STRIPED.get(buffer)


def is_deferred(buffer: torch.Tensor) -> bool:
    return buffer in DEFERRED


def is_released(buffer: torch.Tensor) -> bool:
    """Whether `buffer` has no full-size data (striped, or deferred and not materialized)."""
    return buffer in STRIPED or buffer in DEFERRED


def describe(buffer: torch.Tensor) -> tuple[str, str]:
    """(name, why it has no full-size data) for messages."""
    entry = STRIPED.get(buffer)
    if entry is not None:
        kept = (
            f"its window ring of {entry.ring_rows} rows and only the entries e after it with e % {entry.c} == "
            f"{entry.rank}"
            if entry.ring_rows
            else f"only positions p with p % {entry.c} == {entry.rank}"
        )
        return entry.name, (
            f"DCP striped it (dcp_size={entry.c}): this rank keeps {kept} and its full-size storage was released"
        )
    info = DEFERRED.get(buffer)
    if info is not None:
        return info.name, "it was built under dcp_pass.deferred_caches() and was never allocated"
    return "?", "?"
