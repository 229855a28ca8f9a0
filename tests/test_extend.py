"""Extend (prefill with a cached prefix) on a striped cache: gather path and DCP path.

One spawn of 3 gloo ranks runs c = 2 (ranks 0-1, a sub-group) and c = 3 (all ranks).
Both paths are compared with a naive float64 per-query attention written here.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dcp_pass.runtime.compose.extend import extend_attention_dcp, extend_attention_gather, gather_prefix
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.layout import local_capacity, local_length, striped_write_
from dcp_pass.testing import Checks, run_ranks

DL, DR, H = 16, 8, 6  # H divisible by 2 and 3
SCALE = 1.0 / math.sqrt(DL + DR)
POISON = 1.0e30  # unused cache rows: any read of them would blow the output up


def _naive(q, qr, prefix, new, new_pe_, prefix_pe, lens):
    """Per (row, query) softmax attention over prefix[:len] + new[:i+1], in float64."""
    B, S = new.shape[:2]
    out = torch.zeros(B, S, H, DL, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        for i in range(S):
            k = torch.cat([prefix[b, :L], new[b, : i + 1]]).double()
            kp = torch.cat([prefix_pe[b, :L], new_pe_[b, : i + 1]]).double()
            s = (q[b, i].double() @ k.T + qr[b, i].double() @ kp.T) * SCALE  # [H, T]
            out[b, i] = torch.softmax(s, dim=-1) @ k
    return out


def _call(q, qr, kv, pe, c, r):
    """The new tokens' queries over rank r's striped caches."""
    return AttentionCall(q, qr, kv, pe, DL, SCALE, stripe=(c, r))


def _striped(full, lens, cap, c, r):
    st = torch.full((full.shape[0], cap, full.shape[2]), POISON)
    for b in range(full.shape[0]):
        striped_write_(st, full[b : b + 1, : int(lens[b])], 0, c, r, batch_start=b)
    return st


def _extend_worker(rank, world, seed):
    check = Checks()
    torch.manual_seed(seed)
    g01 = dist.new_group([0, 1])
    log = []
    cases = [
        (2, g01, [0, 1, 7, 13], 3),
        (2, g01, [0, 0, 0, 0], 2),
        (3, dist.group.WORLD, [2, 0, 5, 11], 3),
        (3, dist.group.WORLD, [1, 4, 0, 3], 1),
    ]
    for c, grp, lens, S in cases:
        B = len(lens)
        lens = torch.tensor(lens)
        lmax = int(lens.max())
        prefix = torch.randn(B, lmax, DL)
        prefix_pe = torch.randn(B, lmax, DR)
        new = torch.randn(B, S, DL)
        new_pe = torch.randn(B, S, DR)
        q = torch.randn(B, S, H, DL)
        qr = torch.randn(B, S, H, DR)
        if rank >= c:
            continue
        r = rank
        ref = _naive(q, qr, prefix, new, new_pe, prefix_pe, lens).float()
        cap = local_capacity(lmax + S, c) + 1
        kv0, pe0 = _striped(prefix, lens, cap, c, r), _striped(prefix_pe, lens, cap, c, r)

        # gather_prefix alone restores token order and zeroes past each row's length
        got = gather_prefix(kv0, lens, grp, c)
        want = prefix * (torch.arange(lmax).view(1, -1) < lens.view(-1, 1)).unsqueeze(-1)
        check(torch.equal(got, want), (c, lens))

        # (a) gather path
        kv, pe = kv0.clone(), pe0.clone()
        out, lse = extend_attention_gather(_call(q, qr, kv, pe, c, r), new, new_pe, lens, grp)
        err_g = (out - ref).abs().max().item()
        check(err_g < 1e-4, ("gather", c, lens, err_g))
        # the new tokens were written striped, nothing else changed
        full_new = torch.full((B, lmax + S, DL), float("nan"))
        for b in range(B):
            L = int(lens[b])
            full_new[b, :L] = prefix[b, :L]
            full_new[b, L : L + S] = new[b]
        for b in range(B):
            n_loc = local_length(int(lens[b]) + S, c, r)
            check(torch.equal(kv[b, :n_loc], full_new[b, r::c][:n_loc]))
            check(torch.all(kv[b, n_loc:] == POISON))
        # (b) DCP path: local partials with global causality + the usual exchanges
        hs = slice(r * H // c, (r + 1) * H // c)
        kv_d, pe_d = kv0.clone(), pe0.clone()
        shard = extend_attention_dcp(_call(q, qr, kv_d, pe_d, c, r), new, new_pe, lens, exchange="a2a", group=grp)
        check(torch.equal(kv_d, kv) and torch.equal(pe_d, pe), "dcp writes differ")  # same striped writes as (a)
        check(shard.shape == (B, S, H // c, DL), shard.shape)
        err_d = (shard - ref[:, :, hs]).abs().max().item()
        check(err_d < 1e-4, ("dcp a2a", c, lens, err_d))
        rep = extend_attention_dcp(_call(q, qr, kv0.clone(), pe0.clone(), c, r), new, new_pe, lens,
                                   exchange="replicated", group=grp.group_name)
        err_r = (rep - ref).abs().max().item()
        check(err_r < 1e-4, ("dcp replicated", c, lens, err_r))
        # the local partial alone is NOT the answer for c > 1 (the test can tell)
        o_loc, _ = extend_attention_dcp(_call(q, qr, kv0.clone(), pe0.clone(), c, r), new, new_pe, lens)
        check((o_loc - ref).abs().max().item() > 1e-2, "local partial already equals the merge")
        log.append((c, tuple(lens.tolist()), S, err_g, err_d, err_r))
    return log, check.fails


def test_extend_gather_and_dcp_paths_match_unsharded_gloo():
    res = run_ranks(_extend_worker, 3, 7, timeout=180)
    assert all(not fails for _, fails in res), [f for _, f in res]
    logs = [log for log, _ in res]
    assert len(logs[0]) == 4 and len(logs[1]) == 4 and len(logs[2]) == 2


def test_extend_single_rank_equals_both_paths():
    """c = 1: no collective; both paths are the plain computation."""
    torch.manual_seed(3)
    B, S, lens = 3, 4, torch.tensor([5, 0, 2])
    prefix, prefix_pe = torch.randn(B, 5, DL), torch.randn(B, 5, DR)
    new, new_pe = torch.randn(B, S, DL), torch.randn(B, S, DR)
    q, qr = torch.randn(B, S, H, DL), torch.randn(B, S, H, DR)
    ref = _naive(q, qr, prefix, new, new_pe, prefix_pe, lens).float()
    kv, pe = _striped(prefix, lens, 10, 1, 0), _striped(prefix_pe, lens, 10, 1, 0)
    out, _ = extend_attention_gather(_call(q, qr, kv.clone(), pe.clone(), 1, 0), new, new_pe, lens, None)
    assert (out - ref).abs().max() < 1e-4
    out2 = extend_attention_dcp(_call(q, qr, kv.clone(), pe.clone(), 1, 0), new, new_pe, lens, exchange="a2a")
    assert (out2 - ref).abs().max() < 1e-4
    with pytest.raises(ValueError, match="come from prefix_lens"):
        extend_attention_dcp(_call(q, qr, kv.clone(), pe.clone(), 1, 0).replace(kv_lens=3), new, new_pe, lens)


def _extend_past_the_count(fill, device, dtype):
    """Every rank's partial of extend's DCP path over caches whose rows past the counts hold
    `fill`, merged in one process; (merged output, the float64 reference)."""
    from dcp_pass.runtime.decode.merge import merge_partials

    torch.manual_seed(3)
    B, S, c = 3, 2, 2
    lens = torch.tensor([5, 3, 0])
    prefix, prefix_pe = torch.randn(B, 5, DL), torch.randn(B, 5, DR)
    new, new_pe = torch.randn(B, S, DL), torch.randn(B, S, DR)
    q, qr = torch.randn(B, S, H, DL), torch.randn(B, S, H, DR)
    cap = local_capacity(5 + S, c) + 2
    outs, lses = [], []
    on = {"device": device, "dtype": dtype}
    for r in range(c):
        kv, pe = _striped(prefix, lens, cap, c, r), _striped(prefix_pe, lens, cap, c, r)
        kv[kv == POISON], pe[pe == POISON] = fill, fill
        o, lse = extend_attention_dcp(_call(q.to(**on), qr.to(**on), kv.to(**on), pe.to(**on), c, r), new.to(**on),
                                      new_pe.to(**on), lens)
        outs.append(o.cpu())
        lses.append(lse.cpu())
    out, _ = merge_partials(torch.stack(outs), torch.stack(lses), "e", torch.float64, True)
    return out, _naive(q, qr, prefix, new, new_pe, prefix_pe, lens)


@pytest.mark.parametrize("fill", [POISON, float("nan"), float("inf")])
def test_extend_dcp_never_reads_rows_past_the_count(fill):
    """Rows past a row's count hold no key: a reused slot's stale NaN or inf there must not
    reach the output through 0 * NaN (before: the DCP path on the torch kernel gave NaN rows
    where the gather path and the model without DCP were finite). Every rank's partial,
    merged in one process, against the float64 reference."""
    out, want = _extend_past_the_count(fill, "cpu", torch.float32)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_gpu_extend_dcp_never_reads_rows_past_the_count(fill):
    """The same on the GPU kernels (bf16)."""
    out, want = _extend_past_the_count(fill, "cuda", torch.bfloat16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=3e-2, atol=3e-2)


def test_a_cache_too_small_for_rank_0_is_refused_on_every_rank():
    """Rank 0 holds the most rows of a striped sequence: a cache that fits rank 1's rows but not
    rank 0's is refused on both, so no rank writes and goes on to the exchange alone (before:
    rank 0 raised and rank 1 waited there)."""
    from dcp_pass.runtime.compose.extend import write_new_tokens_

    c, lens, S = 2, torch.tensor([4]), 1  # 5 tokens: rank 0 holds 3 rows, rank 1 holds 2
    for rank in range(c):
        cache = torch.zeros(1, local_length(5, c, 1), DL)
        with pytest.raises(ValueError, match="needs 3 local rows on rank 0"):
            write_new_tokens_(cache, torch.randn(1, S, DL), lens, c, rank)


@pytest.mark.parametrize("lens", [torch.tensor([4.7]), [4.0], 3.0])
def test_float_prefix_lengths_are_refused(lens):
    """A float length was cut to an int without a word (4.7 -> 4)."""
    from dcp_pass.runtime.compose.extend import write_new_tokens_

    with pytest.raises(ValueError, match="must be ints, got floats"):
        write_new_tokens_(torch.zeros(1, 8, DL), torch.randn(1, 1, DL), lens, 2, 0)
