"""Exact LSE merge, output/LSE packing and the Triton merge kernels."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_pass.runtime.decode.merge import (
    fold_sink,
    global_lse,
    merge_packed,
    merge_partials,
    merge_partials_dispatch,
    pack_output_lse,
    rescale_partial,
    unpack_output_lse,
)

INF = float("inf")
NAN = float("nan")
LN2 = math.log(2.0)
LOG2E = math.log2(math.e)


def _t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------- hand-computed


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("c", [1, 2, 3])
def test_sink_after_the_merge_equals_the_concatenated_softmax(base, c):
    """Striped partials merged, then the sink folded in once, against the model's spelling:
    softmax over [scores, sink] with the max subtracted, the sink's column dropped (fp64)."""
    g = torch.Generator().manual_seed(7 + c)
    B, H, T, D = 2, 3, 7, 5
    scores = torch.randn(B, H, T, generator=g, dtype=torch.float64) * 3
    scores[0, 1, :] = -INF  # a row with no visible key: all its weight on the sink
    v = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    combined = torch.cat([scores, sink[None, :, None].expand(B, H, 1)], -1)
    probs = (combined - combined.max(-1, keepdim=True).values).softmax(-1)[..., :-1]
    expect = torch.einsum("bht,btd->bhd", probs, v)
    outs, lses = [], []
    for r in range(c):  # rank r's stripe: positions p % c == r
        s = scores[..., r::c]
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append(torch.einsum("bht,btd->bhd", p, v[:, r::c]))
        lses.append(lse if base == "e" else lse * LOG2E)
    o, lse = merge_partials(torch.stack(outs), torch.stack(lses), base=base, return_lse=True)
    got = fold_sink(o, lse, sink, base=base)
    assert (got - expect).abs().max().item() < 1e-12
    assert bool((got[0, 1] == 0).all())
    assert fold_sink(o.float(), lse.float(), sink.float(), base=base, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_sink_keeps_nan():
    o, lse, sink = torch.ones(1, 2, 3), torch.tensor([[0.5, NAN]]), torch.tensor([0.0, 0.0])
    got = fold_sink(o, lse, sink)
    assert torch.isfinite(got[0, 0]).all() and torch.isnan(got[0, 1]).all()
    assert torch.isnan(fold_sink(o, torch.zeros(1, 2), torch.tensor([NAN, 0.0]))[0, 0]).all()



def test_two_shards_base_e_by_hand():
    # weights e^0 : e^ln3 = 1 : 3 -> 1/4, 3/4; lse = ln 4
    o = _t([[1.0, 2.0], [5.0, 6.0]])
    lse = _t([0.0, math.log(3.0)])
    out, m = merge_partials(o, lse, return_lse=True)
    torch.testing.assert_close(out, _t([4.0, 5.0]))
    torch.testing.assert_close(m, _t(math.log(4.0)))


def test_two_shards_base_2_by_hand():
    # weights 2^1 : 2^2 = 1 : 2 -> 1/3, 2/3; lse = log2(6)
    o = _t([[3.0, 0.0], [0.0, 3.0]])
    lse = _t([1.0, 2.0])
    out, m = merge_partials(o, lse, base="2", return_lse=True)
    torch.testing.assert_close(out, _t([1.0, 2.0]))
    torch.testing.assert_close(m, _t(math.log2(6.0)))


def test_three_shards_with_batch_dims_by_hand():
    # Row 0: lse all equal -> mean; row 1: one shard empty -> 50/50 of the other two.
    o = _t([[[3.0], [2.0]], [[6.0], [4.0]], [[0.0], [NAN]]])  # [c=3, N=2, D=1]
    lse = _t([[1.0, 0.5], [1.0, 0.5], [1.0, -INF]])
    out, m = merge_partials(o, lse, return_lse=True)
    torch.testing.assert_close(out, _t([[3.0], [3.0]]))
    torch.testing.assert_close(m, _t([1.0 + math.log(3.0), 0.5 + math.log(2.0)]))


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("winner", [0, 1])
def test_dominant_lse_selects_that_shard(base, winner):
    o = torch.randn(2, 5, 16)
    lse = torch.full((2, 5), -100.0)
    lse[winner] = 100.0
    out, m = merge_partials(o, lse, base=base, return_lse=True)
    torch.testing.assert_close(out, o[winner])
    torch.testing.assert_close(m, lse[winner])


@pytest.mark.parametrize("c", [2, 3, 8])
@pytest.mark.parametrize("base", ["e", "2"])
def test_equal_lses_give_mean(c, base):
    o = torch.randn(c, 4, 8)
    lse = torch.full((c, 4), 2.5)
    out, m = merge_partials(o, lse, base=base, return_lse=True)
    torch.testing.assert_close(out, o.mean(0))
    log_c = math.log(c) if base == "e" else math.log2(c)
    torch.testing.assert_close(m, torch.full((4,), 2.5 + log_c))


@pytest.mark.parametrize("garbage", [0.0, NAN, INF])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_empty_shard_is_neutral(garbage, position):
    """-inf LSE (no visible key) is an empty shard: weight 0, whatever its output holds."""
    o = torch.randn(2, 6, 8)
    lse = torch.randn(2, 6)
    want, want_lse = merge_partials(o, lse, return_lse=True)
    o3 = torch.cat([o[:position], torch.full((1, 6, 8), garbage), o[position:]])
    l3 = torch.cat([lse[:position], torch.full((1, 6), -INF), lse[position:]])
    got, got_lse = merge_partials(o3, l3, return_lse=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)


@pytest.mark.parametrize("bad, where", [(NAN, "lse"), (INF, "lse"), (NAN, "output")])
@pytest.mark.parametrize("base", ["e", "2"])
def test_nan_and_inf_propagate(bad, where, base):
    """NaN in must mean NaN out: a NaN/+inf LSE or a NaN output of a non-empty shard is
    data, not emptiness (the model without DCP gives NaN there); other rows stay exact."""
    o = torch.randn(3, 4, 8)
    lse = torch.randn(3, 4)
    want = merge_partials(o, lse, base=base)
    if where == "lse":
        lse[1, 2] = bad
    else:
        o[1, 2, 3] = bad
    got, m = merge_partials(o, lse, base=base, return_lse=True)
    bad_out = got[2] if where == "lse" else got[2, 3]
    assert torch.isnan(bad_out).all(), got[2]
    if where == "lse":
        assert torch.isnan(m[2]) or m[2] == INF
    keep = [0, 1, 3]
    torch.testing.assert_close(got[keep], want[keep])
    g = global_lse(lse, base)
    assert not torch.isfinite(g[2]) if where == "lse" else torch.isfinite(g).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("base", ["e", "2"])
def test_all_empty_row_is_zero_with_neg_inf_lse(dtype, base):
    o = torch.randn(4, 3, 8).to(dtype)
    lse = torch.randn(4, 3)
    lse[:, 1] = -INF  # row 1 empty on every shard
    o[:, 1] = NAN
    out, m = merge_partials(o, lse, base=base, return_lse=True)
    assert out.dtype == dtype and m.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros(8, dtype=dtype))
    assert m[1].item() == -INF
    assert torch.isfinite(out).all() and torch.isfinite(m[[0, 2]]).all()
    assert torch.equal(global_lse(lse, base), m)


def test_single_shard_is_identity_for_valid_rows():
    o = torch.randn(1, 7, 32)
    lse = torch.randn(1, 7)
    out, m = merge_partials(o, lse, return_lse=True)
    assert torch.equal(out, o[0]) and torch.equal(m, lse[0])


def test_base_2_merge_of_scaled_lse_equals_base_e_merge():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(5, 3, 4, 64, generator=g)
    lse = torch.randn(5, 3, 4, generator=g) * 10
    lse[2, 0, 0] = -INF
    out_e, m_e = merge_partials(o, lse, base="e", return_lse=True)
    out_2, m_2 = merge_partials(o, lse * LOG2E, base="2", return_lse=True)
    torch.testing.assert_close(out_2, out_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m_2 * LN2, m_e, rtol=1e-6, atol=1e-5)


def test_mixing_bases_is_visible():
    # Feeding base-e LSEs to a base-2 merge must give a different answer: the base
    # argument really is used.
    o = torch.randn(2, 4, 8)
    lse = _t([[0.0] * 4, [3.0] * 4])
    assert not torch.allclose(merge_partials(o, lse, base="e"), merge_partials(o, lse, base="2"))


def test_out_dtype_and_fp32_accumulation():
    # 4096 bf16 shards of the same value: a bf16 accumulator would drift, fp32 does not.
    o = torch.full((4096, 1, 4), 1.0 + 2 ** -7, dtype=torch.bfloat16)
    lse = torch.zeros(4096, 1)
    out = merge_partials(o, lse, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.full((1, 4), 1.0 + 2 ** -7), rtol=1e-6, atol=0)
    assert merge_partials(o, lse).dtype == torch.bfloat16


def test_rescale_partials_sum_to_merge():
    # The ag_rs path: each rank's fp32 contribution, summed, is the merge.
    o = torch.randn(3, 5, 16)
    lse = torch.randn(3, 5)
    lse[1, 2] = -INF  # empty shard with a garbage output
    o[1, 2] = NAN
    lse[:, 4] = -INF  # all-empty row
    lse[2, 0] = NAN  # data: row 0 is NaN both ways
    g = global_lse(lse)
    total = sum(rescale_partial(o[r], lse[r], g) for r in range(3))
    torch.testing.assert_close(total, merge_partials(o, lse), equal_nan=True)
    assert total[0].isnan().all() and torch.isfinite(total[1:]).all()


def test_bad_arguments():
    o, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    with pytest.raises(ValueError, match="base"):
        merge_partials(o, lse, base="10")
    with pytest.raises(ValueError, match="base"):
        merge_partials(o, lse, base=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lses"):
        merge_partials(o, torch.randn(2, 4))
    with pytest.raises(ValueError):  # fp64 packs (one converted column), 16-byte elements do not
        pack_output_lse(torch.randn(3, 4, dtype=torch.complex128), torch.randn(3))
    with pytest.raises(ValueError):
        unpack_output_lse(torch.randn(3, 6), 4)


@settings(max_examples=40, deadline=None)
@given(
    c=st.integers(2, 6),
    split=st.integers(1, 5),
    n_empty=st.integers(0, 3),
    seed=st.integers(0, 2 ** 16),
    base=st.sampled_from(["e", "2"]),
)
def test_merge_is_hierarchical(c, split, n_empty, seed, base):
    # Merging groups of shards and then the group results equals merging everything:
    # what lets DCP merges nest (e.g. across levels) without loss.
    split = min(split, c - 1)
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(c, 3, 8, generator=g)
    lse = torch.randn(c, 3, generator=g) * 5
    lse.view(-1)[torch.randperm(c * 3, generator=g)[:n_empty]] = -INF  # empty shards
    a = merge_partials(o[:split], lse[:split], base, return_lse=True)
    b = merge_partials(o[split:], lse[split:], base, return_lse=True)
    two = merge_partials(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]]), base, return_lse=True)
    one = merge_partials(o, lse, base, return_lse=True)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two[1], one[1], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- vs float64 attention

_ERRORS: dict = {}


def _attention(q, k, v, keep, scale):
    """q [B,H,Dk], k/v [B,L,*], keep [B,L] -> (o [B,H,Dv], natural-log lse [B,H])."""
    s = torch.einsum("bhd,bld->bhl", q, k) * scale
    s = s.masked_fill(~keep[:, None, :], -INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("bhl,bld->bhd", p, v), lse


@pytest.mark.parametrize("c", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("base", ["e", "2"])
def test_striped_attention_matches_float64(c, base):
    g = torch.Generator().manual_seed(100 + c)
    B, H, Dk, Dv, L = 4, 8, 64, 48, 61
    q = torch.randn(B, H, Dk, generator=g, dtype=torch.float64)
    k = torch.randn(B, L, Dk, generator=g, dtype=torch.float64)
    v = torch.randn(B, L, Dv, generator=g, dtype=torch.float64)
    lens = torch.tensor([L, 37, 5, 1])  # short rows leave some stripes empty at c=8
    pos = torch.arange(L)
    valid = pos[None] < lens[:, None]
    scale = 2.5 * Dk ** -0.5  # peaky softmax: LSEs differ a lot between stripes
    ref, _ = _attention(q, k, v, valid, scale)

    to_base = 1.0 if base == "e" else LOG2E
    # (a) a realistic fp32 kernel per stripe; (b) exact stripes rounded to fp32,
    # which isolates the merge's own error.
    parts32, parts64 = [], []
    for r in range(c):
        keep = valid & (pos % c == r)[None]
        parts32.append(_attention(q.float(), k.float(), v.float(), keep, scale))
        parts64.append(_attention(q, k, v, keep, scale))
    for label, parts in (("fp32 stripes", parts32), ("merge only", parts64)):
        o = torch.stack([p[0] for p in parts]).float()
        lse = (torch.stack([p[1] for p in parts]) * to_base).float()
        out = merge_partials(o, lse, base=base)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        err = (out.double() - ref).abs().max().item()
        rel = err / ref.abs().max().item()
        key = (label, c, base)
        _ERRORS[key] = (err, rel)
        # The merge itself stays within a few fp32 ulps of outputs of size ~3; the
        # fp32 stripe kernels add their own dot-product rounding (BLAS dependent).
        assert err < (1e-5 if label == "fp32 stripes" else 1e-6), (key, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_striped_attention_low_precision_outputs(dtype):
    g = torch.Generator().manual_seed(7)
    B, H, D, L, c = 2, 4, 32, 40, 4
    q, k, v = (torch.randn(B, n, D, generator=g, dtype=torch.float64) for n in (H, L, L))
    valid = torch.ones(B, L, dtype=torch.bool)
    ref, _ = _attention(q, k, v, valid, D ** -0.5)
    parts = [_attention(q, k, v, valid & (torch.arange(L) % c == r)[None], D ** -0.5) for r in range(c)]
    o = torch.stack([p[0] for p in parts]).to(dtype)
    lse = torch.stack([p[1] for p in parts]).float()
    out = merge_partials(o, lse)
    assert out.dtype == dtype
    # Inputs carry one rounding of `dtype`; the fp32 merge adds nothing visible.
    eps = torch.finfo(dtype).eps
    assert (out.double() - ref).abs().max().item() < 2 * eps * ref.abs().max().item()


def test_print_largest_error_vs_float64(capsys):
    if not _ERRORS:
        pytest.skip("run together with test_striped_attention_matches_float64")
    lines = []
    for label in ("fp32 stripes", "merge only"):
        items = {k: v for k, v in _ERRORS.items() if k[0] == label}
        (key, (err, rel)) = max(items.items(), key=lambda kv: kv[1][0])
        lines.append(
            f"largest error vs float64 [{label}]: max abs {err:.3e}, relative {rel:.3e} "
            f"(c={key[1]}, base {key[2]}, {len(items)} cases)"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert max(e for e, _ in _ERRORS.values()) < 1e-5


# ----------------------------------------------------------------------------- packing


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


SPECIALS = [NAN, INF, -INF, -0.0, 0.0, 1e-45, 3.4e38, -1.0]


def _special_inputs(dtype, D, g):
    o = torch.randn(3, 5, D, generator=g).to(dtype)
    flat = o.view(-1)
    flat[: len(SPECIALS)] = torch.tensor(SPECIALS).to(dtype)
    # LSE: random floats, the special values, and random 32-bit patterns (NaN payloads,
    # denormals) to prove the bytes are moved, not converted.
    lse = torch.randn(3, 5, generator=g)
    lse.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS)
    lse.view(-1)[-4:] = torch.randint(-2 ** 31, 2 ** 31 - 1, (4,), generator=g, dtype=torch.int32).view(torch.float32)
    lse.view(-1)[-5] = torch.tensor(0x7FC12345, dtype=torch.int32).view(torch.float32)  # NaN with payload
    return o, lse


@pytest.mark.parametrize("dtype,k", [(torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 2)])
@pytest.mark.parametrize("D", [1, 7, 64])
def test_pack_round_trip_is_bitwise(dtype, k, D):
    o, lse = _special_inputs(dtype, D, torch.Generator().manual_seed(D))
    packed = pack_output_lse(o, lse)
    assert packed.dtype == dtype and packed.shape == (3, 5, D + k)
    o2, lse2 = unpack_output_lse(packed, D)
    assert o2.dtype == dtype and lse2.dtype == torch.float32 and lse2.shape == lse.shape
    assert torch.equal(_bits(o2), _bits(o))
    assert torch.equal(_bits(lse2), _bits(lse))


def test_pack_accepts_strided_inputs():
    o = torch.randn(4, 6, 10, dtype=torch.bfloat16)[:, ::2]  # non-contiguous
    lse = torch.randn(6, 4).t()[:, ::2]
    o2, lse2 = unpack_output_lse(pack_output_lse(o, lse), 10)
    assert torch.equal(_bits(o2), _bits(o.contiguous())) and torch.equal(_bits(lse2), _bits(lse.contiguous()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_tail_is_the_lse_bytes(dtype):
    """The wire format: the tail columns hold the LSE's own bytes (what a reinterpreting
    view gives), which the eager Triton unpack-merge kernel reads directly."""
    o, lse = _special_inputs(dtype, 5, torch.Generator().manual_seed(11))
    tail = pack_output_lse(o, lse)[..., 5:]
    assert torch.equal(_bits(tail), _bits(lse.contiguous().unsqueeze(-1).view(dtype)))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trip_under_torch_compile(dtype, backend):
    o, lse = _special_inputs(dtype, 9, torch.Generator().manual_seed(3))

    def round_trip(o, lse):
        return unpack_output_lse(pack_output_lse(o, lse), o.shape[-1])

    torch._dynamo.reset()
    o2, lse2 = torch.compile(round_trip, backend=backend, fullgraph=True)(o, lse)
    assert torch.equal(_bits(o2), _bits(o)) and torch.equal(_bits(lse2), _bits(lse))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.gpu_full, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_lse_survives_inductor_pack_and_merge(dtype, device):
    """Compiled pack, a copy (the collective), compiled merge: every LSE arrives bit-exact,
    including those whose low 16 bits read as a NaN or denormal of the 2-byte dtype (~0.4 %
    of random LSEs), which a float conversion on the way would canonicalise or flush."""
    g = torch.Generator().manual_seed(0)
    n = 4096
    bits = (torch.full((n,), 0x40A00000, dtype=torch.int64) | torch.randint(0, 1 << 16, (n,), generator=g)).to(torch.int32)
    lse = bits.view(torch.float32).reshape(2, n // 2).to(device)  # [c, rows], values near 5
    o = torch.randn(2, n // 2, 16, generator=g).to(dtype).to(device)
    ref_o, ref_l = merge_partials(o.float(), lse, "e", torch.float32, return_lse=True)

    def merge(p):
        o_, l_ = unpack_output_lse(p, 16)
        return merge_partials(o_, l_, "e", torch.float32, return_lse=True)

    torch._dynamo.reset()
    packed = torch.compile(pack_output_lse)(o, lse)
    assert torch.equal(packed[..., 16:].contiguous().view(torch.int32).squeeze(-1), lse.view(torch.int32))
    recv = packed.clone()
    # the unpacked LSE itself (x 1.0: computed in a kernel, exact for finite fp32 values)
    lse2 = torch.compile(lambda p: unpack_output_lse(p, 16)[1] * 1.0)(recv)
    assert torch.equal(lse2.view(torch.int32), lse.view(torch.int32))
    # and the fused merge agrees with the eager one to fp32 rounding
    mo, ml = torch.compile(merge)(recv)
    torch.testing.assert_close(ml, ref_l, rtol=0, atol=2e-6)
    torch.testing.assert_close(mo, ref_o, rtol=1e-6, atol=1e-6)


def test_packed_lse_needs_no_fallback_op_under_inductor():
    """bf16 pack and unpack lower to fused kernels: an element-size-changing dtype view
    would be a fallback op (a host call of its own per layer without CUDA graphs)."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(5)
    o, lse = torch.randn(3, 5, 9, generator=g).to(torch.bfloat16), torch.randn(3, 5, generator=g)

    def round_trip(o, lse):
        p = pack_output_lse(o, lse)
        return unpack_output_lse(p.clone(), 9)

    torch._dynamo.reset()
    (o2, lse2), code = run_and_get_code(torch.compile(round_trip, fullgraph=True), o, lse)
    assert torch.equal(_bits(lse2), _bits(lse))
    call = code[0][code[0].index("def call("):]
    assert "torch.ops.aten" not in call, call[:4000]


def test_merge_packed_equals_merge_partials():
    o = torch.randn(4, 3, 2, 16, dtype=torch.bfloat16)
    lse = torch.randn(4, 3, 2)
    lse[0, 0, 0] = INF
    packed = pack_output_lse(o, lse)
    a = merge_packed(packed, 16, return_lse=True)
    b = merge_partials(o, lse, return_lse=True)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0, equal_nan=True)


def test_merge_partials_traces_under_torch_compile():
    o = torch.randn(3, 2, 4, 16)
    lse = torch.randn(3, 2, 4)
    lse[:, 1, 2] = -INF
    lse[1, 0, 0] = NAN

    def f(o, lse):
        return merge_partials(o, lse, base="2", return_lse=True)

    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(o, lse)
    want = f(o, lse)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert got[0][0, 0].isnan().all()


def test_dispatch_uses_reference_on_cpu():
    o = torch.randn(3, 5, 8)
    lse = torch.randn(3, 5)
    assert torch.equal(merge_partials_dispatch(o, lse), merge_partials(o, lse))


# ----------------------------------------------------------------------------- Triton (interpreter)

# Runs in a fresh interpreter: TRITON_INTERPRET is read when a kernel is decorated,
# so it must be set before the kernel module is imported, and setting it in this
# process would leak into other test modules' kernels.
_TRITON_SCRIPT = textwrap.dedent(
    r"""
    import json, math, sys
    import torch
    try:
        import triton  # noqa: F401
        from dcp_pass.runtime.decode.kernels.merge_triton import merge_partials_triton, unpack_merge_triton
    except Exception as e:
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
    from dcp_pass.runtime.decode.merge import merge_partials, pack_output_lse

    def err(a, b):
        a, b = a.double(), b.double()
        same = (a == b) | (a.isnan() & b.isnan())  # -inf empty rows; NaN rows propagate alike
        d = torch.where(same, torch.zeros_like(a), (a - b).abs())
        return float(d.max()) if d.numel() else 0.0

    def _finite_but_nan_row(tri, pk, D, nan_row):
        rows, prows = tri.reshape(-1, D), pk.reshape(-1, D)
        others = torch.arange(rows.shape[0]) != nan_row
        return {"finite": bool(torch.isfinite(rows[others]).all() and torch.isfinite(prows[others]).all()),
                "nan_row": bool(rows[nan_row].isnan().all() and prows[nan_row].isnan().all())}

    def case(c, shape, D, dtype, base, seed):
        g = torch.Generator().manual_seed(seed)
        o = torch.randn(c, *shape, D, generator=g).to(dtype)
        lse = torch.randn(c, *shape, generator=g) * 6
        flat_l, flat_o = lse.view(c, -1), o.view(c, -1, D)
        n = flat_l.shape[1]
        flat_o[0, 0] = float("nan")
        flat_l[0, 0] = float("-inf")  # an empty shard's garbage output stays out
        flat_l[c - 1, n // 2] = float("nan")  # data: the row is NaN, as without DCP
        flat_l[:, n - 1] = float("-inf")  # an all-empty row
        if base == "2":
            lse = lse * math.log2(math.e)
        return o, lse

    out = {}
    try:
        for dtype in (torch.float32, torch.float16):
            for base in ("e", "2"):
                for c, shape, D in ((1, (2, 3), 8), (2, (3, 1, 4), 64), (4, (2, 5), 7), (8, (6,), 33)):
                    o, lse = case(c, shape, D, dtype, base, c * 100 + D)
                    ref, ref_l = merge_partials(o, lse, base, return_lse=True)
                    tri, tri_l = merge_partials_triton(o, lse, base, None, True)
                    pk, pk_l = unpack_merge_triton(pack_output_lse(o, lse), D, base, None, True)
                    name = f"{str(dtype)[6:]}-base{base}-c{c}-D{D}"
                    out[name] = {
                        "merge": err(tri, ref), "merge_lse": err(tri_l, ref_l),
                        "packed": err(pk, ref), "packed_lse": err(pk_l, ref_l),
                        "dtype_ok": tri.dtype == dtype and pk.dtype == dtype,
                        **_finite_but_nan_row(tri, pk, D, lse.reshape(c, -1).shape[1] // 2),
                        "empty_row_lse": [float(tri_l.reshape(-1)[-1]), float(pk_l.reshape(-1)[-1])],
                    }
        # Strided input (every other head), fp32 output from fp16 partials, several
        # column blocks (D > 1024), no LSE returned.
        o, lse = case(3, (2, 8), 1100, torch.float16, "e", 5)
        ref = merge_partials(o[:, :, ::2], lse[:, :, ::2], "e", torch.float32)
        tri = merge_partials_triton(o[:, :, ::2], lse[:, :, ::2], "e", torch.float32, False)
        out["strided-wide-fp16->fp32"] = {"merge": err(tri, ref), "dtype_ok": tri.dtype == torch.float32,
                                          # one row holds the NaN LSE, all others finite
                                          "finite": int((~torch.isfinite(tri)).any(-1).sum()) == 1}
    except Exception as e:
        import traceback
        print(json.dumps({"error": traceback.format_exc()})); sys.exit(0)
    print(json.dumps(out))
    """
)

_TRITON_RESULTS: dict = {}


def _triton_results():
    if not _TRITON_RESULTS:
        try:
            import triton  # noqa: F401
        except Exception as e:  # noqa: BLE001
            _TRITON_RESULTS["skip"] = f"triton not importable: {e}"
            return _TRITON_RESULTS
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300
        )
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            _TRITON_RESULTS["error"] = f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        else:
            _TRITON_RESULTS.update(json.loads(lines[-1]))
    return _TRITON_RESULTS


_TRITON_CASES = [
    f"{dt}-base{b}-c{c}-D{D}"
    for dt in ("float32", "float16")
    for b in ("e", "2")
    for c, D in ((1, 8), (2, 64), (4, 7), (8, 33))
] + ["strided-wide-fp16->fp32"]


@pytest.mark.parametrize("name", _TRITON_CASES)
def test_triton_merge_in_interpreter(name):
    res = _triton_results()
    if "skip" in res:
        pytest.skip(res["skip"])
    assert "error" not in res, res["error"]
    r = res[name]
    # fp16 outputs are compared after both round to fp16: allow one fp16 ulp.
    tol = 2e-3 if name.startswith("float16") else 2e-6
    for key in ("merge", "packed"):
        if key in r:
            assert r[key] <= tol, (name, key, r[key])
    for key in ("merge_lse", "packed_lse"):
        if key in r:
            assert r[key] <= 4e-6, (name, key, r[key])  # ~2 ulps of LSEs up to ~20
    assert r["dtype_ok"] and r["finite"] and r.get("nan_row", True), r
    if "empty_row_lse" in r:
        assert r["empty_row_lse"] == [-INF, -INF], r


# ----------------------------------------------------------------------------- Triton (real GPU)

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("c,D", [(2, 512), (4, 576), (8, 7), (16, 1100)])
def test_triton_merge_on_gpu(dtype, base, c, D):
    from dcp_pass.runtime.decode.kernels.merge_triton import merge_partials_triton, unpack_merge_triton

    g = torch.Generator().manual_seed(c * D)
    o = torch.randn(c, 4, 1, 16, D, generator=g).to(dtype)
    lse = torch.randn(c, 4, 1, 16, generator=g) * 6
    lse[0, 0, 0, 0] = NAN
    o[0, 0, 0, 0] = NAN
    lse[-1, 1, 0, 3] = INF
    lse[:, 2, 0, 5] = -INF
    o, lse = o.cuda(), lse.cuda()
    ref, ref_l = merge_partials(o, lse, base, return_lse=True)
    tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=0, atol=torch.finfo(dtype).eps * 8)
    for got, got_l in (
        merge_partials_triton(o, lse, base, None, True),
        unpack_merge_triton(pack_output_lse(o, lse), D, base, None, True),
        merge_partials_dispatch(o, lse, base, None, True),
        merge_packed(pack_output_lse(o, lse), D, base, None, True),
    ):
        assert got.dtype == dtype and got.is_cuda
        # NaN/+inf LSEs are data: rows (0, 0) and (1, 3) are NaN, as without DCP
        torch.testing.assert_close(got.float(), ref.float(), equal_nan=True, **tol)
        torch.testing.assert_close(got_l, ref_l, rtol=0, atol=4e-6, equal_nan=True)
        assert got[0, 0, 0].isnan().all() and got[1, 0, 3].isnan().all()
        assert got_l[2, 0, 5].item() == -INF and (got[2, 0, 5] == 0).all()
