"""Tests of the one-read MLA kernel (dcp_pass.runtime.decode.kernels.mla_oneread).

CPU part: interpreter worker (see test_kernel_mla.py), fp16 (the kernel takes 16-bit
caches only; the interpreter's bf16 dot is wrong), outputs poisoned with NaN, compared
with a float64 reference; ragged lengths with 0 and 1, masks, causal stripes merged
across ranks, several splits, and a wrong result that must be caught.

GPU part (``-m gpu``): DeepSeek-V3 shapes (128 heads, 512 + 64) in bf16 against the
fp32 reference, and CUDA-graph capture (the scratch hand-off is inside the graph).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from dcp_pass.testing import interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from test_kernel_mla import TOL, _gen, check_close, make_inputs, merge, poisoned, ref64  # noqa: E402

F16 = torch.float16


def _run(*, B=2, S=1, H=8, Dl=64, Dr=8, T=40, fused=True, mask=None, kv_lens=None, causal=None, lse_base="e",
         num_splits=None, scale=0.2, q=None):
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, Dl, Dr, T, F16, fused=fused, gen=_gen())
    out, lse = poisoned(B, S, H, vd, F16, "cpu")
    m.mla_attention_triton(q_lat, q_rope, kv, pe, vd, scale, mask, kv_lens, lse_base, causal, out=out,
                           lse_out=lse, num_splits=num_splits, path="oneread")
    ro, rl = ref64(q_lat, q_rope, kv, pe, vd, 0.2, mask, kv_lens, causal)
    check_close(out, lse, ro, rl, TOL[F16], lse_base)
    assert (~torch.isneginf(rl)).any() and ro.abs().max().item() > 1e-3 and out.abs().max().item() > 1e-3
    return out, lse


def check_fused_ragged_lens_several_splits():
    _run(B=4, kv_lens=torch.tensor([0, 1, 40, 17]), num_splits=2)
    _run(B=2, kv_lens=torch.tensor([40, 23]), num_splits=1)


def check_separate_rope_mask_per_row_and_shared():
    B, S, H, T = 2, 2, 4, 37
    mask = torch.randn(B, S, H, T, generator=_gen())
    mask[mask < -1.0] = float("-inf")
    mask[1, 0, 2, :] = float("-inf")  # one fully masked row
    _run(B=B, S=S, H=H, T=T, fused=False, mask=mask, num_splits=2)
    shared = torch.zeros(B, 1, 1, T)
    shared[1, ..., 20:] = float("-inf")
    _run(B=B, S=1, H=H, T=T, mask=shared, lse_base="2", num_splits=3)


def check_causal_stripes_merge_to_the_full_attention():
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    c, L_list, S, H = 3, [45, 7, 3], 2, 4
    B = len(L_list)
    q_lat, _, kv, _, vd = make_inputs(B, S, H, 64, 8, max(L_list), F16, fused=True, gen=_gen())
    lens = torch.tensor(L_list)
    q_pos = lens.view(B, 1) - S + torch.arange(S).view(1, S)
    full_o, full_l = ref64(q_lat, None, kv, None, vd, 0.5, kv_lens=lens, causal=(q_pos, 1, 0))
    outs, lses = [], []
    for r in range(c):
        o, lse = m.mla_attention_triton(q_lat, None, kv[:, r::c].contiguous(), None, vd, 0.5, None, lens, "e",
                                        (q_pos, c, r), num_splits=2, path="oneread", lens_stripe=(c, r))
        outs.append(o)
        lses.append(lse)
    mo, ml = merge(torch.stack(outs), torch.stack(lses))
    check_close(mo, ml.float(), full_o, full_l, TOL[F16])


def check_empty_shard_and_refusals():
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    q_lat, _, kv, _, vd = make_inputs(2, 1, 4, 64, 8, 0, F16, fused=True, gen=_gen())
    out, lse = poisoned(2, 1, 4, vd, F16, "cpu")
    m.mla_attention_triton(q_lat, None, kv, None, vd, 0.1, out=out, lse_out=lse, path="oneread")
    assert (out == 0).all() and torch.isneginf(lse).all()
    q32, _, kv32, _, vd = make_inputs(1, 1, 4, 64, 8, 8, torch.float32, fused=True, gen=_gen())
    try:
        m.mla_attention_triton(q32, None, kv32, None, vd, 0.1, path="oneread")
    except ValueError as e:
        assert "16-bit" in str(e)
    else:
        raise AssertionError("an fp32 cache must be refused by path='oneread'")


def check_wrong_result_is_caught():
    """One key too few or a wrong scale must fail the comparison."""
    lens = torch.tensor([40, 23])
    for kw in (dict(kv_lens=lens - torch.tensor([0, 1])), dict(kv_lens=lens, scale=0.21)):
        try:
            ok_lens = kw["kv_lens"]
            q_lat, _, kv, _, vd = make_inputs(2, 1, 8, 64, 8, 40, F16, fused=True, gen=_gen())
            from dcp_pass.runtime.decode.kernels import mla_attention as m

            o, l_ = m.mla_attention_triton(q_lat, None, kv, None, vd, kw.get("scale", 0.2), None, ok_lens,
                                           num_splits=2, path="oneread")
            ro, rl = ref64(q_lat, None, kv, None, vd, 0.2, kv_lens=lens)
            check_close(o, l_, ro, rl, TOL[F16])
        except AssertionError:
            continue
        raise AssertionError(f"a wrong result passed the check ({kw})")


CPU_CHECKS = interpreter.check_names(globals())


@pytest.fixture(scope="module")
def cpu_results():
    return interpreter.run_worker(__file__, ROOT)


@pytest.mark.parametrize("name", CPU_CHECKS)
def test_cpu_interpreter(cpu_results, name):
    res = cpu_results[name]
    assert res["ok"], res["msg"]


# ---------------------------------------------------------------- GPU (real shapes, bf16)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCALE = 192 ** -0.5


@gpu
@needs_cuda
@pytest.mark.parametrize("fused,num_splits", [(True, None), (True, 1), (False, 5)])
def test_gpu_oneread_bf16_real_shapes(fused, num_splits):
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    B, T = 4, 8192
    q_lat, q_rope, kv, pe, vd = make_inputs(B, 1, 128, 512, 64, T, torch.bfloat16, "cuda", fused=fused, gen=_gen())
    lens = torch.tensor([T, 1, 0, 5001], device="cuda")
    mask = torch.zeros(B, 1, 1, T, device="cuda")
    mask[3, ..., 4000:] = float("-inf")
    out, lse = poisoned(B, 1, 128, vd, torch.bfloat16, "cuda")
    m.mla_attention_triton(q_lat, q_rope, kv, pe, vd, SCALE, mask, lens, out=out, lse_out=lse,
                           num_splits=num_splits, path="oneread")
    ro, rl = m._reference_impl(q_lat, q_rope, kv, pe, vd, SCALE, mask, lens, None, torch.float32)
    check_close(out, lse, ro, rl, 2e-2)


@gpu
@needs_cuda
def test_gpu_oneread_cuda_graph_capture():
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    B, T = 8, 4096
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), 100, device="cuda")
    run = lambda: m.mla_attention_triton(q, None, kv, None, 512, SCALE, None, lens, path="oneread")  # noqa: E731
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


if __name__ == "__main__" and "--worker" in sys.argv:
    interpreter.worker_main(globals(), ROOT)
