"""Tests of the seesaw Gluon MLA kernel (dcp_pass.runtime.decode.kernels.gluon.seesaw).

Gluon has no interpreter: the kernel runs only on a Hopper GPU (``-m gpu``). On CPU: which
calls it takes, that the chooser never takes it unmeasured, and an offline sm_90 compile
(its wgmmas, shared memory). GPU: DeepSeek-V3 shapes in bf16 against the fp32 reference,
rows past each length poisoned with NaN, key counts that leave a pair's second tile past
the end (odd tile counts) or empty, splits, stripes, two caches, multi-token rows with a
partial row block, scores whose running max moves along the cache (the two warpgroups hand
it to each other), a NaN key, and CUDA-graph capture.
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

from kit.kernels import check_close, decode_mask_rows, gluon_kernel, last_positions, poisoned, ref32  # noqa: E402
from kit.offline import compiles_offline, offline_module  # noqa: E402

from dcp_pass.runtime.decode.call import AttentionCall, CallShape  # noqa: E402
from dcp_pass.runtime.decode.kernels import registry  # noqa: E402

SCALE = 192 ** -0.5
H200 = CallShape(heads=128, batch=8, keys=32768)


def _module():
    return gluon_kernel("gluon.seesaw")


def test_which_calls_it_takes():
    S = _module()
    assert S.supports(H200) is None and S.offered(H200) is None
    for kw in (dict(mask="row"), dict(causal=True), dict(mask="row", causal=True)):  # a decode mask row, a cap
        assert S.supports(dataclasses.replace(H200, **kw)) is None, kw
    reasons = {"one row per request": dict(mask="full"), "Hopper": dict(capability=8),
               "bfloat16": dict(dtype=torch.float16), "multiples of 16": dict(rows16=False),
               "page pools": dict(paged=True), "the per-head kernel": dict(per_head=True)}
    for words, kw in reasons.items():
        reason = S.supports(dataclasses.replace(H200, **kw))
        assert reason is not None and words in reason, (kw, reason)
    assert "fewer than 64" in S.offered(dataclasses.replace(H200, heads=16))
    assert "Triton 3.6" in S.offered(dataclasses.replace(H200, triton="3.9.0"))
    assert S.unmeasured(H200) is False  # the chooser takes it only where the path table says so
    q = torch.zeros(1, 1, 128, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    assert "Hopper" in registry.KERNELS["gluon_seesaw"].supports(AttentionCall(q, None, kv, None, 512, 1.0).shape)


@compiles_offline
def test_compiles_for_hopper_with_this_triton():
    """Valid Gluon for the installed Triton, one fused cache and two, plain and with a mask row
    and a causal cap: each warpgroup's 36 score steps (m64n64) and 2 x 4 value steps
    (m64n256), within shared memory."""
    _module()
    off = offline_module("offline_gluon")
    for separate, masked in ((False, False), (True, False), (False, True)):
        r = off.compile_roles(separate_rope=separate, seesaw=True, mask=masked, causal=masked)
        assert r["smem_kib"] <= 227, r
        assert set(r["hgmma"]) == {"64x64x16", "64x256x16"} and r["n_hgmma"] == 2 * (36 + 8), r


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="needs a Hopper GPU")


def _seesaw(call, out=None, lse=None, num_splits=None):
    from dcp_pass.runtime.decode.backends import attend

    options = {} if num_splits is None else dict(num_splits=num_splits)
    return attend(call, "gluon_seesaw", out, lse, **options)


def _poisoned_case(B, S, H, T, lens, stripe=(1, 0), separate=False, seed=3):
    """(call, clean call): q and a cache whose rows past each rank-local length are NaN in the
    kernel's call and zero in the reference's."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor(lens, device="cuda")
    c, r = stripe
    local = torch.div(lens.clamp(min=0) + c - 1 - r, c, rounding_mode="floor").clamp(max=T)
    clean = kv.clone()
    for b in range(B):
        kv[b, local[b]:] = float("nan")
        clean[b, local[b]:] = 0
    if separate:
        def parts(x):
            return x[..., :512].contiguous(), x[..., 512:].contiguous()

        (kl, kr), (cl, cr) = parts(kv), parts(clean)
        call = AttentionCall(q[..., :512], q[..., 512:], kl, kr, 512, SCALE, kv_lens=lens, stripe=stripe)
        ref = AttentionCall(q[..., :512], q[..., 512:], cl, cr, 512, SCALE, kv_lens=local)
    else:
        call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens, stripe=stripe)
        ref = AttentionCall(q, None, clean, None, 512, SCALE, kv_lens=local)
    return call, ref


@gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.gpu_full
def test_gpu_ragged_lengths_odd_tile_counts_and_nan_beyond(num_splits):
    """Lengths of 1, 63, 64, 65 (one tile; two), 129 (three: the second pair's odd tile is past
    the end), 0 (an empty request) and a full cache."""
    call, ref = _poisoned_case(7, 1, 128, 8192, [8192, 1, 63, 64, 65, 129, 0])
    out, lse = poisoned(7, 1, 128, 512, torch.bfloat16, "cuda")
    _seesaw(call, out, lse, num_splits)
    ro, rl = ref32(ref)
    check_close(out, lse, ro, rl, 2e-2)
    assert (out[6] == 0).all() and torch.isneginf(lse[6]).all()


@gpu
@needs_hopper
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.gpu_full
def test_gpu_striped_lengths_two_caches_multi_token_rows(separate):
    """Global counts under a (2, 1) stripe; 3 query tokens x 40 heads (a full and a partial
    64-row block); one fused cache or a latent and a rope buffer (the reference model's)."""
    for num_splits in (None, 2, 7):
        call, ref = _poisoned_case(3, 3, 40, 3000, [5999, 0, 1001], stripe=(2, 1), separate=separate)
        out, lse = poisoned(3, 3, 40, 512, torch.bfloat16, "cuda")
        _seesaw(call, out, lse, num_splits)
        ro, rl = ref32(ref)
        check_close(out, lse, ro, rl, 2e-2)
        assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_running_max_handed_between_warpgroups():
    """A max that rises tile after tile (each warpgroup must rescale to the other's), one early
    key that dominates every later tile, scores spread over ~2^20 (q x 8); then one NaN key:
    its request's rows are NaN, the others exact."""
    g = torch.Generator(device="cuda").manual_seed(11)
    B, T = 4, 6000
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    q[2] *= 8
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv[0] *= torch.linspace(0.2, 3.0, T, device="cuda").to(torch.bfloat16)[:, None]
    kv[1, 5] *= 40
    lens = torch.tensor([T, T, 4321, 3000], device="cuda")
    call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens)
    ro, rl = ref32(call)
    for ns in (None, 3):
        out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
        _seesaw(call, out, lse, ns)
        check_close(out, lse, ro, rl, 2e-2)
    bad = kv.clone()
    bad[3, 1234, 7] = float("nan")
    out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
    _seesaw(call.replace(kv=bad), out, lse)
    assert torch.isnan(out[3]).all()
    check_close(out[:3], lse[:3], ro[:3], rl[:3], 2e-2)


@gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.gpu_full
def test_gpu_mask_rows_and_causal_caps(num_splits):
    """A decode step's mask row per request (finite and -inf entries, a request that sees
    nothing, a key-strided row), a causal cap on a striped 3-token call with 40 heads (rows of
    different query positions share a 64-row block; lengths that end a pair on its even tile),
    and both at once, against the fp32 reference."""
    g = torch.Generator(device="cuda").manual_seed(5)
    B, T = 3, 3000
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor([T, 2500, T], device="cuda")
    for mask in decode_mask_rows(B, T, "cuda"):
        call = AttentionCall(q, None, kv, None, 512, SCALE, mask=mask, kv_lens=lens)
        out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
        _seesaw(call, out, lse, num_splits)
        ro, rl = ref32(call)
        check_close(out, lse, ro, rl, 2e-2)
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    S, H = 3, 40
    q3 = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    glens = torch.tensor([5001, 1, 4000 + 2 * 64], device="cuda")  # rank 1 of 2 holds the odd positions
    for mask in (None, decode_mask_rows(B, 2 * T, "cuda")[0]):  # (a mask row covers the global positions)
        call = AttentionCall(q3, None, kv, None, 512, SCALE, kv_lens=glens, q_pos=last_positions(glens, S),
                             stripe=(2, 1), mask=mask)
        out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
        _seesaw(call, out, lse, num_splits)
        ro, rl = ref32(call)
        check_close(out, lse, ro, rl, 2e-2)


@gpu
@needs_hopper
def test_gpu_equals_the_role_split_kernel_to_rounding():
    """The same call on the role-split kernel: the two differ only in where P is rounded."""
    from dcp_pass.runtime.decode.backends import attend

    call, ref = _poisoned_case(8, 1, 128, 4096, [4096, 4000, 3333, 2048, 1000, 999, 128, 64])
    o1, l1 = _seesaw(call)
    o2, l2 = attend(call, "gluon_roles")
    ro, rl = ref32(ref)
    e1 = ((o1.double() - ro).norm() / ro.norm()).item()
    e2 = ((o2.double() - ro).norm() / ro.norm()).item()
    assert e1 < 1.5 * e2 + 1e-4, (e1, e2)
    assert (l1 - l2).abs().max().item() < 1e-4


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_cuda_graph_capture():
    B, T = 8, 4096
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), 100, device="cuda")
    call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens)
    _seesaw(call)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = _seesaw(call)
    lens.copy_(torch.randint(1, T + 1, (B,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ro, rl = ref32(call)
    check_close(o, lse, ro, rl, 2e-2)
