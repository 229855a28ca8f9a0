"""The compositions over an fp8 latent cache (kv_cache_dtype="fp8_e4m3").

Extend (DCP path) writes the new tokens quantised into the fp8 stripe and its scales and
attends over them; speculative verification reads dense and paged fp8 stripes (its tail
zeroing on the fp8 bytes and the scales); both are compared, per rank of c = 2 and merged
exactly, with a float64 attention over the dequantised cache. The gather path refuses fp8,
the host tier moves packed rows byte for byte and refuses a bare fp8 latent, the transfer
plan says how to move rows into an fp8 decode cache.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from dcp_pass.runtime.compose.extend import extend_attention_dcp, extend_attention_gather
from dcp_pass.runtime.compose.host_tier import HostKVTier, HostTierError
from dcp_pass.runtime.compose.speculative import verify_attention
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.kv_format import Fp8Layout, dequantize, pack, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from kit.kernels import merge  # noqa: E402

C, H, DL, DR = 2, 4, 128, 8
SCALE = 0.3


def _naive(q, qr, kv, pe, lens, q_pos):
    """float64 attention of [B, S] queries over the unstriped dequantised cache rows."""
    s = (torch.einsum("bshd,btd->bsht", q.double(), kv.double())
         + torch.einsum("bshd,btd->bsht", qr.double(), pe.double())) * SCALE
    t = torch.arange(kv.shape[1])
    visible = (t.view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1)) & (t.view(1, 1, 1, -1) <= q_pos[:, :, None, None])
    return torch.einsum("bsht,btd->bshd", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), kv.double())


def _stripe(x, r, rows):
    out = torch.zeros((x.shape[0], rows) + x.shape[2:], dtype=x.dtype)
    owned = x[:, r::C]
    out[:, :owned.shape[1]] = owned
    return out


def test_extend_dcp_writes_quantised_tokens_and_attends():
    g = torch.Generator().manual_seed(0)
    B, S, T = 2, 3, 20
    prefix = torch.randn(B, T, DL, generator=g)
    prefix_pe = torch.randn(B, T, DR, generator=g)
    new, new_pe = torch.randn(B, S, DL, generator=g), torch.randn(B, S, DR, generator=g)
    q, qr = torch.randn(B, S, H, DL, generator=g), torch.randn(B, S, H, DR, generator=g)
    lens = torch.tensor([20, 7])
    q8, sc = quantize(prefix)
    outs, lses, caches = [], [], []
    for r in range(C):
        rows = (T + S) // C + 2
        kv, ks, pe = _stripe(q8.view(torch.uint8), r, rows).view(torch.float8_e4m3fn), _stripe(sc, r, rows), \
            _stripe(prefix_pe, r, rows)
        call = AttentionCall(q, qr, kv, pe, DL, SCALE, stripe=(C, r), kv_scale=ks)
        o, lse = extend_attention_dcp(call, new, new_pe, lens)
        outs.append(o), lses.append(lse), caches.append((kv, ks))
    out, _ = merge(torch.stack(outs), torch.stack(lses))
    pad = torch.zeros(B, S, DL, dtype=torch.float64)
    full = torch.cat([dequantize(q8, sc, torch.float64), pad], 1)
    full_pe = torch.cat([prefix_pe.double(), pad[..., :DR]], 1)
    nq, ns = quantize(new)
    for b in range(B):  # the new tokens as the cache now holds them (quantised), at prefix_len[b] + i
        full[b, lens[b]:lens[b] + S] = dequantize(nq[b], ns[b], torch.float64)
        full_pe[b, lens[b]:lens[b] + S] = new_pe[b].double()
    q_pos = lens.view(B, 1) + torch.arange(S).view(1, S)
    want = _naive(q, qr, full, full_pe, lens + S, q_pos)
    assert (out.double() - want).abs().max() < 1e-5
    # the rank's stripe holds the quantised new tokens: position lens[1] = 7 is rank 1's row 3
    kv1, ks1 = caches[1]
    assert torch.equal(kv1[1, 3].view(torch.uint8), nq[1, 0].view(torch.uint8)) and torch.equal(ks1[1, 3], ns[1, 0])


def test_extend_gather_refuses_fp8():
    q8, sc = quantize(torch.randn(1, 4, DL))
    call = AttentionCall(torch.randn(1, 1, H, DL), torch.randn(1, 1, H, DR), q8, torch.randn(1, 4, DR), DL, SCALE,
                         kv_scale=sc)
    with pytest.raises(ValueError, match="extend_attention_dcp"):
        extend_attention_gather(call, torch.randn(1, 1, DL), torch.randn(1, 1, DR), [3], None)


@pytest.mark.parametrize("paged", [False, True])
def test_verify_over_fp8_stripes(paged):
    g = torch.Generator().manual_seed(1)
    B, K, T, P = 2, 2, 24, 4
    values = torch.randn(B, T, DL, generator=g)
    pe_full = torch.randn(B, T, DR, generator=g)
    q, qr = torch.randn(B, K, H, DL, generator=g), torch.randn(B, K, H, DR, generator=g)
    lens = torch.tensor([24, 9])
    q8, sc = quantize(values)
    outs, lses = [], []
    for r in range(C):
        rows = T // C
        kv = _stripe(q8.view(torch.uint8), r, rows)
        kv[1, 5:] = 0xFF  # stale rows past request 1's local length: NaN bytes the tail zeroing must drop
        kv, ks, pe = kv.view(torch.float8_e4m3fn), _stripe(sc, r, rows), _stripe(pe_full, r, rows)
        table = None
        if paged:  # each request's local rows as pages of P rows, request after request
            table = torch.arange(B * rows // P).view(B, rows // P)
            kv, ks, pe = (t.reshape(B * rows // P, P, t.shape[-1]) for t in (kv, ks, pe))
        call = AttentionCall(q, qr, kv, pe, DL, SCALE, kv_lens=lens, stripe=(C, r), kv_scale=ks, page_table=table)
        o, lse = verify_attention(call, K)
        outs.append(o), lses.append(lse)
    out, _ = merge(torch.stack(outs), torch.stack(lses))
    q_pos = lens.view(B, 1) - K + torch.arange(K).view(1, K)
    want = _naive(q, qr, dequantize(q8, sc, torch.float64), pe_full, lens, q_pos)
    assert torch.isfinite(out).all() and (out.double() - want).abs().max() < 1e-5


def test_host_tier_moves_packed_rows():
    layout = Fp8Layout(DL, DR, torch.bfloat16)
    rows = pack(torch.randn(16, DL + DR), layout)  # 16 local rows of one rank: 2 widened pages of P=4, c=2
    tier = HostKVTier(4, 4, C, 1, layout.row_bytes, dtype=torch.uint8, pin_memory=False)
    assert tier.offload(rows, [0, 1], [2, 3], unit="page") == 8
    back = torch.zeros_like(rows)
    tier.reload(back, [0, 1], [2, 3], unit="page")
    assert torch.equal(back[:8], rows[:8])
    fp8_latent = rows[:, :DL].view(torch.float8_e4m3fn)
    latent_tier = HostKVTier(4, 4, C, 1, DL, dtype=torch.float8_e4m3fn, pin_memory=False)
    with pytest.raises(HostTierError, match="packed uint8 rows"):
        latent_tier.offload(fp8_latent, [0], [0], unit="page")


def test_transfer_into_fp8_rows_says_how():
    from dcp_pass.runtime.compose.transfer import PageLayout, TransferPlanError, _check_pair

    prefill = PageLayout(page_size=4, dcp_size=1, dcp_rank=0, kv_dtype=torch.bfloat16)
    decode = PageLayout(page_size=4, dcp_size=2, dcp_rank=0, kv_dtype=torch.uint8)
    with pytest.raises(TransferPlanError, match="kv_format.pack"):
        _check_pair(prefill, decode, "mla")


def test_packed_rows_without_their_scales_are_refused():
    """A compiled fp8 model's shard handed to verification or extend as it is (packed uint8
    rows, no kv_scale) was read as numbers: finite garbage, outputs up to the byte values."""
    layout = Fp8Layout(128, 8, torch.float32)
    rows = pack(torch.randn(1, 8, 136), layout)
    q = torch.randn(1, 2, 4, 136)
    with pytest.raises(ValueError, match="kv_format.views"):
        verify_attention(AttentionCall(q, None, rows[:, 0::2], None, 128, 0.1, kv_lens=torch.tensor([8]),
                                       stripe=(2, 0)), 2)
