"""PD disaggregation: transfer plans, pack/unpack and the send/recv executor.

The multi-process test runs one spawn of 5 gloo ranks:
  * relayout: rank 0 is a DCP1 prefill server, ranks 1..c the DCP-c decode group
    (c = 2 on ranks 1-2, then c = 4 on ranks 1-4);
  * page mode: ranks 1-2 are a DCP2 prefill group, ranks 3-4 a DCP2 decode group;
  * recurrent state: rank 0 (attention TP 1) -> ranks 1..4 (attention TP 4, DCP 4).
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.kernels.reference import attention_reference
from dcp_pass.runtime.decode.layout import PagedVirtualAllocator, local_length, owned_positions, shard_full_cache
from dcp_pass.runtime.decode.merge import merge_partials
from dcp_pass.runtime.compose.transfer import (
    PageLayout,
    StateTransferPlan,
    TransferPlanError,
    build_state_transfer,
    build_transfer_plan,
    build_transfer_plan_from_allocator,
    execute_transfer,
    pack_rows,
    unpack_rows_,
)
from dcp_pass.testing import Checks, run_ranks

P = 4  # physical page size on both sides
DL, DR = 16, 8  # latent and rotary columns of one fused cache row
D = DL + DR
H = 4
SCALE = 1.0 / math.sqrt(D)
POISON = float("nan")
OLD = 7.0e4  # what unused decode rows hold before the transfer


def _lengths(c: int) -> list[int]:
    return sorted({1, P - 1, P, P + 1, c * P - 1, c * P, c * P + 1, 61})


# ------------------------------------------------------------------ single-process


def test_rejects_unsupported_pairs_with_named_mismatch():
    f32 = torch.float32
    ok_pre = PageLayout(1, 0, P, f32)
    pt = torch.arange(4)
    idx = torch.arange(16)
    with pytest.raises(TransferPlanError, match=r"dcp_size=2 -> decode dcp_size=4"):
        build_transfer_plan(PageLayout(2, 0, P, f32), PageLayout(4, 0, P, f32), pt, 8, idx)
    with pytest.raises(TransferPlanError, match=r"dcp_size=4 -> decode dcp_size=1"):
        build_transfer_plan(PageLayout(4, 0, P, f32), PageLayout(1, 0, P, f32), pt, 8, idx)
    with pytest.raises(TransferPlanError, match=r"page size mismatch.*page_size=4.*page_size=8"):
        build_transfer_plan(ok_pre, PageLayout(2, 0, 8, f32), pt, 8, idx)
    with pytest.raises(TransferPlanError, match=r"KV dtype mismatch.*float32.*bfloat16"):
        build_transfer_plan(ok_pre, PageLayout(2, 0, P, torch.bfloat16), pt, 8, idx)
    with pytest.raises(TransferPlanError, match=r"attention CP size must be 1.*attn_cp_size=2"):
        build_transfer_plan(PageLayout(1, 0, P, f32, attn_cp_size=2), PageLayout(2, 0, P, f32), pt, 8, idx)
    with pytest.raises(TransferPlanError, match=r"DCP rank mismatch.*dcp_rank=0.*dcp_rank=1"):
        build_transfer_plan(PageLayout(2, 0, P, f32), PageLayout(2, 1, P, f32), pt, 8, idx)
    with pytest.raises(TransferPlanError, match=r"build_state_transfer"):
        build_transfer_plan(ok_pre, PageLayout(2, 0, P, f32), pt, 8, idx, pool_kind="recurrent")
    with pytest.raises(TransferPlanError, match=r"pool_kind='mha'"):
        build_transfer_plan(ok_pre, PageLayout(2, 0, P, f32), pt, 8, idx, pool_kind="mha")
    with pytest.raises(TransferPlanError, match=r"capacity"):
        build_transfer_plan(ok_pre, PageLayout(2, 0, P, f32), torch.arange(1), 8, idx)
    with pytest.raises(TransferPlanError, match=r"not position-aligned"):
        build_transfer_plan(ok_pre, PageLayout(2, 0, P, f32), pt, 8, idx + 1)
    with pytest.raises(TransferPlanError, match=r"0 <= dcp_rank < dcp_size=2"):
        PageLayout(2, 2, P, f32)
    # the accepted pairs
    assert build_transfer_plan(ok_pre, PageLayout(2, 1, P, f32), pt, 8, idx).mode == "relayout"
    assert build_transfer_plan(ok_pre, PageLayout(2, 1, P, f32), pt, 8, idx, "hybrid_mla").mode == "relayout"
    assert build_transfer_plan(PageLayout(2, 1, P, f32), PageLayout(2, 1, P, f32), pt, 8, idx).mode == "page"
    assert build_transfer_plan(ok_pre, PageLayout(1, 0, P, f32), pt, 8, idx).mode == "page"


@pytest.mark.parametrize("c", [2, 3, 4])
def test_relayout_plans_partition_the_request_exactly(c):
    g = torch.Generator().manual_seed(c)
    for n in _lengths(c) + [0]:
        pages = -(-n // P) + 1
        prefill_pt = torch.randperm(3 * pages, generator=g)[:pages]
        alloc = PagedVirtualAllocator(32 * P, P, c)
        alloc.allocate("other", 5)
        alloc.allocate("req", n)
        seen = []
        for r in range(c):
            plan = build_transfer_plan_from_allocator(
                PageLayout(1, 0, P, torch.float32), PageLayout(c, r, P, torch.float32), prefill_pt, alloc, "req"
            )
            assert plan.num_tokens == n and plan.rank_tokens == local_length(n, c, r)
            assert plan.rank_token_counts == tuple(local_length(n, c, q) for q in range(c))
            assert torch.equal(plan.positions % c, torch.full_like(plan.positions, r))
            assert torch.equal(plan.src_rows, prefill_pt[plan.positions // P] * P + plan.positions % P)
            assert torch.equal(plan.dst_slots, alloc.req_to_token("req")[plan.positions] // c)
            seen.append(plan.positions)
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(n))


def test_page_mode_local_copy_whole_pages_exact_last_count():
    c, n = 2, 2 * 3 * P + 3  # 3 full local pages + a partial one on rank 0 (and rank 1)
    g = torch.Generator().manual_seed(1)
    for r in range(c):
        lay = PageLayout(c, r, P, torch.float32)
        pt = torch.tensor([5, 1, 7, 2])
        src = torch.full((8 * P, D), POISON)
        n_local = local_length(n, c, r)
        real = torch.randn(n_local, D, generator=g)
        src[(pt.repeat_interleave(P) * P + torch.arange(4 * P) % P)[:n_local]] = real
        alloc = PagedVirtualAllocator(8 * P, P, c)
        alloc.allocate("x", 3)
        alloc.allocate("req", n)
        plan = build_transfer_plan_from_allocator(lay, lay, pt, alloc, "req")
        assert plan.mode == "page" and plan.src_pages == (5, 1, 7, 2)
        assert plan.page_token_counts == (P, P, P, n_local - 3 * P)
        assert plan.dst_pages == tuple(int(p) for p in alloc.page_table("req")[:4])
        dst = torch.full((8 * P, D), OLD)
        assert execute_transfer(plan, src, dst, 0, 0) == n_local  # no process group: local copy
        assert torch.equal(dst[plan.dst_slots], real)
        untouched = torch.ones(8 * P, dtype=torch.bool)
        untouched[plan.dst_slots] = False
        assert torch.all(dst[untouched] == OLD)  # NaN rows of the partial last page never leak


def test_state_transfer_keeps_attention_tp_mapping_and_ignores_dcp():
    Hs, slots = 8, 3
    g = torch.Generator().manual_seed(2)
    for tp_pre, tp_dec, dcp in [(1, 4, 4), (2, 4, 2), (4, 2, 1), (2, 2, 2)]:
        src_pools = [torch.randn(slots, Hs // tp_pre, 3, 5, generator=g) for _ in range(tp_pre)]
        full = torch.cat([p[1] for p in src_pools], dim=0)  # [Hs, 3, 5] of slot 1
        for t in range(tp_dec):
            plans = build_state_transfer(Hs, tp_pre, tp_dec, t, src_slot=1, dst_slot=2, decode_dcp_size=dcp)
            assert plans == build_state_transfer(Hs, tp_pre, tp_dec, t, 1, 2, decode_dcp_size=1)
            dst = torch.zeros(slots, Hs // tp_dec, 3, 5)
            for pl in plans:
                assert isinstance(pl, StateTransferPlan) and pl.dst_tp_rank == t
                unpack_rows_(dst, pl, pack_rows(src_pools[pl.src_tp_rank], pl))
            hd = Hs // tp_dec
            assert torch.equal(dst[2], full[t * hd : (t + 1) * hd])
            assert torch.all(dst[[0, 1]] == 0)
    with pytest.raises(TransferPlanError, match="not divisible"):
        build_state_transfer(6, 1, 4, 0, 0, 0)


def test_state_transfer_rejects_negative_and_bool_indices():
    # dst_slot=-1 would index the pool's LAST slot by Python rules: another request's state
    for kw, name in [({"dst_slot": -1}, "dst_slot=-1"), ({"src_slot": -2}, "src_slot=-2"),
                     ({"dst_slot": True}, "dst_slot=True"), ({"src_slot": False}, "src_slot=False"),
                     ({"decode_attn_tp_rank": -1}, "decode_attn_tp_rank=-1"),
                     ({"decode_attn_tp_rank": False}, "decode_attn_tp_rank=False"),
                     ({"num_heads": True, "prefill_attn_tp_size": 1, "decode_attn_tp_size": 1}, "num_heads=True"),
                     ({"decode_attn_tp_size": True, "decode_attn_tp_rank": 0}, "decode_attn_tp_size=True"),
                     ({"decode_dcp_size": True}, "decode_dcp_size=True")]:
        args = dict(num_heads=8, prefill_attn_tp_size=1, decode_attn_tp_size=4, decode_attn_tp_rank=1,
                    src_slot=0, dst_slot=1)
        args.update(kw)
        with pytest.raises(ValueError, match=re.escape(name)):
            build_state_transfer(**args)
    with pytest.raises(ValueError, match=r"dst_slot=-1"):
        StateTransferPlan(0, 0, 0, -1, 0, 2, 0, 2)
    with pytest.raises(ValueError, match=r"src_head_end"):
        StateTransferPlan(0, 0, 0, 0, 3, 2, 0, 2)
    # a plan whose slot or heads fall outside the pool must not be clipped or wrapped
    pool = torch.zeros(3, 2, 5)
    with pytest.raises(TransferPlanError, match=r"slot 3"):
        pack_rows(pool, StateTransferPlan(0, 0, 3, 0, 0, 2, 0, 2))
    with pytest.raises(TransferPlanError, match=r"heads \[0, 4\)"):
        pack_rows(pool, StateTransferPlan(0, 0, 0, 0, 0, 4, 0, 4))
    with pytest.raises(TransferPlanError, match=r"slot 5"):
        unpack_rows_(pool, StateTransferPlan(0, 0, 0, 5, 0, 2, 0, 2), torch.ones(2, 5))


def test_kv_plans_reject_duplicate_rows_and_bool_layouts():
    f32 = torch.float32
    # decode map hands rank 0 virtual indices 0 and 4 twice: two tokens to one slot
    idx = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    with pytest.raises(TransferPlanError, match=r"decode slot.*twice|duplicate"):
        build_transfer_plan(PageLayout(1, 0, P, f32), PageLayout(2, 0, P, f32), torch.arange(2), 8, idx)
    # page mode: whole pages repeated pass the page-contiguity check, but not this one
    idx2 = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])  # P=2, c=2: local slots 0,1,0,1 = page 0 twice
    with pytest.raises(TransferPlanError, match=r"decode slot.*twice|duplicate"):
        build_transfer_plan(PageLayout(2, 0, 2, f32), PageLayout(2, 0, 2, f32), torch.arange(2), 8, idx2)
    # a prefill page listed twice would send the same rows for two different tokens
    with pytest.raises(TransferPlanError, match=r"prefill.*twice|duplicate"):
        build_transfer_plan(PageLayout(1, 0, P, f32), PageLayout(2, 0, P, f32), torch.tensor([3, 3]), 8,
                            torch.arange(8))
    for kw in ({"dcp_rank": False}, {"dcp_size": True}, {"page_size": True}, {"dcp_rank": -1}):
        with pytest.raises(TransferPlanError, match=list(kw)[0]):
            PageLayout(**{"dcp_size": 2, "dcp_rank": 0, "page_size": P, "kv_dtype": f32, **kw})


def test_execute_transfer_rejects_negative_and_bool_ranks():
    plan = build_transfer_plan(PageLayout(1, 0, P, torch.float32), PageLayout(1, 0, P, torch.float32),
                               torch.arange(2), 8, torch.arange(8))
    src, dst = torch.zeros(8, D), torch.zeros(8, D)
    for s, d, name in [(-1, 0, "src_rank=-1"), (0, -1, "dst_rank=-1"), (False, 0, "src_rank=False"),
                       (0, True, "dst_rank=True")]:
        with pytest.raises(ValueError, match=re.escape(name)):
            execute_transfer(plan, src, dst, s, d)


# ------------------------------------------------------------------ multi-process


def _local_attention(q, pool, req_to_token, n, c, r):
    """Decode rank r: attention over its stripe, read back through the allocator's map."""
    pos = owned_positions(0, n, c, r)
    kv = pool[req_to_token[pos] // c].unsqueeze(0)  # [1, n_local, D]
    return attention_reference(AttentionCall(q, None, kv, None, DL, SCALE))


def _decode_attention_check(q, pool, req_to_token, dense, n, c, r, grp):
    o, lse = _local_attention(q, pool, req_to_token, n, c, r)
    os_ = [torch.empty_like(o) for _ in range(c)]
    ls_ = [torch.empty_like(lse) for _ in range(c)]
    dist.all_gather(os_, o, group=grp)
    dist.all_gather(ls_, lse, group=grp)
    merged = merge_partials(torch.stack(os_), torch.stack(ls_))
    ref, _ = attention_reference(AttentionCall(q, None, dense.unsqueeze(0), None, DL, SCALE))
    return (merged - ref).abs().max().item()


def _pd_worker(rank, world, seed):
    check = Checks()
    torch.manual_seed(seed)  # identical draws on every rank: shared "ground truth"
    f32 = torch.float32
    grp2 = dist.new_group([1, 2])
    grp4 = dist.new_group([1, 2, 3, 4])
    log = []

    # ---- relayout: DCP1 prefill on rank 0 -> DCP-c decode on ranks 1..c
    for c, grp in ((2, grp2), (4, grp4)):
        for n in _lengths(c):
            dense = torch.randn(n, D)
            q = torch.randn(1, 1, H, D)
            n_pages = -(-n // P)
            pool_pages = 2 * n_pages + 3
            prefill_pt = torch.randperm(pool_pages)[:n_pages]
            alloc = PagedVirtualAllocator(64 * P, P, c)
            alloc.allocate("older", 1 + n % 5)  # the request does not start at page 0
            alloc.allocate("req", n)
            old = torch.randn(64 * P, D) + OLD
            if rank == 0:
                # dense prefill pool: every row that is not a token of the request is poison
                src = torch.full((pool_pages * P, D), POISON)
                src[(prefill_pt.repeat_interleave(P) * P + torch.arange(n_pages * P) % P)[:n]] = dense
                for r in range(c):
                    plan = build_transfer_plan_from_allocator(
                        PageLayout(1, 0, P, f32), PageLayout(c, r, P, f32), prefill_pt, alloc, "req"
                    )
                    execute_transfer(plan, src, None, 0, 1 + r)
            elif rank <= c:
                r = rank - 1
                plan = build_transfer_plan_from_allocator(
                    PageLayout(1, 0, P, f32), PageLayout(c, r, P, f32), prefill_pt, alloc, "req"
                )
                pool = old.clone()
                moved = execute_transfer(plan, None, pool, 0, rank)
                check(moved == local_length(n, c, r) == plan.rank_token_counts[r], c, n, r, moved)
                r2t = alloc.req_to_token("req")
                n_local = local_length(n, c, r)
                # the striped pages equal the brute-force shard of the dense cache
                mine = pool[r2t[owned_positions(0, n, c, r)] // c]
                check(torch.equal(mine, shard_full_cache(dense.unsqueeze(0), c, r)[0, :n_local]), (c, n, r))
                untouched = torch.ones(pool.shape[0], dtype=torch.bool)
                untouched[plan.dst_slots] = False
                check(torch.equal(pool[untouched], old[untouched]), "stale/poison rows leaked")
                check(torch.isfinite(pool).all(), "non-finite decode pool", c, n, r)
                err = _decode_attention_check(q, pool, r2t, dense, n, c, r, grp)
                check(err < 1e-5, (c, n, r, err))
                log.append(("relayout", c, n, moved, err))

    # ---- page mode: DCP2 prefill (ranks 1, 2) -> DCP2 decode (ranks 3, 4), same DCP rank
    c = 2
    for n in _lengths(c):
        dense = torch.randn(n, D)
        pre_alloc = PagedVirtualAllocator(16 * P, P, c)
        pre_alloc.allocate("req", n)
        dec_alloc = PagedVirtualAllocator(16 * P, P, c)
        dec_alloc.allocate("x", 2 * P + 1)
        dec_alloc.allocate("req", n)
        if rank in (1, 2, 3, 4):
            r = (rank - 1) % 2
            lay = PageLayout(c, r, P, f32)
            plan = build_transfer_plan_from_allocator(lay, lay, pre_alloc.page_table("req"), dec_alloc, "req")
            check(plan.mode == "page", plan.mode)
            if rank in (1, 2):
                src = torch.full((16 * P, D), POISON)  # a striped prefill pool with a poisoned tail page
                r2t = pre_alloc.req_to_token("req")
                pos = owned_positions(0, n, c, r)
                src[r2t[pos] // c] = dense[pos]
                execute_transfer(plan, src, None, rank, rank + 2)
            else:
                dst = torch.full((16 * P, D), OLD)
                execute_transfer(plan, None, dst, rank - 2, rank)
                r2t = dec_alloc.req_to_token("req")
                pos = owned_positions(0, n, c, r)
                check(torch.equal(dst[r2t[pos] // c], dense[pos]), "page mode rows", n, r)
                check(torch.isfinite(dst).all(), "page mode leaked poison", n, r)
                check(int((dst != OLD).any(dim=1).sum()) == local_length(n, c, r), "page mode row count", n, r)
                log.append(("page", c, n, plan.rank_tokens, plan.page_token_counts))

    # ---- recurrent state: attention TP 1 -> TP 4 with DCP 4; no DCP filtering
    Hs = 8
    state = torch.randn(3, Hs, 4, 6)
    if rank == 0:
        for t in range(4):
            for pl in build_state_transfer(Hs, 1, 4, t, src_slot=2, dst_slot=0, decode_dcp_size=4):
                execute_transfer(pl, state, None, 0, 1 + t)
    else:
        t = rank - 1
        dst = torch.zeros(2, Hs // 4, 4, 6)
        for pl in build_state_transfer(Hs, 1, 4, t, src_slot=2, dst_slot=0, decode_dcp_size=4):
            execute_transfer(pl, None, dst, 0, rank)
        check(torch.equal(dst[0], state[2, 2 * t : 2 * t + 2]) and torch.all(dst[1] == 0), "state", t)
        log.append(("state", t))
    return log, check.fails


def test_pd_transfer_end_to_end_gloo():
    res = run_ranks(_pd_worker, 5, 1234, timeout=180)
    assert all(not fails for _, fails in res), [f for _, f in res]
    logs = [log for log, _ in res]
    assert logs[0] == []
    # every decode rank checked every length it takes part in
    assert sum(1 for e in logs[1] if e[0] == "relayout") == len(_lengths(2)) + len(_lengths(4))
    assert sum(1 for e in logs[4] if e[0] == "relayout") == len(_lengths(4))
    assert sum(1 for e in logs[3] if e[0] == "page") == len(_lengths(2))
    assert all(any(e[0] == "state" for e in logs[r]) for r in range(1, 5))
    # some decode rank got zero tokens (n = 1) and the merge still matched
    assert any(e[0] == "relayout" and e[3] == 0 for e in logs[2])


def _mismatched_rows_worker(rank, world, widths):
    """Rank 0 sends rows of widths[0] columns, rank 1's pool holds widths[1] (a fused prefill
    pool into a latent-only decode pool, or the other way): what each side raised."""
    f32 = torch.float32
    n = 11
    alloc = PagedVirtualAllocator(16 * P, P, 1)
    alloc.allocate("req", n)
    prefill_pt = torch.arange(-(-n // P))
    plan = build_transfer_plan_from_allocator(PageLayout(1, 0, P, f32), PageLayout(1, 0, P, f32), prefill_pt, alloc,
                                              "req")
    src = torch.randn(prefill_pt.numel() * P, widths[0]) if rank == 0 else None
    dst = torch.zeros(16 * P, widths[1]) if rank == 1 else None
    try:
        execute_transfer(plan, src, dst, 0, 1)
    except TransferPlanError as e:
        return str(e)
    return None


@pytest.mark.parametrize("widths", [(24, 16), (16, 24)])
def test_rows_of_another_width_are_refused_on_both_sides(widths):
    """gloo takes a message into a receive buffer of another size without a word: a wider
    source lost columns, a narrower one left the rest of each row as it was (before: no error,
    or a crash of the receiving process). Both sides now swap the rows' shape first."""
    for message in run_ranks(_mismatched_rows_worker, 2, widths, timeout=120):
        assert message is not None and "do not move the same rows" in message, message
        assert f"shape ({widths[0]},)" in message and f"shape ({widths[1]},)" in message, message
