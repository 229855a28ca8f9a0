"""Host-memory KV tier (L2 offload) of a striped DCP cache."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dcp_pass.runtime.decode.comm import exchange_replicated
from dcp_pass.runtime.compose.host_tier import HostKVTier, HostTierError, local_rows, widened_page_indices
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.kernels.reference import attention_reference
from dcp_pass.runtime.decode.layout import PagedVirtualAllocator, filter_owned, owned_positions
from dcp_pass.testing import Checks, run_ranks

P, D, DL, H = 4, 24, 16, 4
SCALE = 1.0 / math.sqrt(D)


def test_host_tier_keeps_only_owned_rows_mapped_by_i_div_c():
    c = 3
    g = torch.Generator().manual_seed(0)
    dev_pages, host_pages = torch.tensor([4, 1]), torch.tensor([2, 0])
    full = torch.randn(8 * P * c, D, generator=g)  # the whole virtual device space, rows = virtual slots
    for r in range(c):
        pool = full[r::c].clone()  # rank r's physical pool: virtual v at row v // c
        tier = HostKVTier(3, P, c, r, D, torch.float32, pin_memory=False)
        assert tier.buffer.shape == (3 * P, D) and tier.virtual_capacity == 3 * P * c
        moved = tier.offload(pool, dev_pages, host_pages, unit="page")
        assert moved == 2 * P
        for dp, hp in zip(dev_pages.tolist(), host_pages.tolist()):
            assert torch.equal(tier.buffer[hp * P : (hp + 1) * P], full[dp * P * c + r : (dp + 1) * P * c : c])
        assert torch.all(tier.buffer[P : 2 * P] == 0)  # host page 1 untouched
        # token-unit lists give the same local rows
        v = widened_page_indices(dev_pages, P, c)
        assert torch.equal(local_rows(v, c, r), torch.cat([torch.arange(4 * P, 5 * P), torch.arange(P, 2 * P)]))


def test_host_tier_errors():
    c = 2
    tier = HostKVTier(2, P, c, 1, D, torch.float32, pin_memory=False)
    pool = torch.randn(8 * P, D)
    page = widened_page_indices([1], P, c)
    with pytest.raises(HostTierError, match="whole widened pages"):
        tier.offload(pool, page[:-1], widened_page_indices([0], P, c)[:-1])
    with pytest.raises(HostTierError, match="partial or unaligned page"):
        tier.offload(pool, page + 1, widened_page_indices([0], P, c))
    with pytest.raises(HostTierError, match="differ in length"):
        tier.reload(pool, widened_page_indices([1, 2], P, c), widened_page_indices([0], P, c))
    with pytest.raises(HostTierError, match="out of range"):
        tier.reload(pool, [3], [2], unit="page")
    with pytest.raises(HostTierError, match="dtype"):
        tier.offload(pool.double(), [1], [0], unit="page")
    with pytest.raises(HostTierError, match="rank"):
        HostKVTier(2, P, c, 2, D)


def test_host_tier_rejects_many_to_one_copies():
    c = 2
    tier = HostKVTier(4, P, c, 0, D, torch.float32, pin_memory=False)
    pool = torch.randn(8 * P, D)
    # two device pages offloaded to one host page: the second silently overwrote the first
    with pytest.raises(HostTierError, match=r"host page 0.*twice|duplicate"):
        tier.offload(pool, [1, 2], [0, 0], unit="page")
    with pytest.raises(HostTierError, match=r"twice|duplicate"):
        tier.offload(pool, widened_page_indices([1, 2], P, c), widened_page_indices([3, 3], P, c))
    # and two host pages reloaded into one device page
    with pytest.raises(HostTierError, match=r"device page 5.*twice|duplicate"):
        tier.reload(pool, [5, 5], [0, 1], unit="page")
    assert torch.all(tier.buffer == 0)
    # one source copied to two destinations is fine
    assert tier.offload(pool, [1, 1], [0, 1], unit="page") == 2 * P


@pytest.mark.parametrize("kw, name", [
    ({"num_host_pages": True}, "num_host_pages"), ({"page_size": True}, "page_size"), ({"c": True}, "c"),
    ({"rank": False}, "rank"), ({"rank": -1}, "rank"), ({"dim": True}, "dim"),
])
def test_host_tier_rejects_bool_sizes_and_negative_rank(kw, name):
    args = {"num_host_pages": 2, "page_size": P, "c": 2, "rank": 0, "dim": D, **kw}
    with pytest.raises(HostTierError, match=rf"\b{name}\b.*{list(kw.values())[0]!r}"):
        HostKVTier(**args, dtype=torch.float32, pin_memory=False)


def test_index_helpers_reject_negative_and_bool_arguments():
    v = widened_page_indices([1], P, 2)
    for call, name in [
        (lambda: widened_page_indices([1], -1, 2), "page_size=-1"),
        (lambda: widened_page_indices([1], True, 2), "page_size=True"),
        (lambda: widened_page_indices([1], P, 0), "c=0"),
        (lambda: widened_page_indices([1], P, True), "c=True"),
        (lambda: widened_page_indices([-1], P, 2), "negative"),
        (lambda: local_rows(v, 2, -1), "rank"),
        (lambda: local_rows(v, 2, True), "rank"),
        (lambda: local_rows(v, True, 0), "c"),
    ]:
        with pytest.raises(ValueError, match=name):
            call()


def _attend(q, pool, r2t, n, c, r, group_name):
    pos = owned_positions(0, n, c, r)
    kv = pool[r2t[pos] // c].unsqueeze(0)
    o, lse = attention_reference(AttentionCall(q, None, kv, None, DL, SCALE))
    return exchange_replicated(o, lse, group_name, c)


class _NoCollectives:
    """Make every torch.distributed entry point raise while the host tier runs."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast",
             "barrier", "reduce_scatter_tensor", "send", "recv", "isend", "irecv")

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}

        def boom(*a, **k):
            raise AssertionError("the host tier issued a collective")

        for n in self.NAMES:
            setattr(dist, n, boom)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(dist, n, f)


def _tier_worker(rank, world, seed):
    c, r = world, rank
    check = Checks()
    torch.manual_seed(seed)
    gname = dist.group.WORLD.group_name
    alloc = PagedVirtualAllocator(16 * P, P, c)
    pool = torch.randn(16 * P, D)  # old content everywhere
    tier = HostKVTier(8, P, c, r, D, torch.float32)
    alloc.allocate("x", 5)
    results = []
    for n in (2 * P * c + 3, P * c, 1):
        dense = torch.randn(n + 1, D)  # n cached tokens + one decoded later
        q1, q2 = torch.randn(1, 1, H, D), torch.randn(1, 1, H, D)
        alloc.allocate("a", n)
        r2t = alloc.req_to_token("a")
        kept, _, slots = filter_owned(r2t, c, r)
        pool[slots] = dense[:n][kept]
        before = _attend(q1, pool, r2t, n, c, r, gname)

        pages = alloc.page_table("a")
        host_pages = torch.randperm(8)[: pages.numel()]
        with _NoCollectives():
            moved = tier.offload(pool, widened_page_indices(pages, P, c), widened_page_indices(host_pages, P, c))
            check(moved == pages.numel() * P, moved)
            if r == 1:  # rank 1 moves its shard again, on its own: no collective to pair with
                tier.offload(pool, pages, host_pages, unit="page")
        alloc.free("a")
        # the device pages are reused by someone else: garbage everywhere they were
        for p in pages.tolist():
            pool[p * P : (p + 1) * P] = float("nan")
        alloc.allocate("filler", P * c + 1)  # the request comes back on other pages
        alloc.allocate("a", n)
        new_pages = alloc.page_table("a")
        check(not torch.equal(new_pages, pages), "request came back on the same pages")
        with _NoCollectives():
            check(tier.reload(pool, new_pages, host_pages, unit="page") == pages.numel() * P)
        r2t = alloc.req_to_token("a")
        after = _attend(q1, pool, r2t, n, c, r, gname)
        check(torch.isfinite(after).all(), "non-finite after reload", n)
        check(torch.equal(after, before), (n, (after - before).abs().max()))
        # continue decoding one token on the reloaded cache
        v = alloc.allocate("a", 1)
        kept, _, slots = filter_owned(v, c, r)
        pool[slots] = dense[n:][kept]
        out = _attend(q2, pool, alloc.req_to_token("a"), n + 1, c, r, gname)
        ref, _ = attention_reference(AttentionCall(q2, None, dense.unsqueeze(0), None, DL, SCALE))
        err = (out - ref).abs().max().item()
        check(err < 1e-5, (n, err))
        results.append((n, err))
        alloc.free("a")
        alloc.free("filler")
    return results, check.fails


def test_offload_garbage_reload_continue_decoding_gloo():
    out = run_ranks(_tier_worker, 2, 99, timeout=120)
    assert all(not fails for _, fails in out), [f for _, f in out]
    res = [log for log, _ in out]
    assert [n for n, _ in res[0]] == [2 * P * 2 + 3, P * 2, 1] and res[0] == res[1]
