"""Striped KV layout checked against brute-force loops over positions."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_pass.runtime.decode.layout import (
    CacheCapacityError,
    EagerStripedCache,
    OutOfKVPagesError,
    PagedVirtualAllocator,
    filter_owned,
    local_capacity,
    local_length,
    owned_positions,
    owner,
    physical,
    shard_full_cache,
    striped_read,
    striped_write_,
)

GROUP_SIZES = [1, 2, 3, 4, 8]
group_sizes = st.sampled_from(GROUP_SIZES)
lengths = st.integers(0, 300)
FAST = settings(max_examples=60, deadline=None)


@st.composite
def group_and_rank(draw):
    c = draw(group_sizes)
    return c, draw(st.integers(0, c - 1))


def brute_owned(start: int, end: int, c: int, r: int) -> list[int]:
    return [p for p in range(start, end) if p % c == r]


# ------------------------------------------------------------------ scalar layout math


@FAST
@given(group_and_rank(), lengths)
def test_local_length_counts_owned_positions(cr, L):
    c, r = cr
    got = local_length(L, c, r)
    assert type(got) is int
    assert got == len(brute_owned(0, L, c, r))
    assert got == L // c + (r < L % c)


@FAST
@given(group_sizes, lengths)
def test_local_lengths_partition_and_balance(c, L):
    counts = [local_length(L, c, r) for r in range(c)]
    assert sum(counts) == L
    assert max(counts) - min(counts) <= 1
    assert max(counts) == local_capacity(L, c) == math.ceil(L / c)


@FAST
@given(group_and_rank(), st.lists(lengths, max_size=20))
def test_local_length_elementwise_on_tensors(cr, Ls):
    c, r = cr
    got = local_length(torch.tensor(Ls, dtype=torch.long), c, r)
    assert got.dtype == torch.long
    assert got.tolist() == [len(brute_owned(0, L, c, r)) for L in Ls]


def test_owner_and_physical_on_ints_and_tensors():
    v = torch.arange(20)
    assert owner(v, 3).tolist() == [i % 3 for i in range(20)]
    assert physical(v, 3).tolist() == [i // 3 for i in range(20)]
    assert (owner(17, 4), physical(17, 4)) == (1, 4)


@pytest.mark.parametrize("c, r", [(0, 0), (-1, 0), (2, 2), (2, -1), (1, 1)])
def test_local_length_rejects_bad_group(c, r):
    with pytest.raises(ValueError, match="c"):
        local_length(10, c, r)


def test_negative_lengths_and_reversed_ranges_are_rejected():
    with pytest.raises(ValueError, match="L must be >= 0"):
        local_length(-1, 2, 0)
    with pytest.raises(ValueError, match=r"\[5, 3\)"):
        owned_positions(5, 3, 2, 0)


def test_local_length_stays_symbolic_under_tracing():
    from torch.fx.experimental.proxy_tensor import make_fx

    def shard_rows(x):
        return x.new_zeros(local_length(x.shape[0], 3, 1))

    traced = make_fx(shard_rows, tracing_mode="symbolic")(torch.zeros(7))
    # One trace must serve every length: a specialised trace would bake in 2 rows.
    assert traced(torch.zeros(7)).shape[0] == 2
    assert traced(torch.zeros(8)).shape[0] == 3
    assert traced(torch.zeros(1)).shape[0] == 0


@FAST
@given(group_and_rank(), lengths, lengths)
def test_owned_positions_matches_brute_force(cr, start, span):
    c, r = cr
    got = owned_positions(start, start + span, c, r)
    assert got.dtype == torch.long
    assert got.tolist() == brute_owned(start, start + span, c, r)


@FAST
@given(group_and_rank(), st.lists(st.integers(0, 2000), max_size=60))
def test_filter_owned_matches_brute_force(cr, values):
    c, r = cr
    kept, owned, slots = filter_owned(torch.tensor(values, dtype=torch.long), c, r)
    expect = [(i, v) for i, v in enumerate(values) if v % c == r]
    assert kept.tolist() == [i for i, _ in expect]
    assert owned.tolist() == [v for _, v in expect]
    assert slots.tolist() == [v // c for _, v in expect]


# --------------------------------------------------------------- dense striped caches


def brute_shard(full: torch.Tensor, c: int, r: int) -> torch.Tensor:
    batch, tokens, dim = full.shape
    shard = torch.zeros(batch, -(-tokens // c), dim, dtype=full.dtype)
    for p in range(tokens):
        if p % c == r:
            shard[:, p // c] = full[:, p]
    return shard


@FAST
@given(group_and_rank(), st.integers(0, 40), st.integers(1, 3))
def test_shard_full_cache_matches_brute_force(cr, tokens, batch):
    c, r = cr
    full = torch.randn(batch, tokens, 5)
    assert torch.equal(shard_full_cache(full, c, r), brute_shard(full, c, r))


@FAST
@given(group_and_rank(), lengths, st.integers(0, 40), st.integers(0, 2))
def test_striped_write_touches_only_owned_rows(cr, start, seq, batch_start):
    c, r = cr
    dim, batch = 3, 2
    full = torch.randn(batch, start + seq, dim)
    storage = torch.full((batch + batch_start + 1, local_capacity(start + seq, c), dim), float("nan"))

    striped_write_(storage, full[:, start:], start, c, r, batch_start=batch_start)

    expect = torch.full_like(storage, float("nan"))
    for p in range(start, start + seq):
        if p % c == r:
            expect[batch_start : batch_start + batch, p // c] = full[:, p]
    assert torch.equal(storage.isnan(), expect.isnan())
    assert torch.equal(storage.nan_to_num(), expect.nan_to_num())


@FAST
@given(group_and_rank(), st.lists(st.integers(0, 30), min_size=1, max_size=8))
def test_chunked_writes_then_read_equal_full_shard(cr, chunks):
    c, r = cr
    total = sum(chunks)
    full = torch.randn(2, total, 4)
    storage = torch.full((2, local_capacity(total, c), 4), float("nan"))
    pos = 0
    for seq in chunks:
        striped_write_(storage, full[:, pos : pos + seq], pos, c, r)
        pos += seq
    got = striped_read(storage, 2, total, c, r)
    expect = brute_shard(full, c, r)[:, : len(brute_owned(0, total, c, r))]
    assert not got.isnan().any()
    assert torch.equal(got, expect)


@FAST
@given(group_and_rank(), st.integers(0, 50), st.integers(0, 20))
def test_striped_cache_round_trip(cr, prefix, extra):
    c, r = cr
    full = torch.randn(3, prefix + extra, 2)
    cache = EagerStripedCache(4, prefix + extra, 2, c, r)
    assert cache.storage.shape == (4, math.ceil((prefix + extra) / c), 2)
    cache.write(full[1:, :prefix], 0, batch_start=2)
    cache.write(full[1:, prefix:], prefix, batch_start=2)
    expect = brute_shard(full, c, r)[1:, : len(brute_owned(0, prefix + extra, c, r))]
    assert torch.equal(cache.read(2, prefix + extra, batch_start=2), expect)
    assert torch.equal(EagerStripedCache.from_full(full, c, r).read(3, prefix + extra)[1:], expect)
    assert cache.nbytes == 4 * math.ceil((prefix + extra) / c) * 2 * 4


def test_striped_cache_read_is_a_view():
    cache = EagerStripedCache(2, 8, 1, 2, 0)
    cache.read(2, 8).fill_(7.0)
    assert torch.all(cache.storage == 7.0)


@pytest.mark.parametrize(
    "shape, start, batch_start, needle",
    [
        ((1, 3, 2), 8, 0, r"\[8, 11\).*max_seq_len=10"),
        ((1, 11, 2), 0, 0, r"\[0, 11\).*max_seq_len=10"),
        ((2, 1, 2), 0, 3, r"\[3, 5\).*max_batch=4"),
    ],
)
def test_striped_cache_capacity_errors_leave_storage_unchanged(shape, start, batch_start, needle):
    cache = EagerStripedCache(4, 10, 2, 3, 1)
    with pytest.raises(CacheCapacityError, match=needle):
        cache.write(torch.ones(shape), start, batch_start=batch_start)
    assert not cache.storage.any()


def test_striped_cache_read_past_capacity_raises():
    cache = EagerStripedCache(2, 10, 1, 4, 3)
    with pytest.raises(CacheCapacityError, match="max_seq_len=10"):
        cache.read(1, 11)
    with pytest.raises(CacheCapacityError, match="max_batch=2"):
        cache.read(3, 4)
    assert issubclass(CacheCapacityError, ValueError)


# ---------------------------------------------------------- c = 1 is the identity


def test_group_of_one_is_the_identity_layout():
    full = torch.randn(2, 13, 3)
    assert torch.equal(shard_full_cache(full, 1, 0), full)
    assert owned_positions(4, 13, 1, 0).tolist() == list(range(4, 13))
    assert local_length(13, 1, 0) == 13
    alloc = PagedVirtualAllocator(16, 4, 1)
    virtual = alloc.allocate("a", 7)
    mask, slots = alloc.local_slots(virtual, 0)
    assert mask.all() and torch.equal(slots, virtual)


# ------------------------------------------------------------- paged virtual allocator


def test_allocator_geometry_and_validation():
    alloc = PagedVirtualAllocator(32, 8, 4)
    assert (alloc.virtual_capacity, alloc.virtual_page_size, alloc.num_pages) == (128, 32, 4)
    assert alloc.num_free_pages == 4
    with pytest.raises(ValueError, match="multiple"):
        PagedVirtualAllocator(30, 8, 4)


def test_allocator_token_map_follows_pages():
    alloc = PagedVirtualAllocator(8, 2, 3)  # virtual page = 6 tokens, 4 pages
    alloc.allocate("x", 4)
    assert alloc.allocate("y", 1).tolist() == [6]
    assert alloc.allocate("x", 5).tolist() == [4, 5, 12, 13, 14]
    assert alloc.page_table("x").tolist() == [0, 2]
    assert alloc.req_to_token("x").tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 14]
    mask, slots = alloc.local_slots(alloc.req_to_token("x"), 1)
    assert mask.tolist() == [False, True, False, False, True, False, False, True, False]
    # Virtual page 2 is physical page 2 (rows 4, 5) on every rank.
    assert slots.tolist() == [0, 1, 4]
    assert [alloc.local_token_count("x", r) for r in range(3)] == [3, 3, 3]


def test_exhaustion_message_and_page_reuse():
    alloc = PagedVirtualAllocator(4, 2, 2)  # 2 pages of 4 virtual tokens
    alloc.allocate("a", 5)
    with pytest.raises(OutOfKVPagesError, match=r"needs 1 more.*0 of 2 pages are free") as info:
        alloc.allocate("b", 3)
    assert "3 tokens" in str(info.value)
    alloc.free("a")
    assert alloc.num_free_pages == 2
    assert sorted(alloc.allocate("b", 8).tolist()) == list(range(8))


class AllocatorModel:
    """Brute-force bookkeeping: which pages are in use and each request's length."""

    def __init__(self, capacity: int, page: int, c: int) -> None:
        self.page_tokens = page * c
        self.num_pages = capacity // page
        self.lengths: dict[int, int] = {}
        self.maps: dict[int, list[int]] = {}

    def pages_of(self, length: int) -> int:
        return -(-length // self.page_tokens)

    def free_pages(self) -> int:
        return self.num_pages - sum(self.pages_of(n) for n in self.lengths.values())


def snapshot(alloc: PagedVirtualAllocator, ids) -> tuple:
    return alloc.num_free_pages, {i: alloc.req_to_token(i).tolist() for i in ids}


def check_invariants(alloc: PagedVirtualAllocator, model: AllocatorModel, c: int, page: int) -> None:
    assert alloc.num_free_pages == model.free_pages()
    seen: set[int] = set()
    slots_per_rank: list[set[int]] = [set() for _ in range(c)]
    for rid, expect_map in model.maps.items():
        tokens = alloc.req_to_token(rid).tolist()
        assert tokens == expect_map and alloc.seq_len(rid) == len(tokens)
        pages = alloc.page_table(rid).tolist()
        assert len(pages) == model.pages_of(len(tokens))
        for t, v in enumerate(tokens):
            assert v == pages[t // model.page_tokens] * model.page_tokens + t % model.page_tokens
        assert seen.isdisjoint(tokens)
        seen.update(tokens)
        counts = [0] * c
        for rank in range(c):
            mask, slots = alloc.local_slots(torch.tensor(tokens, dtype=torch.long), rank)
            owned = [v for v in tokens if v % c == rank]
            assert mask.tolist() == [v % c == rank for v in tokens]
            assert slots.tolist() == [v // c for v in owned]
            for v in owned:
                # Virtual page v // (P*c) is the same physical page on every rank.
                assert v // c // page == v // model.page_tokens
                assert v // c < model.num_pages * page
            assert slots_per_rank[rank].isdisjoint(slots.tolist())
            slots_per_rank[rank].update(slots.tolist())
            counts[rank] = len(owned)
            assert alloc.local_token_count(rid, rank) == len(owned)
        assert max(counts) - min(counts) <= 1


operations = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "free"]), st.integers(0, 4), st.integers(0, 40)),
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(group_sizes, st.integers(1, 4), st.integers(1, 6), operations)
def test_allocator_against_brute_force_model(c, page, pages, ops):
    alloc = PagedVirtualAllocator(page * pages, page, c)
    model = AllocatorModel(page * pages, page, c)
    ever_used: set[int] = set()
    for op, rid, n in ops:
        if op == "free":
            if rid in model.lengths:
                alloc.free(rid)
                del model.lengths[rid], model.maps[rid]
            else:
                with pytest.raises(KeyError):
                    alloc.free(rid)
            check_invariants(alloc, model, c, page)
            continue
        old = model.lengths.get(rid, 0)
        extra_pages = model.pages_of(old + n) - model.pages_of(old)
        if extra_pages > model.free_pages():
            before = snapshot(alloc, model.lengths)
            with pytest.raises(OutOfKVPagesError, match=f"needs {extra_pages} more"):
                alloc.allocate(rid, n)
            assert snapshot(alloc, model.lengths) == before
            assert rid in model.lengths or rid not in alloc.request_ids
        else:
            new = alloc.allocate(rid, n).tolist()
            model.lengths[rid] = old + n
            model.maps[rid] = model.maps.get(rid, []) + new
            assert len(new) == n
            for v in new:
                ever_used.add(v // model.page_tokens)
        check_invariants(alloc, model, c, page)
    # Page ids handed out always lie inside the pool, however often pages were recycled.
    assert ever_used <= set(range(pages))


# -------------------------------------- bools and negative indices are rejected, not ignored
# bool is an int subclass: c=True or rank=False would pass an int check and silently mean
# 1 / 0. Each call below must raise, naming the argument.


def _bool_calls():
    from dcp_pass.runtime.compose.extend import extend_attention_dcp, gather_prefix, query_positions, write_new_tokens_
    from dcp_pass.runtime.compose.speculative import rank_local_page_table, verify_attention, verify_query_positions
    from dcp_pass.runtime.decode.call import AttentionCall

    cache = torch.zeros(2, 8, 4)
    new = torch.zeros(2, 3, 4)
    q = torch.zeros(1, 2, 2, 4)
    r2t = [torch.arange(16)]
    yield "owner c", lambda: owner(5, True)
    yield "physical c", lambda: physical(5, True)
    yield "local_length c", lambda: local_length(10, True, 0)
    yield "local_length r", lambda: local_length(10, 2, False)
    yield "local_length L", lambda: local_length(True, 2, 0)
    yield "local_capacity", lambda: local_capacity(True, 2)
    yield "owned_positions r", lambda: owned_positions(0, 10, 2, True)
    yield "owned_positions start", lambda: owned_positions(False, 10, 2, 0)
    yield "filter_owned c", lambda: filter_owned(torch.arange(6), True, 0)
    yield "shard_full_cache r", lambda: shard_full_cache(cache, 2, False)
    yield "striped_write_ start", lambda: striped_write_(cache.clone(), new, True, 2, 0)
    yield "EagerStripedCache rank", lambda: EagerStripedCache(2, 8, 4, 2, True)
    yield "EagerStripedCache max_batch", lambda: EagerStripedCache(True, 8, 4, 2, 0)
    yield "allocator c", lambda: PagedVirtualAllocator(32, 8, True)
    yield "allocator local_slots rank", lambda: PagedVirtualAllocator(32, 8, 2).local_slots(torch.arange(4), False)
    yield "extend write rank", lambda: write_new_tokens_(cache.clone(), new, 0, 2, False)
    yield "extend prefix_lens", lambda: write_new_tokens_(cache.clone(), new, True, 2, 0)
    yield "extend query_positions", lambda: query_positions(True, 2, 3)
    yield "extend gather c", lambda: gather_prefix(cache, 2, None, True)
    yield "extend dcp rank", lambda: extend_attention_dcp(
        AttentionCall(q, None, cache[:1], None, 4, 1.0, stripe=(2, False)), new[:1, :2], None, 0)
    yield "verify k_tokens", lambda: verify_query_positions(torch.tensor([5]), True)
    yield "verify page_size", lambda: rank_local_page_table(r2t, [8], 2, 0, True)
    yield "verify rank", lambda: rank_local_page_table(r2t, [8], 2, False, 4)
    yield "verify c", lambda: rank_local_page_table(r2t, [8], True, 0, 4)
    yield "verify_attention c", lambda: verify_attention(
        AttentionCall(torch.zeros(1, 1, 2, 4), None, torch.zeros(1, 8, 4), None, 4, 1.0, kv_lens=torch.tensor([4]),
                      stripe=(True, 0)), 1)


_BOOL_CALLS = list(_bool_calls())


@pytest.mark.parametrize("name", [n for n, _ in _BOOL_CALLS])
def test_bool_sizes_and_ranks_are_rejected(name):
    call = dict(_BOOL_CALLS)[name]
    with pytest.raises(ValueError, match=r"(?i)bool|True|False"):
        call()


def test_speculative_rejects_negative_indices_and_sizes():
    from dcp_pass.runtime.compose.speculative import rank_local_page_table, verify_attention
    from dcp_pass.runtime.decode.call import AttentionCall

    r2t = torch.arange(16)
    with pytest.raises(ValueError, match=r"page_size"):
        rank_local_page_table([r2t], [8], 2, 0, -1)
    with pytest.raises(ValueError, match=r"page_size"):
        rank_local_page_table([r2t], [8], 2, 0, 0)
    with pytest.raises(ValueError, match=r"global_kv_len"):
        rank_local_page_table([r2t], [-2], 2, 0, 4)
    # a negative virtual index would map to physical page -1: the pool's LAST page
    bad = r2t.clone()
    bad[:4] -= 4 * 2 * 2
    with pytest.raises(ValueError, match=r"negative"):
        rank_local_page_table([bad], [8], 2, 0, 4)
    with pytest.raises(ValueError, match=r"rank"):
        rank_local_page_table([r2t], [8], 2, -1, 4)
    # a negative page id in a caller-built page table reads another request's page
    q = torch.zeros(1, 1, 2, 4)
    pool = torch.zeros(4, 4, 4)
    with pytest.raises(ValueError, match=r"page_table.*negative"):
        verify_attention(AttentionCall(q, None, pool, None, 4, 1.0, kv_lens=torch.tensor([4]), stripe=(2, 0),
                                       page_table=torch.tensor([[-1]])), 1)
