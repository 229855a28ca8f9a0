"""DCP-aware target verification: sharded + merged == unsharded, and no off-by-one.

One spawn of 2 gloo ranks (c = 2) checks a per-sequence striped cache and a paged
cache with a rank-local page table built from the allocator's cyclic token map.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dcp_pass.runtime.decode.layout import PagedVirtualAllocator, owned_positions, shard_full_cache
from dcp_pass.runtime.compose.speculative import rank_local_page_table, verify_attention, verify_query_positions
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.testing import Checks, run_ranks

DL, DR, H, K = 16, 8, 4, 3
D = DL + DR
P = 2
SCALE = 1.0 / math.sqrt(D)
HUGE = 1.0e30


def _naive_verify(q, full, kv_len):
    """float64: query i of row b attends to positions 0 .. kv_len[b]-K+i (fused cache)."""
    B = q.shape[0]
    out = torch.zeros(B, K, H, DL, dtype=torch.float64)
    for b in range(B):
        for i in range(K):
            keys = full[b, : int(kv_len[b]) - K + i + 1].double()
            p = torch.softmax(q[b, i].double() @ keys.T * SCALE, dim=-1)
            out[b, i] = p @ keys[:, :DL]
    return out


def _poisoned(full, kv_len, i):
    """Copy where every key after query i's causal bound is huge, and NaN past kv_len."""
    x = full.clone()
    for b in range(x.shape[0]):
        bound = int(kv_len[b]) - K + i  # last visible position of query i
        x[b, bound + 1 : int(kv_len[b])] = HUGE  # draft rows beyond the bound (real, finite)
        x[b, int(kv_len[b]) :] = float("nan")  # stale rows past the sequence
    return x


def _paged(full, kv_len, c, r):
    """Rank r's paged pool holding its stripe of every row; returns (pool, page_table)."""
    alloc = PagedVirtualAllocator(64 * P, P, c)
    alloc.allocate("pad", 3)
    r2t = []
    for b in range(full.shape[0]):
        alloc.allocate(b, int(kv_len[b]))
        r2t.append(alloc.req_to_token(b))
    pool = torch.full((64 * P, D), float("nan"))
    for b, m in enumerate(r2t):
        pos = owned_positions(0, int(kv_len[b]), c, r)
        pool[m[pos] // c] = full[b, pos]
    return pool.view(64, P, D), rank_local_page_table(r2t, kv_len, c, r, P)


def _verify_worker(rank, world, seed):
    c, r = world, rank
    check = Checks()
    torch.manual_seed(seed)
    gname = dist.group.WORLD.group_name
    kv_len = torch.tensor([K, K + 1, 9, 17, 12])  # ragged; the first row is only the drafts
    B, T = kv_len.numel(), int(kv_len.max())
    full = torch.randn(B, T, D)
    q = torch.randn(B, K, H, D)
    ref = _naive_verify(q, full, kv_len).float()
    hs = slice(r * H // c, (r + 1) * H // c)
    errs = []

    def run_all(cache):
        striped = shard_full_cache(cache, c, r)
        pool, table = _paged(cache, kv_len, c, r)
        dense = AttentionCall(q, None, striped, None, DL, SCALE, kv_lens=kv_len, stripe=(c, r))
        dense_local = verify_attention(dense, K)
        shard = verify_attention(dense, K, exchange="a2a", group=gname)
        paged = AttentionCall(q, None, pool, None, DL, SCALE, kv_lens=kv_len, stripe=(c, r), page_table=table)
        merged = verify_attention(paged, K, exchange="replicated", group=gname)
        return dense_local, shard, merged

    (o_loc, _), shard, merged = run_all(full)
    check(shard.shape == (B, K, H // c, DL), shard.shape)
    errs.append((shard - ref[:, :, hs]).abs().max().item())
    errs.append((merged - ref).abs().max().item())
    check(max(errs) < 1e-4, "merged != unsharded", errs)
    check((o_loc - ref).abs().max() > 1e-2, "a rank-local partial alone already matched")

    # poison everything after each query's causal bound: query i's output must not move
    for i in range(K):
        _, shard_p, merged_p = run_all(_poisoned(full, kv_len, i))
        e1 = (shard_p[:, i] - shard[:, i]).abs().max().item()
        e2 = (merged_p[:, i] - merged[:, i]).abs().max().item()
        check(e1 < 1e-6 and e2 < 1e-6, "poisoned row leaked into query", i, e1, e2)
        errs += [e1, e2]
    return errs, check.fails


def test_verification_on_two_ranks_matches_unsharded_and_ignores_poison():
    res = run_ranks(_verify_worker, 2, 11, timeout=120)
    assert all(not f for _, f in res), [f for _, f in res]


def test_verify_single_rank_and_query_positions():
    torch.manual_seed(5)
    kv_len = torch.tensor([K, 10, 6])
    full = torch.randn(3, 10, D)
    q = torch.randn(3, K, H, D)
    assert torch.equal(verify_query_positions(kv_len, K), torch.tensor([[0, 1, 2], [7, 8, 9], [3, 4, 5]]))
    call = AttentionCall(q, None, _poisoned(full, kv_len, K - 1), None, DL, SCALE, kv_lens=kv_len)
    o, lse = verify_attention(call, K)
    assert (o - _naive_verify(q, full, kv_len).float()).abs().max() < 1e-4
    assert torch.isfinite(lse).all()
    with pytest.raises(ValueError, match="include the 3 verified tokens"):
        verify_query_positions(torch.tensor([2]), K)
    with pytest.raises(ValueError, match="causal cap comes from kv_lens"):
        verify_attention(call.replace(q_pos=torch.zeros(3, K)), K)
    with pytest.raises(ValueError, match="page-contiguous"):
        rank_local_page_table([torch.arange(8).flip(0) * 2], [8], 2, 0, 2)
    # a map whose positions are right for c=2 but whose pages are whole for rank 0 only: every
    # rank raises, naming rank 1 (before: rank 0 built its table and waited in the exchange)
    for rank in range(2):
        with pytest.raises(ValueError, match="rank 1's local slots are not page-contiguous"):
            rank_local_page_table(torch.tensor([[0, 1, 2, 5]]), [4], 2, rank, 2)
    with pytest.raises(ValueError, match="global_kv_len must be ints"):  # was cut to 4 without a word
        rank_local_page_table([torch.arange(8)], torch.tensor([4.5]), 2, 0, 2)
