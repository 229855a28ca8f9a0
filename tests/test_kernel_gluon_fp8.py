"""Tests of the fp8-cache Gluon kernel (dcp_pass.runtime.decode.kernels.gluon.fp8).

Gluon has no interpreter: the kernel runs only on a Hopper GPU (``-m gpu``). On CPU: which
calls it takes and why not, that the chooser never takes it unasked (not yet timed), its
launch arguments on packed rows, and its offline sm_90 compile (no spills, shared memory).
GPU: DeepSeek-V3 shapes (64 and 128 heads, B=8, 4K and 32K keys) against the float64
attention of the dequantised cache, with ragged and empty requests, cache rows past each
request's length poisoned with NaN, several splits, two caches, a decode step's mask row and
a causal cap, CUDA-graph capture.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from kit.kernels import (FP8_GLUON_REFUSALS, check_close, decode_mask_rows, last_positions,  # noqa: E402
                         gluon_kernel, packed_fp8_call, poison_fp8_rows, poisoned, ref64)
from kit.offline import compiles_offline, offline_module  # noqa: E402

from dcp_pass.runtime.decode.call import AttentionCall, CallShape  # noqa: E402
from dcp_pass.runtime.decode.kernels import registry  # noqa: E402

FP8 = CallShape(dtype=torch.float8_e4m3fn, same_dtypes=True, fused=False, kv_quant="fp8_e4m3",
                query_dtype=torch.bfloat16, rows16=False)  # packed rows on an H200: what it is for


def _gluon():
    return gluon_kernel("gluon.fp8")


def _packed_call(B, H, T, device="cpu", lens=None, separate=False, gen=None, dtype=torch.bfloat16):
    """One query token a row over packed fp8 rows (kit.kernels.packed_fp8_call)."""
    return packed_fp8_call(B, 1, H, T, device, lens, separate, gen, dtype)


def test_which_calls_it_takes():
    F = _gluon()
    assert F.supports(FP8) is None
    assert F.supports(dataclasses.replace(FP8, fused=True)) is None  # (either layout of the rope columns)
    reasons = {**FP8_GLUON_REFUSALS, "one row per request": dict(mask="full")}
    for words, kw in reasons.items():
        reason = F.supports(dataclasses.replace(FP8, **kw))
        assert reason is not None and words in reason, (kw, reason)
    for kw in (dict(mask="row"), dict(causal=True)):  # a decode step's mask row, a causal cap
        assert F.supports(dataclasses.replace(FP8, **kw)) is None, kw
    assert F.offered(dataclasses.replace(FP8, heads=16)) is None  # fp8 timings decide, at any row count
    assert "Triton 3.6" in F.offered(dataclasses.replace(FP8, triton="3.9.0"))
    assert F.offered(FP8) is None and F.unmeasured(FP8) is False
    # a real packed call on CPU tensors: refused for its device, as every Gluon kernel does
    assert "Hopper" in registry.KERNELS["gluon_fp8"].supports(_packed_call(1, 64, 16).shape)
    # and the bf16 Gluon kernels still refuse fp8 calls
    assert "fp8_e4m3" in registry.KERNELS["gluon_roles"].supports(FP8)


def test_the_chooser_takes_it_where_its_fp8_timings_are_fastest(monkeypatch):
    """fp8 calls are chosen by timings on fp8 rows (path table keys split_fp8, wide_fp8,
    gluon_fp8, gluon_fp8_narrow): on the H200 this kernel at every plain call measured from 64
    heads, the narrow fp8 kernel at 16 rows, a decode step's mask row and a causal cap included
    (a 2-token verify at 16 heads has 32 rows and comes here);
    without the Gluon kernels, the two-GEMM kernel at 128 heads and the split kernel at 16, as
    their fp8 timings say (not their bf16 ones)."""
    _gluon()
    monkeypatch.delenv("DCP_MLA_GLUON", raising=False)
    assert registry.KERNELS["gluon_fp8"] in registry.candidates(FP8, registry.TRITON_KERNELS)
    for heads, batch, keys in ((128, 8, 131072), (128, 32, 32768), (64, 8, 4096), (16, 8, 131072), (16, 32, 32768)):
        shape = dataclasses.replace(FP8, heads=heads, batch=batch, keys=keys)
        want = "gluon_fp8_narrow" if heads == 16 else "gluon_fp8"
        assert registry.choose(shape, registry.TRITON_KERNELS).name == want, (heads, batch, keys)
        if heads == 16:
            masked = dataclasses.replace(shape, mask="row")
            assert registry.choose(masked, registry.TRITON_KERNELS).name == "gluon_fp8_narrow", (heads, batch, keys)
            verify = dataclasses.replace(shape, tokens=2, causal=True)
            assert registry.choose(verify, registry.TRITON_KERNELS).name == "gluon_fp8", (heads, batch, keys)
            verify8 = dataclasses.replace(verify, heads=8)
            assert registry.choose(verify8, registry.TRITON_KERNELS).name == "gluon_fp8_narrow", (heads, batch, keys)
    monkeypatch.setenv("DCP_MLA_GLUON", "0")
    assert registry.choose(dataclasses.replace(FP8, heads=128, keys=131072), registry.TRITON_KERNELS).name == "wide"
    assert registry.choose(dataclasses.replace(FP8, heads=16, keys=131072), registry.TRITON_KERNELS).name == "split"
    monkeypatch.delenv("DCP_MLA_GLUON")
    # a bf16 call is unchanged
    assert registry.choose(CallShape(), registry.TRITON_KERNELS).name == "gluon_roles"


def test_launch_arguments_on_packed_rows():
    """Strides in the units the kernel reads them (q and rope: 8 elements; the latent: bytes
    and 4-byte words), row strides as constants, one program per 64 rows, split and batch row."""
    F = _gluon()
    B, H, T = 2, 128, 4096
    lens = torch.tensor([T, 0])
    call = _packed_call(B, H, T, lens=lens)
    out, lse, plan = F.launch_args(call.shard(), num_splits=3)
    grid, args, consts, stage2 = plan
    assert grid == (2, 3, B) and stage2 is not None
    assert consts == dict(SKV_T=656, SKT_T=328, BLOCK_H=64, BLOCK_N=64, NUM_SPLITS=3, HAS_LENS=True, HAS_MASK=False,
                          CAUSAL=False)
    names = list(__import__("inspect").signature(F._fp8_kernel_src).parameters)
    a = dict(zip(names, args))
    assert a["KV"].dtype == torch.float8_e4m3fn and a["KS"].dtype == torch.float32 and a["KT"].dtype == torch.bfloat16
    assert (a["sq_b8"], a["sq_s8"], a["sq_h8"]) == (H * 576 // 8, H * 576 // 8, 72)
    assert a["skv_b"] == T * 656 and (a["sks_b"], a["sks_t"], a["sks_c"]) == (T * 164, 164, 1)
    assert a["skt_b8"] == T * 328 // 8 and (a["T"], a["H"], a["SH"]) == (T, H, H)
    # one split: the kernel writes the output itself
    assert F.launch_args(call.shard(), num_splits=1)[2][3] is None
    # no keys at all: final without a launch (output 0, LSE -inf)
    out, lse, plan = F.launch_args(_packed_call(1, 64, 0).shard())
    assert plan is None and (out == 0).all() and torch.isneginf(lse).all()
    # a latent whose rows are not whole 4-byte words is refused, not misread
    odd = call.replace(kv=torch.zeros(B, T, 514, dtype=torch.uint8)[..., :512].view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="4-byte words"):
        F.launch_args(odd.shard())
    with pytest.raises(ValueError, match="tiles"):
        from dcp_pass.runtime.decode.kernels.gluon.common import GluonConfig

        F.launch_args(call.shard(), config=GluonConfig(64, 32, 3))


@compiles_offline
def test_compiles_for_hopper_with_this_triton():
    """Valid Gluon for the installed Triton, within shared memory (the bf16 kernel's buffers:
    the fp8 tile waits in registers), no spills, the bf16 kernel's wgmma shapes and count
    (36 score steps + 2 x 4 value steps a tile), 16-byte loads of the fp8 rows; plain, and
    with a decode step's mask row and a causal cap."""
    _gluon()
    off = offline_module("offline_gluon")
    for separate, masked in ((False, False), (True, False), (False, True)):
        r = off.compile_fp8(separate_rope=separate, mask=masked, causal=masked)
        assert r["stack"] == 0 and r["ldl"] == 0 and r["smem_kib"] <= 227, r
        assert set(r["hgmma"]) == {"64x64x16", "64x256x16"} and r["n_hgmma"] == 36 + 8, r


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="needs a Hopper GPU")
TOL = 2e-2  # the bf16 Gluon kernels' tolerance: P and the output in bf16, the cache values rounded to bf16 once


def _fp8(call, out=None, lse=None, num_splits=None):
    from dcp_pass.runtime.decode.backends import attend

    options = {} if num_splits is None else dict(num_splits=num_splits)
    return attend(call, "gluon_fp8", out, lse, **options)


def _check(call, lens_local, num_splits=None, stripe=None):
    B, H = call.q_lat.shape[0], call.q_lat.shape[2]
    clean = call.replace(kv_lens=lens_local)
    ro, rl = ref64(clean)  # before poisoning: the reference never reads past a length anyway
    target = call if stripe is None else call.replace(stripe=stripe)
    poison_fp8_rows(call, lens_local)
    out, lse = poisoned(B, 1, H, 512, torch.bfloat16, "cuda")
    _fp8(target, out, lse, num_splits)
    check_close(out, lse, ro, rl, TOL)
    return out, lse


@gpu
@needs_hopper
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("keys", [4096, 32768])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.gpu_full
def test_gpu_fp8_against_the_dequantised_cache(heads, keys, num_splits):
    g = torch.Generator().manual_seed(heads + keys)
    B = 8
    lens = torch.tensor([keys, 1, 0, keys - 1, 64, 65, keys // 3, 4097 % keys], device="cuda")
    call = _packed_call(B, heads, keys, "cuda", lens, gen=g)
    out, lse = _check(call, lens, num_splits)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()  # the empty request


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_fp8_striped_lengths_two_caches_and_wide_scales():
    """Global counts under a (2, 1) stripe, a 528-byte latent row beside a rope buffer, and
    blocks whose scales differ by 2^20 between keys and columns. The kernel attends over
    bf16(e4m3 * scale) (its documented read): against the float64 attention of exactly those
    values it is as close as on ordinary scales. Against the unrounded dequantised cache it
    is only as close as that rounding allows: with these scales the largest logits reach
    ~800, where one bf16 ulp of a key moves a score by ~1, which the CPU emulation below
    measures the same way."""
    g = torch.Generator().manual_seed(7)
    B, H, T = 3, 128, 5000
    glens = torch.tensor([2 * T, 77, 0], device="cuda")
    local = torch.div(glens + 2 - 1 - 1, 2, rounding_mode="floor").clamp(max=T)
    call = _packed_call(B, H, T, "cuda", None, separate=True, gen=g)
    call.kv_scale[0, ::3, 1] *= 2.0 ** 10
    call.kv_scale[0, 1::3, 2] *= 2.0 ** -10
    rounded = _bf16_dequantised(call.replace(kv_lens=local))
    ro, rl = ref64(rounded)
    exact_o, _ = ref64(call.replace(kv_lens=local))
    rounding_err = ((ro - exact_o).norm() / exact_o.norm()).item()
    poison_fp8_rows(call, local)
    for stripe, lens in (((1, 0), local), ((2, 1), glens)):
        out, lse = poisoned(B, 1, H, 512, torch.bfloat16, "cuda")
        _fp8(call.replace(kv_lens=lens, stripe=stripe), out, lse)
        check_close(out, lse, ro, rl, TOL)
        err = ((out.double() - exact_o).norm() / exact_o.norm()).item()
        assert err < 1.5 * rounding_err + TOL, (err, rounding_err)


def _bf16_dequantised(call):
    """The call over a bf16 latent holding bf16(e4m3 * scale): what the Gluon fp8 kernel reads."""
    from dcp_pass.runtime.decode.kv_format import dequantize

    lat = dequantize(call.kv, call.kv_scale, torch.float32).to(torch.bfloat16)
    return AttentionCall(call.q_lat, call.q_rope, lat, call.pe.contiguous(), 512, call.scale, kv_lens=call.kv_lens)


def test_bf16_rounding_of_the_dequantised_cache_is_what_wide_scales_cost():
    """CPU: with the scales of the GPU test above, rounding the dequantised latent to bf16
    alone moves the output by about 0.14 (relative) from the unrounded dequantised cache,
    while on ordinary scales it moves it by under 1e-2: the GPU test's reference is the
    rounded cache for that reason, not a slack tolerance."""
    B, H, T = 3, 128, 5000
    local = torch.tensor([T, 39, 0])
    for wide, lo, hi in ((True, 0.05, 0.5), (False, 0.0, 1e-2)):
        call = _packed_call(B, H, T, "cpu", local, separate=True, gen=torch.Generator().manual_seed(7))
        if wide:
            call.kv_scale[0, ::3, 1] *= 2.0 ** 10
            call.kv_scale[0, 1::3, 2] *= 2.0 ** -10
        exact_o, _ = ref64(call)
        ro, _ = ref64(_bf16_dequantised(call))
        err = ((ro - exact_o).norm() / exact_o.norm()).item()
        assert lo <= err < hi, (wide, err)


@gpu
@needs_hopper
def test_gpu_fp8_matches_the_two_gemm_kernel_and_a_nan_stays_in_its_request():
    from dcp_pass.runtime.decode.backends import attend

    g = torch.Generator().manual_seed(3)
    B, H, T = 4, 128, 6000
    lens = torch.tensor([T, 4321, 3000, 1], device="cuda")
    call = _packed_call(B, H, T, "cuda", lens, gen=g)
    ro, rl = ref64(call)
    out, lse = _fp8(call)
    wo, wl = attend(call, "wide")
    err = ((out.double() - ro).norm() / ro.norm()).item()
    werr = ((wo.double() - ro).norm() / ro.norm()).item()
    assert err < max(2 * werr, 1e-2), (err, werr)
    call.kv.view(torch.uint8)[1, 1234, 7] = 0x7F
    out, lse = _fp8(call)
    assert torch.isnan(out[1]).all()
    check_close(out[[0, 2, 3]], lse[[0, 2, 3]], ro[[0, 2, 3]], rl[[0, 2, 3]], TOL)


@gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.gpu_full
def test_gpu_fp8_mask_rows_and_causal_caps(num_splits):
    """A decode step's mask row per request (finite and -inf entries, a request that sees
    nothing, a key-strided row); a causal cap on a striped 3-token call with 40 heads (rows of
    different query positions share a block), with and without a mask row; against the float64
    attention of the dequantised cache."""
    g = torch.Generator().manual_seed(13)
    B, T = 3, 3000
    lens = torch.tensor([T, 2500, T], device="cuda")
    call = _packed_call(B, 128, T, "cuda", lens, gen=g)
    for mask in decode_mask_rows(B, T, "cuda"):
        masked = call.replace(mask=mask)
        ro, rl = ref64(masked)
        out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
        _fp8(masked, out, lse, num_splits)
        check_close(out, lse, ro, rl, TOL)
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    S, H = 3, 40
    base = _packed_call(B, H, T, "cuda", None, separate=True, gen=g)
    q_lat = torch.randn(B, S, H, 512, generator=g).to("cuda", torch.bfloat16)
    q_rope = torch.randn(B, S, H, 64, generator=g).to("cuda", torch.bfloat16)
    glens = torch.tensor([5001, 1, 4000 + 2 * 64], device="cuda")  # rank 1 of 2 holds the odd positions
    for mask in (None, decode_mask_rows(B, 2 * T, "cuda")[0]):
        capped = base.replace(q_lat=q_lat, q_rope=q_rope, kv_lens=glens, q_pos=last_positions(glens, S),
                              stripe=(2, 1), mask=mask)
        ro, rl = ref64(capped)
        out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
        _fp8(capped, out, lse, num_splits)
        check_close(out, lse, ro, rl, TOL)


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_fp8_cuda_graph_capture():
    B, H, T = 8, 128, 4096
    lens = torch.full((B,), 100, device="cuda")
    call = _packed_call(B, H, T, "cuda", lens)
    run = lambda: _fp8(call)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = run()
    lens.copy_(torch.randint(1, T + 1, (B,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ro, rl = ref64(call)
    check_close(o, lse, ro, rl, TOL)
