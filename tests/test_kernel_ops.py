"""The shard-local attention ops over a window of keys (dcp_pass/runtime/decode/ops.py).

``dcp.mla_local_attention`` with ``kv_start`` (a sliding window over the latent cache) and
``dcp.local_attention`` (per-head keys and values: GQA, MHA, MLA re-expanded per head), on
CPU through the torch reference: for every group size 1-4, every rank runs the op on its
stripe, the partials are merged exactly (merge_partials) and compared with float64 full
attention over the window. Windows start anywhere (not a multiple of c, shorter than c so
that some ranks see nothing), masks are over the window's global positions, and the ops
trace symbolically.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dcp_pass.runtime.decode.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_pass.runtime.decode.merge import merge_partials

GROUPS = (1, 2, 3, 4)
# (kv_len, kv_start): whole context, windows starting on and off a multiple of c, windows
# shorter than c (some ranks see no key), an empty window
WINDOWS = ((9, 0), (11, 4), (13, 5), (10, 7), (6, 5), (8, 8))


def _stripe(full: torch.Tensor, c: int, rank: int, pad: int = 2) -> torch.Tensor:
    """Rank `rank`'s local rows of [B, L, ...] (local row i = position i * c + rank), with
    `pad` NaN rows after them: rows past the rank's share must not be read."""
    mine = full[:, rank::c]
    tail = torch.full((full.shape[0], pad, *full.shape[2:]), float("nan"), dtype=full.dtype)
    return torch.cat([mine, tail], dim=1)


def _window_reference(q, k, v, scale, kv_len, kv_start, mask=None):
    """float64 attention of q [B,S,H,D] over positions [kv_start, kv_len) of k/v [B,L,Hk,*]."""
    B, S, H, D = q.shape
    Hk = k.shape[2]
    kw = k[:, kv_start:kv_len].double().repeat_interleave(H // Hk, dim=2)
    vw = v[:, kv_start:kv_len].double().repeat_interleave(H // Hk, dim=2)
    scores = torch.einsum("bshd,bthd->bsht", q.double(), kw) * scale
    if mask is not None:
        scores = scores + mask.double()
    if scores.shape[-1] == 0:
        return q.new_zeros(B, S, H, v.shape[-1], dtype=torch.float64), torch.full((B, S, H), float("-inf"),
                                                                                 dtype=torch.float64)
    return torch.einsum("bsht,bthd->bshd", torch.softmax(scores, -1), vw), torch.logsumexp(scores, -1)


def _merged(partials, base="e"):
    outs = torch.stack([o for o, _ in partials])
    lses = torch.stack([lse for _, lse in partials])
    return merge_partials(outs, lses, base=base, out_dtype=torch.float64, return_lse=True)


def _close(got, want, tol=1e-5):
    out, lse = got
    ref_out, ref_lse = want
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)


def _window_mask(g, B, S, H, width, per_head):
    m = torch.randn(B, S, H if per_head else 1, width, generator=g)
    m[..., ::3] = float("-inf")
    m[..., -1] = 0.0  # the query's own key stays visible: no fully masked row
    return m


# --------------------------------------------------------------------------------------
# dcp.local_attention (per-head K/V)
# --------------------------------------------------------------------------------------
def _heads_case(g, B=2, S=1, H=4, Hk=2, D=8, Dv=6, L=13, dtype=torch.float32):
    q = torch.randn(B, S, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, L, Hk, D, generator=g, dtype=dtype)
    v = torch.randn(B, L, Hk, Dv, generator=g, dtype=dtype)
    return q, k, v


def _run_heads(q, k, v, kv_len, kv_start, c, scale, mask=None, base="e"):
    return [torch.ops.dcp.local_attention(q, _stripe(k, c, r), _stripe(v, c, r), kv_len, c, r, scale, mask, base,
                                          "auto", kv_start) for r in range(c)]


@pytest.mark.parametrize("c", GROUPS)
@pytest.mark.parametrize("kv_len, kv_start", WINDOWS)
@pytest.mark.parametrize("H, Hk, S", [(4, 2, 1), (4, 1, 3), (4, 4, 2)])
def test_local_attention_window_merges_to_full_attention(c, kv_len, kv_start, H, Hk, S):
    g = torch.Generator().manual_seed(1000 * c + 10 * kv_len + kv_start + H * Hk + S)
    q, k, v = _heads_case(g, S=S, H=H, Hk=Hk, L=kv_len)
    scale = 1 / math.sqrt(q.shape[-1])
    parts = _run_heads(q, k, v, kv_len, kv_start, c, scale)
    for r, (o, lse) in enumerate(parts):
        assert o.shape == (2, S, H, 6) and o.dtype == q.dtype and lse.shape == (2, S, H) and lse.dtype == torch.float32
        owned = [p for p in range(kv_start, kv_len) if p % c == r]
        if not owned:  # emptiness is a count: zeros and -inf
            assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    _close(_merged(parts), _window_reference(q, k, v, scale, kv_len, kv_start))


@pytest.mark.parametrize("c", GROUPS)
@pytest.mark.parametrize("kv_len, kv_start", [(11, 4), (13, 5), (9, 0), (7, 6)])
@pytest.mark.parametrize("per_head", [False, True])
def test_local_attention_mask_over_the_window(c, kv_len, kv_start, per_head):
    g = torch.Generator().manual_seed(7 * c + kv_len + 100 * kv_start + per_head)
    B, S, H = 2, 2, 4
    q, k, v = _heads_case(g, B=B, S=S, H=H, Hk=2, L=kv_len)
    mask = _window_mask(g, B, S, H, kv_len - kv_start, per_head)
    parts = _run_heads(q, k, v, kv_len, kv_start, c, 0.3, mask)
    _close(_merged(parts), _window_reference(q, k, v, 0.3, kv_len, kv_start, mask))
    # base 2 is the same attention
    parts2 = _run_heads(q, k, v, kv_len, kv_start, c, 0.3, mask, base="2")
    out2, lse2 = _merged(parts2, base="2")
    ref_out, ref_lse = _window_reference(q, k, v, 0.3, kv_len, kv_start, mask)
    _close((out2, lse2 / 1.4426950408889634), (ref_out, ref_lse))


def test_local_attention_fp64_and_nan_propagation():
    g = torch.Generator().manual_seed(3)
    q, k, v = _heads_case(g, L=10, dtype=torch.float64)
    o, lse = torch.ops.dcp.local_attention(q, _stripe(k, 2, 1), _stripe(v, 2, 1), 10, 2, 1, 0.2, None, "e", "torch", 3)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    _close(_merged(_run_heads(q, k, v, 10, 3, 2, 0.2)), _window_reference(q, k, v, 0.2, 10, 3), tol=1e-12)
    # a NaN inside the window reaches the output, as it would without DCP; one outside does not
    for tensor, where in ((k, (0, 5, 1, 0)), (v, (1, 6, 0, 2))):
        bad = tensor.clone()
        bad[where] = float("nan")
        kk, vv = (bad, v) if tensor is k else (k, bad)
        out, _ = _merged(_run_heads(q, kk, vv, 10, 3, 2, 0.2))
        b = where[0]
        assert torch.isnan(out[b]).any(), "a NaN key/value inside the window was hidden"
        out_after, _ = _merged(_run_heads(q, kk, vv, 10, where[1] + 1, 2, 0.2))  # window starts after it
        assert not torch.isnan(out_after).any(), "a NaN outside the window leaked in"
    q_bad = q.clone()
    q_bad[0, 0, 2, 1] = float("nan")
    out, lse = _merged(_run_heads(q_bad, k, v, 10, 3, 2, 0.2))
    assert torch.isnan(out[0, 0, 2]).all() and torch.isnan(lse[0, 0, 2]) and not torch.isnan(out[1]).any()


def test_local_attention_bad_arguments_are_clear():
    g = torch.Generator().manual_seed(4)
    q, k, v = _heads_case(g, H=4, Hk=3, L=6)
    with pytest.raises(ValueError, match="multiple of the 3 key/value heads"):
        torch.ops.dcp.local_attention(q, k[:, ::2], v[:, ::2], 6, 2, 0, 0.1, None, "e", "auto")
    q, k, v = _heads_case(g, L=6)
    with pytest.raises(ValueError, match="the caches have 2 local rows, rank 0 of 2 owns 3"):
        torch.ops.dcp.local_attention(q, k[:, :2], v[:, :2], 6, 2, 0, 0.1, None, "e", "auto")
    with pytest.raises(ValueError, match="0 <= kv_start <= kv_len"):
        torch.ops.dcp.local_attention(q, k, v, 6, 1, 0, 0.1, None, "e", "auto", 7)
    with pytest.raises(ValueError, match=r"\[kv_start, kv_lens\) = \[2, 6\) \(4\)"):
        torch.ops.dcp.local_attention(q, k, v, 6, 1, 0, 0.1, torch.zeros(1, 1, 1, 6), "e", "auto", 2)


# --------------------------------------------------------------------------------------
# dcp.mla_local_attention with kv_start
# --------------------------------------------------------------------------------------
def _mla_case(g, B=2, S=1, H=4, Dl=8, Dr=4, L=13, fused=False):
    q_lat = torch.randn(B, S, H, Dl + (Dr if fused else 0), generator=g)
    q_rope = None if fused else torch.randn(B, S, H, Dr, generator=g)
    kv = torch.randn(B, L, Dl + Dr if fused else Dl, generator=g)
    pe = None if fused else torch.randn(B, L, Dr, generator=g)
    return q_lat, q_rope, kv, pe


def _mla_as_heads(q_lat, q_rope, kv, pe, v_dim):
    """The same attention as one kv head: keys = latent (+ rope) columns, values = latent."""
    q = q_lat if q_rope is None else torch.cat([q_lat, q_rope], -1)
    k = kv[..., : q_lat.shape[-1]] if pe is None else torch.cat([kv, pe], -1)
    return q, k.unsqueeze(2), kv[..., :v_dim].unsqueeze(2)


@pytest.mark.parametrize("c", GROUPS)
@pytest.mark.parametrize("kv_len, kv_start", WINDOWS)
@pytest.mark.parametrize("fused", [False, True])
def test_mla_local_attention_window(c, kv_len, kv_start, fused):
    g = torch.Generator().manual_seed(31 * c + kv_len + 100 * kv_start + fused)
    q_lat, q_rope, kv, pe = _mla_case(g, S=2, L=kv_len, fused=fused)
    v_dim = 8
    mask = _window_mask(g, 2, 2, 4, kv_len - kv_start, per_head=False) if kv_len > kv_start else None
    parts = [torch.ops.dcp.mla_local_attention(q_lat, q_rope, _stripe(kv, c, r),
                                               None if pe is None else _stripe(pe, c, r), kv_len, c, r, v_dim, 0.25,
                                               mask, "e", "auto", None, kv_start) for r in range(c)]
    q, k, v = _mla_as_heads(q_lat, q_rope, kv, pe, v_dim)
    _close(_merged(parts), _window_reference(q, k, v, 0.25, kv_len, kv_start, mask))


def test_mla_local_attention_window_needs_host_counts():
    g = torch.Generator().manual_seed(5)
    q_lat, q_rope, kv, pe = _mla_case(g, L=4)
    lens = torch.tensor([7])
    with pytest.raises(ValueError, match="kv_start=3 with device key counts"):
        torch.ops.dcp.mla_local_attention(q_lat, q_rope, kv, pe, 0, 2, 0, 8, 0.1, None, "e", "auto", lens, 3)
    # kv_start 0 with device counts is today's path
    o, lse = torch.ops.dcp.mla_local_attention(q_lat, q_rope, kv, pe, 0, 2, 0, 8, 0.1, None, "e", "auto", lens)
    assert o.shape == (2, 1, 4, 8) and torch.isfinite(o).all()


# --------------------------------------------------------------------------------------
# symbolic traces (what the inner compilers see)
# --------------------------------------------------------------------------------------
def test_ops_trace_with_symbolic_window():
    def heads(q, k, v, mask, start_marker):
        kv_start = start_marker.shape[0]
        return torch.ops.dcp.local_attention(q, k, v, kv_start + mask.shape[-1], 2, 1, 0.5, mask, "e", "auto",
                                             kv_start)

    def mla(q_lat, q_rope, kv, pe, mask, start_marker):
        kv_start = start_marker.shape[0]
        return torch.ops.dcp.mla_local_attention(q_lat, q_rope, kv, pe, kv_start + mask.shape[-1], 2, 1, 8, 0.5,
                                                 mask, "e", "auto", None, kv_start)

    g = torch.Generator().manual_seed(6)
    q, k, v = _heads_case(g, L=12)
    marker, mask = torch.zeros(3), torch.zeros(2, 1, 1, 9)
    gm = make_fx(heads, tracing_mode="symbolic")(q, _stripe(k, 2, 1), _stripe(v, 2, 1), mask, marker)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.dcp.local_attention.default)
    kv_len, kv_start = node.args[3], node.args[10]
    assert isinstance(kv_len, torch.fx.Node) and isinstance(kv_start, torch.fx.Node)  # SymInts, not constants
    out, lse = gm(q, _stripe(k, 2, 1), _stripe(v, 2, 1), mask, marker)
    want = torch.ops.dcp.local_attention(q, _stripe(k, 2, 1), _stripe(v, 2, 1), 12, 2, 1, 0.5, mask, "e", "auto", 3)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])

    q_lat, q_rope, kv, pe = _mla_case(g, L=12)
    args = (q_lat, q_rope, _stripe(kv, 2, 1), _stripe(pe, 2, 1), mask, marker)
    gm = make_fx(mla, tracing_mode="symbolic")(*args)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.dcp.mla_local_attention.default)
    assert isinstance(node.args[4], torch.fx.Node) and isinstance(node.args[13], torch.fx.Node)
    out, lse = gm(*args)
    want = mla(*args)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
