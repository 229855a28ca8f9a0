"""Striped (virtual) KV layout of decode context parallelism.

A DCP group of size ``c`` stripes the KV cache by token position: rank ``r`` owns
every virtual position ``v`` with ``v % c == r`` and stores it at physical row
``v // c`` of its own pool. Everything here is plain index
arithmetic, so the same helpers serve the eager allocator, the compile pass and
the tests.

Scalars may be Python ints, SymInts (inside a traced graph) or int64 tensors.
Arguments are validated only when they are concrete Python ints: checking a
SymInt would install a guard and checking a tensor would force a device sync.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Optional, TypeVar, Union

import torch

__all__ = [
    "CacheCapacityError",
    "OutOfKVPagesError",
    "owner",
    "physical",
    "local_length",
    "local_capacity",
    "owned_positions",
    "filter_owned",
    "shard_full_cache",
    "striped_write_",
    "striped_read",
    "EagerStripedCache",
    "PagedVirtualAllocator",
]

IntLike = Union[int, torch.SymInt, torch.Tensor]
# the position helpers return what they are given: an int for ints, a tensor (elementwise) for tensors
Positions = TypeVar("Positions", int, torch.SymInt, torch.Tensor)


class CacheCapacityError(ValueError):
    """A striped cache was asked to hold more tokens or sequences than it was sized for."""


class OutOfKVPagesError(RuntimeError):
    """The shared virtual allocator has too few free pages for a request."""


# ----------------------------------------------------------------------------- checks


def _is_concrete_int(x: object) -> bool:
    # bool is an int subclass but never a meaningful size or rank here.
    return isinstance(x, int) and not isinstance(x, bool)


def _reject_bool(name: str, x: object, what: str = "") -> None:
    # Without this a bool would pass every check below as "not a concrete int" (the
    # path meant for SymInts and tensors) and then silently act as 1 or 0.
    if isinstance(x, bool):
        raise ValueError(f"{what or name} must be an int, got the bool {name}={x}")


def _check_group_size(c: IntLike) -> None:
    _reject_bool("c", c, "DCP group size c")
    if _is_concrete_int(c) and c < 1:
        raise ValueError(f"DCP group size c must be >= 1, got c={c}")


def _check_rank(c: IntLike, r: IntLike) -> None:
    _check_group_size(c)
    _reject_bool("r", r, "DCP rank r")
    if _is_concrete_int(r) and r < 0:
        raise ValueError(f"DCP rank r must satisfy 0 <= r < c, got r={r}")
    if _is_concrete_int(c) and _is_concrete_int(r) and not 0 <= r < c:
        raise ValueError(f"DCP rank r must satisfy 0 <= r < c, got r={r} with c={c}")


def _check_non_negative(name: str, value: IntLike) -> None:
    _reject_bool(name, value)
    if _is_concrete_int(value) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value}")


# ------------------------------------------------------------------ scalar layout math


def owner(v: Positions, c: int) -> Positions:
    """DCP rank that stores virtual position ``v``."""
    _check_group_size(c)
    return v % c


def physical(v: Positions, c: int) -> Positions:
    """Row of the owner's physical pool that holds virtual position ``v``."""
    _check_group_size(c)
    return v // c


def local_length(L: Positions, c: int, r: IntLike) -> Positions:
    """Number of positions in ``[0, L)`` owned by rank ``r``: ``L // c + (r < L % c)``.

    Computed as ``(L + c - 1 - r) // c``, which equals the spec formula for every
    ``L >= 0`` and ``0 <= r < c`` but needs no bool-to-int conversion, so it stays a
    single expression for ints (returns int), SymInts and int64 tensors (elementwise).
    """
    _check_rank(c, r)
    _check_non_negative("L", L)
    return (L + (c - 1 - r)) // c


def local_capacity(virtual_tokens: Positions, c: int) -> Positions:
    """Physical rows one rank needs so that any rank can hold ``virtual_tokens``: ceil(T / c)."""
    _check_group_size(c)
    _check_non_negative("virtual_tokens", virtual_tokens)
    return (virtual_tokens + (c - 1)) // c


def owned_positions(start: int, end: int, c: int, r: int) -> torch.Tensor:
    """Ascending global positions ``p`` in ``[start, end)`` with ``p % c == r``."""
    _check_rank(c, r)
    _check_non_negative("start", start)
    if _is_concrete_int(start) and _is_concrete_int(end) and end < start:
        raise ValueError(f"empty range must have end >= start, got [{start}, {end})")
    first = start + (r - start) % c
    # torch.arange rejects start > end for a positive step, which happens when the
    # range is shorter than the distance to the first owned position.
    return torch.arange(min(first, end), end, c, dtype=torch.long)


def filter_owned(indices: torch.Tensor, c: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a 1-D LongTensor of virtual indices into the part rank ``r`` stores.

    Returns ``(kept, owned, slots)``, all int64 and of equal length, in input order:

    * ``kept``  - positions into ``indices`` of the entries owned by ``r``
      (``indices[kept] == owned``); use it to select the matching value rows;
    * ``owned`` - the owned virtual indices themselves (``owned % c == r``);
    * ``slots`` - their physical rows in rank ``r``'s pool, ``owned // c``.
    """
    _check_rank(c, r)
    if indices.dim() != 1:
        raise ValueError(f"filter_owned expects a 1-D index tensor, got shape {tuple(indices.shape)}")
    if indices.dtype != torch.long:
        raise ValueError(f"filter_owned expects int64 indices, got {indices.dtype}")
    kept = torch.nonzero(indices % c == r).reshape(-1)
    owned = indices[kept]
    return kept, owned, owned // c


def whole_page_ids(slots: torch.Tensor, page_size: int) -> Optional[torch.Tensor]:
    """Page ids of a rank's local slots if they fill whole pages in order, else None.

    Local token ``j`` must sit at offset ``j % P`` of page ``pages[j // P]`` (every page
    whole except possibly the last): what page-aligned allocations such as
    :class:`PagedVirtualAllocator` give. ``slots``: 1-D int64 (CPU) physical slots.
    """
    n = slots.numel()
    pages = slots[::page_size] // page_size
    expect = pages.repeat_interleave(page_size)[:n] * page_size + torch.arange(n) % page_size
    return pages if torch.equal(slots, expect) else None


# --------------------------------------------------------------- dense striped caches


def zero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`x` [B, T, ...] with the rows where `keep` [B, T] is False zeroed (float8 through its
    bytes: zero bytes are +0.0)."""
    if x.element_size() == 1 and x.dtype.is_floating_point:
        return zero_rows(x.view(torch.uint8), keep).view(x.dtype)
    keep = keep.view(*keep.shape, *([1] * (x.dim() - 2)))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def shard_full_cache(full: torch.Tensor, c: int, r: int) -> torch.Tensor:
    """Rank ``r``'s shard of an unsharded ``[B, T, D]`` cache, shaped ``[B, ceil(T/c), D]``.

    Rows past the rank's local length are zero: ranks with ``r >= T % c`` own one
    position fewer than the capacity all ranks share.
    """
    _check_rank(c, r)
    if full.dim() != 3:
        raise ValueError(f"shard_full_cache expects [B, T, D], got shape {tuple(full.shape)}")
    batch, tokens, dim = full.shape
    shard = full.new_zeros(batch, local_capacity(tokens, c), dim)
    owned = full[:, r::c]
    shard[:, : owned.shape[1]] = owned
    return shard


def striped_write_(
    storage: torch.Tensor,
    values: torch.Tensor,
    start_pos: int,
    c: int,
    r: int,
    batch_start: int = 0,
) -> torch.Tensor:
    """Write the owned tokens of ``values`` in place into a rank's ``[B, Tl, D]`` pool.

    ``values`` is ``[b, s, D]`` covering global positions ``[start_pos, start_pos+s)``
    of sequences ``batch_start .. batch_start+b-1``. Positions owned by ``r`` land at
    row ``p // c``; every other row is left untouched. Returns ``storage``.
    """
    _check_rank(c, r)
    _check_non_negative("start_pos", start_pos)
    seq = values.shape[1]
    # The owned tokens are every c-th token from the first owned offset, and they land on
    # consecutive local rows: one strided slice copy, no index tensors (an index built on
    # the host would be a host->device copy per write, which syncs and breaks CUDA graphs).
    first = (r - start_pos) % c
    count = max(0, -(-(seq - first) // c))
    if count == 0:
        return storage
    row0 = (start_pos + first) // c
    if row0 + count > storage.shape[1]:
        raise CacheCapacityError(
            f"striped write of positions [{start_pos}, {start_pos + seq}) needs local rows up to {row0 + count}, "
            f"but the shard holds {storage.shape[1]}"
        )
    rows = storage.narrow(0, batch_start, values.shape[0])
    rows[:, row0 : row0 + count].copy_(values[:, first::c])
    return storage


def striped_read(storage: torch.Tensor, bsz: int, end_pos: int, c: int, r: int) -> torch.Tensor:
    """View of the first ``bsz`` sequences' owned rows for global length ``end_pos``."""
    _check_rank(c, r)
    return storage[:bsz, : local_length(end_pos, c, r)]


class EagerStripedCache:
    """One DCP rank's striped rows of a `[B, T, D]` KV cache, written and read by eager code (no model, no
    compile: the runtime compositions); a model's striped cache tensor is state.guards.StripedCacheTensor."""

    def __init__(
        self,
        max_batch: int,
        max_seq_len: int,
        dim: int,
        c: int,
        rank: int,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
    ) -> None:
        _check_rank(c, rank)
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("dim", dim)):
            _check_non_negative(name, value)
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.dim = dim
        self.c = c
        self.rank = rank
        self.storage = torch.zeros(max_batch, local_capacity(max_seq_len, c), dim, dtype=dtype, device=device)

    @classmethod
    def from_full(cls, full: torch.Tensor, c: int, rank: int) -> "EagerStripedCache":
        """Cache sized exactly for an unsharded ``[B, T, D]`` cache, holding rank's shard of it."""
        batch, tokens, dim = full.shape
        cache = cls(batch, tokens, dim, c, rank, dtype=full.dtype, device=full.device)
        cache.write(full, 0)
        return cache

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def _check_batch_range(self, batch_start: int, bsz: int) -> None:
        if batch_start < 0 or bsz < 0 or batch_start + bsz > self.max_batch:
            raise CacheCapacityError(
                f"batch rows [{batch_start}, {batch_start + bsz}) exceed max_batch={self.max_batch}"
            )

    def _check_token_range(self, start_pos: int, end_pos: int) -> None:
        if start_pos < 0 or end_pos < start_pos or end_pos > self.max_seq_len:
            raise CacheCapacityError(f"token positions [{start_pos}, {end_pos}) exceed max_seq_len={self.max_seq_len}")

    def write(self, values: torch.Tensor, start_pos: int, batch_start: int = 0) -> None:
        """Store the owned positions of ``values [b, s, dim]`` placed at ``start_pos``."""
        if values.dim() != 3 or values.shape[2] != self.dim:
            raise ValueError(f"values must be [b, s, {self.dim}], got shape {tuple(values.shape)}")
        bsz, seq, _ = values.shape
        self._check_batch_range(batch_start, bsz)
        self._check_token_range(start_pos, start_pos + seq)
        striped_write_(self.storage, values, start_pos, self.c, self.rank, batch_start=batch_start)

    def read(self, bsz: int, end_pos: int, batch_start: int = 0) -> torch.Tensor:
        """View ``[bsz, local_length(end_pos), dim]`` of this rank's rows for ``[0, end_pos)``."""
        self._check_batch_range(batch_start, bsz)
        self._check_token_range(0, end_pos)
        rows = self.storage[batch_start : batch_start + bsz]
        return striped_read(rows, bsz, end_pos, self.c, self.rank)


# ------------------------------------------------------------- paged virtual allocator


class PagedVirtualAllocator:
    """One virtual page allocator shared by every rank of a DCP group.

    Every rank runs the same allocation sequence and therefore sees the same
    request-to-token map of virtual indices. A virtual page of ``P * c`` tokens maps
    to physical page ``page`` on every rank, each holding its ``P`` owned rows, so a
    request's tokens stay balanced across ranks within one token.
    """

    def __init__(self, physical_capacity_tokens: int, physical_page_size: int, c: int) -> None:
        _check_group_size(c)
        if physical_page_size < 1:
            raise ValueError(f"physical_page_size must be >= 1, got {physical_page_size}")
        _check_non_negative("physical_capacity_tokens", physical_capacity_tokens)
        if physical_capacity_tokens % physical_page_size:
            raise ValueError(
                f"physical_capacity_tokens={physical_capacity_tokens} must be a multiple of "
                f"physical_page_size={physical_page_size}"
            )
        self.physical_capacity_tokens = physical_capacity_tokens
        self.physical_page_size = physical_page_size
        self.c = c
        # Min-heap: lowest free page first, so allocation order is deterministic and
        # identical on every rank that replays the same calls.
        self._free_pages: list[int] = list(range(self.num_pages))
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @property
    def virtual_capacity(self) -> int:
        return self.physical_capacity_tokens * self.c

    @property
    def virtual_page_size(self) -> int:
        return self.physical_page_size * self.c

    @property
    def num_pages(self) -> int:
        return self.physical_capacity_tokens // self.physical_page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._pages)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.virtual_page_size)

    def _require(self, request_id: Hashable) -> None:
        if request_id not in self._pages:
            raise KeyError(f"unknown request {request_id!r}")

    def _token_map(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        # Logical token t of a request lives at offset t % (P*c) of its page t // (P*c).
        logical = torch.arange(start, end, dtype=torch.long)
        page_ids = torch.tensor(pages, dtype=torch.long)
        if page_ids.numel() == 0:
            return logical
        return page_ids[logical // self.virtual_page_size] * self.virtual_page_size + (logical % self.virtual_page_size)

    def allocate(self, request_id: Hashable, num_tokens: int) -> torch.Tensor:
        """Append ``num_tokens`` tokens to a request (created if new); return their virtual indices."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        pages = self._pages.get(request_id, [])
        old_len = self._lengths.get(request_id, 0)
        new_len = old_len + num_tokens
        needed = self._pages_for(new_len) - len(pages)
        if needed > len(self._free_pages):
            raise OutOfKVPagesError(
                f"request {request_id!r} needs {needed} more virtual pages to grow from "
                f"{old_len} to {new_len} tokens (+{num_tokens}), but only "
                f"{len(self._free_pages)} of {self.num_pages} pages are free "
                f"({len(self._free_pages) * self.virtual_page_size} free virtual tokens, "
                f"page size {self.virtual_page_size})"
            )
        pages = pages + [heapq.heappop(self._free_pages) for _ in range(needed)]
        self._pages[request_id] = pages
        self._lengths[request_id] = new_len
        return self._token_map(pages, old_len, new_len)

    def free(self, request_id: Hashable) -> None:
        """Release a request and return its pages to the free list."""
        self._require(request_id)
        for page in self._pages.pop(request_id):
            heapq.heappush(self._free_pages, page)
        del self._lengths[request_id]

    def seq_len(self, request_id: Hashable) -> int:
        self._require(request_id)
        return self._lengths[request_id]

    def page_table(self, request_id: Hashable) -> torch.Tensor:
        """Virtual page ids of a request, in token order (also its physical page ids on every rank)."""
        self._require(request_id)
        return torch.tensor(self._pages[request_id], dtype=torch.long)

    def req_to_token(self, request_id: Hashable) -> torch.Tensor:
        """Virtual index of every token of a request; the same on every rank."""
        self._require(request_id)
        return self._token_map(self._pages[request_id], 0, self._lengths[request_id])

    def local_slots(self, virtual_indices: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(owned_mask, physical_slots)``: which indices ``rank`` stores, and where.

        ``physical_slots`` has one entry per True in ``owned_mask``, in input order.
        Virtual page ``v // (P*c)`` is physical page ``v // (P*c)`` on every rank at
        offset ``(v % (P*c)) // c``, which is simply ``v // c``.
        """
        _check_rank(self.c, rank)
        owned_mask = virtual_indices % self.c == rank
        return owned_mask, virtual_indices[owned_mask] // self.c

    def local_token_count(self, request_id: Hashable, rank: int) -> int:
        """Tokens of a request stored on ``rank``; pages start at multiples of c, so this is local_length."""
        return local_length(self.seq_len(request_id), self.c, rank)


def check_write_capacity(end: int, capacity: int) -> None:
    """A cache write ending at global position `end` must fit the virtual capacity.

    Written with torch._check so that it also holds for symbolic ends inside a
    compiled graph (a runtime assertion there) and costs nothing for Python ints.
    """
    # The message may close over nothing: Dynamo cannot trace a message closure over
    # non-constant values, and this runs inside traced graphs.
    torch._check(
        end <= capacity,
        lambda: (
            "dcp_pass: cache write past the cache capacity (the model's max sequence length); "
            "raise max_seq_len or start a new sequence"
        ),
    )


def window_rows(seq: int, c: int) -> int:
    """Local rows a write of `seq` tokens can touch on one rank, over every start and rank."""
    return (seq + c - 2) // c + 1


def write_owned_tokens_(
    shard: torch.Tensor,
    values: torch.Tensor,
    start_pos,
    c: int,
    r: int,
    capacity: int,
    feat_start: int = 0,
) -> None:
    """The compile pass's cache write: tokens [start_pos, start_pos + s) of `values`
    [b, s, D] into columns [feat_start, feat_start + D) of rank r's shard, keeping only
    owned positions. Traceable: called from the rewritten graph and traced by the inner
    compiler into plain tensor ops.

    With an int start and an int length it is `striped_write_` (one strided slice copy).
    With a symbolic start (decode after the first steps) or length (prefills of several
    lengths) how many tokens the rank owns depends on their values and on the rank; a
    shape that depends on them would make Dynamo guard on them, per rank (so ranks would
    recompile at different calls) and per step. So the write covers a fixed window of local rows from
    `start // c` and keeps the rows it does not own (`torch.where`): the same shapes for
    every start. The owned rows run to `(start + s - 1) // c`, at most
    `(s + c - 2) // c` rows past `start // c` (when `start % c == c - 1`), so the window
    is `(s + c - 2) // c + 1` rows. Its end stays within `ceil(capacity / c) + 1`: the
    shard needs one spare row.
    """
    seq = values.shape[1]
    check_write_capacity(start_pos + seq, capacity)
    cols = shard[: values.shape[0], :, feat_start : feat_start + values.shape[-1]]
    if isinstance(start_pos, int) and isinstance(seq, int):
        striped_write_(cols, values, start_pos, c, r)
        return
    window = window_rows(seq, c)
    row0 = start_pos // c
    # position (relative to start_pos) of the token that belongs on local row row0 + i
    token = torch.arange(window, device=values.device) * c + (row0 * c + r - start_pos)
    owned = (token >= 0) & (token < seq)
    # clamped from above, then from below: an index the inner compiler sees as never negative
    # (inductor wraps one it cannot prove so in a `Where`, which its CPU code generation fails
    # to simplify when the length is an expression such as `(s - s % 4) // 4`)
    picked = values.index_select(1, token.clamp(max=seq - 1).clamp(min=0)).to(shard.dtype)
    rows = cols[:, row0 : row0 + window]
    rows.copy_(torch.where(owned[None, :, None], picked, rows))


def write_tokens_at_(
    shard: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    c: int,
    r: int,
    capacity: int,
    feat_start: int = 0,
) -> None:
    """`cache[:b, positions] = values` for rank r's shard, with positions as a device tensor.

    Static shapes and no host sync (CUDA-graph friendly): tokens this rank does not own
    are written to the shard's spare last row, which no read covers.
    """
    torch._assert_async(((positions >= 0) & (positions < capacity)).all())
    cols = shard[: values.shape[0], :, feat_start : feat_start + values.shape[-1]]
    spare = torch.full_like(positions, shard.shape[1] - 1)
    rows = torch.where(positions % c == r, positions // c, spare)
    cols.index_copy_(1, rows, values.to(shard.dtype))


def write_request_tokens_at_(
    shard: torch.Tensor,
    values: torch.Tensor,
    requests: torch.Tensor,
    positions: torch.Tensor,
    c: int,
    r: int,
    capacity: int,
    feat_start: int = 0,
) -> None:
    """`cache[requests, positions] = values` for rank r's shard: request `requests[i]` gets
    `values[i]` at its own position `positions[i]` (serving-style decode, one position per
    request).

    As `write_tokens_at_`: static shapes, no host sync; a token this rank does not own goes
    to its request's spare last row, which no read covers.
    """
    torch._assert_async(((positions >= 0) & (positions < capacity)).all())
    cols = shard[..., feat_start : feat_start + values.shape[-1]]
    spare = torch.full_like(positions, shard.shape[1] - 1)
    rows = torch.where(positions % c == r, positions // c, spare)
    cols.index_put_((requests, rows), values.to(shard.dtype))


def write_rows_at_(
    shard: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    axis: int,
    c: int,
    r: int,
    capacity: int,
) -> None:
    """`cache.index_copy_(axis, positions, values)` for rank r's shard, whose position axis
    is `axis` (a per-head cache [B, H, T, D] has it at 2).

    As `write_tokens_at_`: static shapes, no host sync; tokens this rank does not own go to
    the shard's spare last row, which no read covers.
    """
    torch._assert_async(((positions >= 0) & (positions < capacity)).all())
    spare = torch.full_like(positions, shard.shape[axis] - 1)
    rows = torch.where(positions % c == r, positions // c, spare)
    shard.index_copy_(axis, rows, values.to(shard.dtype))
