"""The striped-cache store: which cache tensors DCP striped or deferred, and this rank's shard of each.

Keyed weakly by the tensor object: when a model (or a Hugging Face Cache object) is deleted,
its shards go with it. `shards.py` fills the store, `guards.py` reads it to refuse eager use
of a tensor without full-size data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary


class DcpCacheError(RuntimeError):
    """A cache buffer has no full-size data (striped by DCP, or deferred) and was used as if it had."""


@dataclass
class LocalCache:
    """This rank's shard of one model cache buffer."""

    local: torch.Tensor
    virtual_capacity: int  # positions of the original buffer (its dim 1)
    c: int
    rank: int
    full_nbytes: int
    name: str
    kind: str = "flat"  # how its rows are laid out (see RESETTABLE below; shards.SHARD_MAKERS)
    # "" (the buffer's dtype) or a packed fp8 layout's spec (runtime/decode/kv_format.py): then
    # `local` is uint8 [..., row_bytes], one packed row per owned position
    kv_format: str = ""

    @property
    def local_nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()

    @property
    def token_rows(self) -> Optional[int]:
        """Token rows (requests x positions) the buffer holds without DCP, for the report's bytes
        per token; None for a kind whose axis 0 is not the batch (a paged pool's pages)."""
        if self.kind not in BATCH_REORDERABLE:
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
        return entry.name, (f"DCP striped it (dcp_size={entry.c}): this rank keeps only positions p with "
                            f"p % {entry.c} == {entry.rank} and its full-size storage was released")
    info = DEFERRED.get(buffer)
    if info is not None:
        return info.name, "it was built under dcp_pass.deferred_caches() and was never allocated"
    return "?", "?"


# What each kind of shard (LocalCache.kind) does at run time. "flat": rows by position;
# "paged": a pool's slots; "static_cache": a Hugging Face static cache tensor
# [batch, kv heads, position, feature].
#
# kinds whose striped tensors take an eager zero_() (a reset of the cache object that holds
# them, outside any graph) by zeroing the rank's shard (Cache.reset() between generations);
# any other eager use raises
RESETTABLE: frozenset[str] = frozenset({"static_cache"})
# kinds of shards whose axis 0 is the batch (a paged pool's is its pages): StripedCacheTensor
# applies batch reorders (beam search) to them
BATCH_REORDERABLE: frozenset[str] = frozenset({"flat", "static_cache"})
# Kinds whose tensors are new objects for every generation (a Hugging Face Cache's): a graph
# compiled for them must guard on the plain tensor class they arrive with, else every new
# generation's first call would compile the graph again. Their shards are installed (storage
# released, class changed) at the graph's first call, after Dynamo has built its guards,
# instead of during the compile; the next call then compiles once for the striped class.
INSTALLED_AT_FIRST_CALL: frozenset[str] = frozenset({"static_cache"})
