"""Tests of the Gluon one-read MLA kernel (dcp_pass.runtime.decode.kernels.mla_gluon).

Gluon has no interpreter: the kernel runs only on a Hopper GPU (``-m gpu``). On CPU the
routing is checked: the kernel is never offered for operands it does not handle.
GPU: DeepSeek-V3 shapes in bf16 against the fp32 reference, with cache rows past each
request's length poisoned with NaN (a masked copy must not let them in: 0 x NaN is NaN),
ragged lengths with 0 and 1, several splits, striped lengths, and CUDA-graph capture.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from test_kernel_mla import check_close, poisoned  # noqa: E402


def test_not_offered_off_its_scope():
    from dcp_pass.runtime.decode.kernels import mla_gluon as G

    q = torch.zeros(1, 1, 8, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    assert not G.gluon_supported(q, None, kv, None, 512)  # CPU tensors
    assert not G.gluon_supported(q, None, kv, None, 512, mask=torch.zeros(1, 1, 1, 16))
    assert not G.gluon_supported(q.float(), None, kv.float(), None, 512)


gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="needs a Hopper GPU")
SCALE = 192 ** -0.5


def _case(B, T, lens, num_splits=None, stripe=(1, 0), config=None):
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor(lens, device="cuda")
    c, r = stripe
    local = torch.div(lens.clamp(min=0) + c - 1 - r, c, rounding_mode="floor").clamp(max=T)
    clean = kv.clone()
    for b in range(B):  # rows past the visible keys: NaN in the kernel's input, zero in the reference's
        kv[b, local[b]:] = float("nan")
        clean[b, local[b]:] = 0
    out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
    m.mla_attention_triton(q, None, kv, None, 512, SCALE, None, lens, out=out, lse_out=lse, num_splits=num_splits,
                           path="gluon", config=config, lens_stripe=stripe)
    ro, rl = m._reference_impl(q, None, clean, None, 512, SCALE, None, local, None, torch.float32)
    check_close(out, lse, ro, rl, 2e-2)
    return q, kv, lens


@gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_gpu_gluon_ragged_nan_beyond_lengths(num_splits):
    _case(4, 8192, [8192, 1, 0, 5001], num_splits)


@gpu
@needs_hopper
def test_gpu_gluon_striped_lengths_and_tiles():
    from dcp_pass.runtime.decode.kernels import mla_gluon as G

    for cfg in (G.GluonConfig(64, 32, 3), G.GluonConfig(64, 64, 2, schedule=1), G.GluonConfig(64, 64, 2, schedule=2),
                G.GluonConfig()):
        _case(3, 4100, [8199, 77, 2], stripe=(2, 1), config=cfg)


@gpu
@needs_hopper
def test_gpu_gluon_cuda_graph_capture():
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    B, T = 8, 4096
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), 100, device="cuda")
    run = lambda: m.mla_attention_triton(q, None, kv, None, 512, SCALE, None, lens, path="gluon")  # noqa: E731
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, lse = run()
    lens.copy_(torch.randint(1, T + 1, (B,), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    ro, rl = m._reference_impl(q, None, kv, None, 512, SCALE, None, lens, None, torch.float32)
    check_close(o, lse, ro, rl, 2e-2)
