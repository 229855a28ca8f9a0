"""Tests of the narrow-row fp8 Gluon kernel (dcp_pass.runtime.decode.kernels.gluon.fp8_narrow).

Gluon has no interpreter: the kernel runs only on a Hopper GPU (``-m gpu``). On CPU: which
calls it takes and why not, its launch arguments (TMA descriptors over the rows' own strides),
and its offline sm_90 compile (spills pinned; six TMA boxes a tile; per scorer and tile 16 fp8
score wgmmas and 36 of m64n16). GPU: 16 heads (and 8 and 12: a
partial row block) over packed fp8 rows against the float64 attention of the dequantised cache,
which it computes without rounding the cache (the scales act on the small tiles; the queries
enter as two exact e4m3 parts), with ragged and empty requests, rows
past each length poisoned with NaN, several splits, stripes, two caches, multi-token rows,
block scales spread by 2^20, a running max that moves along the cache, a NaN key, a decode
step's mask row, causal caps on striped multi-token calls and CUDA-graph capture.
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
                         gluon_kernel, poison_fp8_rows, poisoned, ref64)
from kit.kernels import packed_fp8_call as _packed_call  # noqa: E402
from kit.offline import compiles_offline, offline_module  # noqa: E402

from dcp_pass.runtime.decode.call import CallShape  # noqa: E402
from dcp_pass.runtime.decode.kernels import registry  # noqa: E402

FP8_16 = CallShape(dtype=torch.float8_e4m3fn, same_dtypes=True, fused=False, kv_quant="fp8_e4m3",
                   query_dtype=torch.bfloat16, rows16=False, heads=16)


def _narrow():
    return gluon_kernel("gluon.fp8_narrow")


def test_which_calls_it_takes():
    N = _narrow()
    assert N.supports(FP8_16) is None and N.offered(FP8_16) is None and N.unmeasured(FP8_16) is False
    reasons = {**FP8_GLUON_REFUSALS, "one row per request": dict(mask="full")}
    for words, kw in reasons.items():
        reason = N.supports(dataclasses.replace(FP8_16, **kw))
        assert reason is not None and words in reason, (kw, reason)
    for kw in (dict(mask="row"), dict(causal=True), dict(mask="row", causal=True)):  # a decode step's row, a cap
        assert N.supports(dataclasses.replace(FP8_16, **kw)) is None, kw
    assert "more than 16 query rows" in N.offered(dataclasses.replace(FP8_16, heads=32))
    assert "Triton 3.6" in N.offered(dataclasses.replace(FP8_16, triton="3.9.0"))
    assert "Hopper" in registry.KERNELS["gluon_fp8_narrow"].supports(_packed_call(1, 1, 16, 16).shape)
    assert registry.KERNELS["gluon_fp8_narrow"].cost_key_for(FP8_16) == "gluon_fp8_narrow"


def test_launch_arguments():
    """One program per 16 rows, split and batch row; TMA descriptors over the rows' own strides;
    a partial per scorer (two splits' worth a program for the stage-2 merge); rows TMA cannot read
    refused, with the part named, not misread."""
    N = _narrow()
    B, T = 2, 4096
    call = _packed_call(B, 2, 12, T, lens=torch.tensor([T, 0]))  # 24 rows: two row blocks
    out, lse, plan = N.launch_args(call.shard(), num_splits=3)
    grid, args, consts, stage2 = plan
    assert grid == (2, 3, B) and stage2 is not None
    assert consts == dict(BLOCK_R=16, BLOCK_N=64, NUM_SCORERS=2, NUM_SPLITS=3, HAS_LENS=True, STAGES=4,
                          HAS_MASK=False, CAUSAL=False)
    names = list(__import__("inspect").signature(N._narrow_kernel_src).parameters)
    a = dict(zip(names, args))
    # TMA boxes over the packed rows: the latent's 512 bytes as 128 words, the rope (bf16 from byte
    # 528), the four fp32 scales (from byte 512); [B, T, columns] with the rows' own strides
    kvd, ktd, ksd = a["KVD"], a["KTD"], a["KSD"]
    assert (kvd.base.dtype, list(kvd.shape), list(kvd.strides), list(kvd.block_shape)) == (
        torch.int32, [B, T, 128], [T * 164, 164, 1], [1, 64, 32])
    assert (ktd.base.dtype, list(ktd.shape), list(ktd.strides), list(ktd.block_shape)) == (
        torch.bfloat16, [B, T, 64], [T * 328, 328, 1], [1, 64, 64])
    assert (ksd.base.dtype, list(ksd.shape), list(ksd.strides), list(ksd.block_shape)) == (
        torch.float32, [B, T, 4], [T * 164, 164, 1], [1, 64, 4])
    row = call.kv.data_ptr()
    assert (kvd.base.data_ptr() - row, ksd.base.data_ptr() - row, ktd.base.data_ptr() - row) == (0, 512, 528)
    assert (a["T"], a["H"], a["SH"]) == (T, 12, 24)
    # each scorer writes a partial: one split and one scorer write the output directly
    assert N.launch_args(call.shard(), num_splits=1)[2][3] is not None
    assert N.launch_args(call.shard(), num_splits=1, scorers=1)[2][3] is None
    assert stage2[3]["NUM_SPLITS"] == 3 * 2
    odd = call.replace(kv=torch.zeros(B, T, 520, dtype=torch.uint8)[..., :512].view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="16 bytes at a time"):
        N.launch_args(odd.shard())
    with pytest.raises(ValueError, match="1 or 2 scorer"):
        N.launch_args(call.shard(), scorers=3)
    # a rope buffer of its own whose rows are 68 elements apart (136 bytes: not a TMA stride), and
    # scales whose rows are 5 floats apart: refused with the part named, before any launch
    two = _packed_call(B, 1, 16, T, separate=True)
    odd_rope = torch.zeros(B, T, 68, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValueError, match="rope rows by TMA"):
        N.launch_args(two.replace(pe=odd_rope).shard())
    odd_scales = torch.ones(B, T, 5)[..., :4]
    with pytest.raises(ValueError, match="scales by TMA"):
        N.launch_args(two.replace(kv_scale=odd_scales).shard())
    # a decode step's mask row (key stride 2) and a causal cap on rank 1 of a 2-way stripe
    mask = torch.zeros(B, 1, 1, 4 * T)[..., ::2]  # global keys, every other column
    capped = call.replace(mask=mask, q_pos=torch.tensor([[T + 5, T + 6], [7, 8]]), stripe=(2, 1))
    grid, args, consts, _ = N.launch_args(capped.shard(), num_splits=3)[2]
    a = dict(zip(names, args))
    assert consts["HAS_MASK"] and consts["CAUSAL"]
    assert a["MASK"].dtype == torch.float32 and (a["sm_t"], a["cp_world"], a["cp_rank"]) == (4, 2, 1), a
    assert a["QPOS"].tolist() == [[T + 5, T + 6], [7, 8]]


@compiles_offline
def test_compiles_for_hopper_with_this_triton():
    """Valid Gluon for the installed Triton, one packed row and two caches, one scorer and two,
    plain and with a mask row and a causal cap: within shared memory; on Triton 3.6 (where it is
    offered) no spills, but for one 8-byte value of the loader's once a tile with a mask row
    (ptxas, around the elected TMA issue), on 3.9 (not offered) at most 24 bytes (values the
    parent region hands the partitions, kept on the stack);
    six TMA boxes a tile and no cp.async but the mask row's; per scorer and tile 16 fp8 score
    steps (m64n32k32: four 128-column blocks, the two query parts as N) read straight from the
    staged bytes, 4 rope score steps and 32 value steps of m64n16k16, and the values' e4m3 ->
    f16 packed conversions (one per two values: 128 a thread and tile)."""
    import triton

    _narrow()
    off = offline_module("offline_gluon")
    for separate, scorers, masked in ((False, 2, False), (True, 2, False), (False, 1, False), (False, 2, True)):
        r = off.compile_fp8_narrow(separate_rope=separate, scorers=scorers, mask=masked, causal=masked)
        assert r["smem_kib"] <= 227, r
        if triton.__version__.startswith("3.6"):
            assert (r["stack"], r["ldl"]) == ((8, 1) if masked else (0, 0)), r
        elif triton.__version__.startswith("3.9"):  # (this machine's)
            assert r["stack"] <= 24, r
        assert r["tma"] == 6 and r["cp_async"] == (2 if masked else 0), r
        assert r["hgmma"] == ["64x16x16"] and r["n_hgmma"] == scorers * (4 + 32), r
        assert r["n_qgmma"] == scorers * 16, r
        assert r["f2fp_e4m3"] >= scorers * 128, r


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="needs a Hopper GPU")
TOL = 1e-2  # P rounded to f16 once, fp8 tensor-core sums; the cache enters unrounded
# the LSE bound where logits reach thousands (queries x 2^12, key scales x 2^10): the fp8 tensor
# cores add a block's products with ~2^-13 of their magnitude, so the LSE moves by units there
LSE_REL = 1e-3


def _run(call, out=None, lse=None, num_splits=None):
    from dcp_pass.runtime.decode.backends import attend

    options = {} if num_splits is None else dict(num_splits=num_splits)
    return attend(call, "gluon_fp8_narrow", out, lse, **options)


@gpu
@needs_hopper
@pytest.mark.parametrize("heads", [16, 12, 8])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.gpu_full
def test_gpu_against_the_dequantised_cache(heads, num_splits):
    g = torch.Generator().manual_seed(heads * 7 + (num_splits or 0))
    B, T = 8, 8192
    lens = torch.tensor([T, 1, 0, T - 1, 64, 65, T // 3, 4097], device="cuda")
    call = _packed_call(B, 1, heads, T, "cuda", lens, gen=g)
    ro, rl = ref64(call)
    poison_fp8_rows(call, lens)
    out, lse = poisoned(B, 1, heads, 512, torch.bfloat16, "cuda")
    _run(call, out, lse, num_splits)
    check_close(out, lse, ro, rl, TOL)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_stripes_two_caches_multi_token_rows_and_wide_scales():
    """Global counts under a (2, 1) stripe, a latent buffer beside a rope buffer, 2 tokens x 8
    heads (16 rows, token-major), and block scales spread by 2^20 between keys and columns: the
    kernel folds the scales into the small tiles (the cache is never rounded); its LSE error grows
    with the logits there (the fp8 tensor cores' sums), its output stays within TOL."""
    g = torch.Generator().manual_seed(7)
    B, S, H, T = 3, 2, 8, 5000
    glens = torch.tensor([2 * T, 77, 0], device="cuda")
    local = torch.div(glens + 2 - 1 - 1, 2, rounding_mode="floor").clamp(max=T)
    call = _packed_call(B, S, H, T, "cuda", None, separate=True, gen=g)
    call.kv_scale[0, ::3, 1] *= 2.0 ** 10
    call.kv_scale[0, 1::3, 2] *= 2.0 ** -10
    ro, rl = ref64(call.replace(kv_lens=local))
    poison_fp8_rows(call, local)
    for stripe, lens in (((1, 0), local), ((2, 1), glens)):
        for ns in (None, 3):
            out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
            _run(call.replace(kv_lens=lens, stripe=stripe), out, lse, ns)
            check_close(out, lse, ro, rl, TOL, lse_rel=LSE_REL)


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_running_max_scaled_queries_and_a_nan_key():
    """A max that rises tile after tile, one early key that dominates, queries scaled x 2^12 (the
    query blocks' power-of-two factors) and x 2^-12; then one NaN key: its request's rows
    are NaN, the others exact."""
    g = torch.Generator().manual_seed(11)
    B, H, T = 4, 16, 6000
    lens = torch.tensor([T, T, 4321, 3000], device="cuda")
    call = _packed_call(B, 1, H, T, "cuda", lens, gen=g)
    call.kv_scale[0] *= torch.linspace(0.2, 3.0, T, device="cuda")[:, None]
    call.kv_scale[1, 5] *= 40
    q = call.q_lat.clone()
    q[2] *= 2.0 ** 12
    q[3, :, :, :128] *= 2.0 ** -12
    call = call.replace(q_lat=q)
    ro, rl = ref64(call)
    for ns in (None, 3):
        out, lse = poisoned(B, 1, H, 512, torch.bfloat16, "cuda")
        _run(call, out, lse, ns)
        check_close(out, lse, ro, rl, TOL, lse_rel=LSE_REL)
    call.kv_scale[3, 1234, 2] = float("nan")  # what the quantiser writes for a block holding a NaN
    out, lse = _run(call)
    assert torch.isnan(out[3]).all()
    check_close(out[:3], lse[:3], ro[:3], rl[:3], TOL, lse_rel=LSE_REL)


@gpu
@needs_hopper
def test_gpu_matches_the_fp8_role_split_kernel():
    from dcp_pass.runtime.decode.backends import attend

    g = torch.Generator().manual_seed(3)
    B, H, T = 8, 16, 4096
    lens = torch.tensor([4096, 4000, 3333, 2048, 1000, 999, 128, 64], device="cuda")
    call = _packed_call(B, 1, H, T, "cuda", lens, gen=g)
    ro, rl = ref64(call)
    o1, l1 = _run(call)
    o2, l2 = attend(call, "gluon_fp8")
    e1 = ((o1.double() - ro).norm() / ro.norm()).item()
    e2 = ((o2.double() - ro).norm() / ro.norm()).item()
    assert e1 <= e2 * 1.2 + 1e-4, (e1, e2)
    # its LSE carries the fp8 tensor cores' additions (the role-split kernel's, the bf16-rounded cache)
    lerr1, lerr2 = (l1 - rl).abs().max().item(), (l2 - rl).abs().max().item()
    assert lerr1 < 3e-3 and lerr2 < 3e-3, (lerr1, lerr2)


@gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.gpu_full
def test_gpu_mask_rows_and_causal_caps(num_splits):
    """A decode step's mask row per request at 16 heads (finite and -inf entries, a request that
    sees nothing, a key-strided row); causal caps on striped calls of 2 tokens x 8 heads and 4 x
    4 (rows of different query positions share the block), with and without a mask row; against
    the float64 attention of the dequantised cache."""
    g = torch.Generator().manual_seed(17)
    B, T = 3, 3000
    lens = torch.tensor([T, 2500, T], device="cuda")
    call = _packed_call(B, 1, 16, T, "cuda", lens, gen=g)
    for mask in decode_mask_rows(B, T, "cuda"):
        masked = call.replace(mask=mask)
        ro, rl = ref64(masked)
        out, lse = poisoned(B, 1, 16, 512, torch.bfloat16, "cuda")
        _run(masked, out, lse, num_splits)
        check_close(out, lse, ro, rl, TOL)
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    glens = torch.tensor([5001, 1, 4000 + 2 * 64], device="cuda")  # rank 1 of 2 holds the odd positions
    for S, H in ((2, 8), (4, 4)):
        base = _packed_call(B, S, H, T, "cuda", None, separate=S == 4, gen=g)
        for mask in (None, decode_mask_rows(B, 2 * T, "cuda")[0]):
            capped = base.replace(kv_lens=glens, q_pos=last_positions(glens, S), stripe=(2, 1), mask=mask)
            ro, rl = ref64(capped)
            out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
            _run(capped, out, lse, num_splits)
            check_close(out, lse, ro, rl, TOL)


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_cuda_graph_capture():
    B, H, T = 8, 16, 4096
    lens = torch.full((B,), 100, device="cuda")
    call = _packed_call(B, 1, H, T, "cuda", lens)
    _run(call)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = _run(call)
    lens.copy_(torch.randint(1, T + 1, (B,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ro, rl = ref64(call)
    check_close(o, lse, ro, rl, TOL)
