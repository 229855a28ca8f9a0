"""The cache kinds, one module each, and the one table the rest of the pass reads.

A kind (`cache_reads.CacheKind`) says how its tensors are found among the graph's inputs, how
reads start and writes look, how a rank reads its shard, whether a read can be striped over
c ranks, and (its `shards`, state/shards.py) how the shard is made and what eager code may do
with a striped tensor. A new kind is a new module here and an entry below.
"""

from __future__ import annotations

from dcp_pass.rewrites.cache_kinds.flat import FLAT
from dcp_pass.rewrites.cache_kinds.paged import PAGED
from dcp_pass.rewrites.cache_kinds.ring_entries import RING_ENTRIES
from dcp_pass.rewrites.cache_kinds.static_cache import STATIC_CACHE
from dcp_pass.rewrites.cache_reads import install_kinds

# in the order their layouts and forms are tried: a module buffer's own form first (a ring
# then entries before rows by position: it is a module buffer too)
CACHE_KINDS = (RING_ENTRIES, FLAT, PAGED, STATIC_CACHE)
# the tracer (cache_reads) dispatches over the table; the kinds build on it, so it is handed over
install_kinds(CACHE_KINDS)
