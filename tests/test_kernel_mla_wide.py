"""Tests of the two-GEMM wide-head MLA kernels (dcp_pass.runtime.decode.kernels.mla_wide).

CPU part: the kernels run under Triton's interpreter in one worker subprocess (this file
run as a script, TRITON_INTERPRET=1 set before triton's import; see test_kernel_mla.py
for why), fp32 and fp16 only, outputs poisoned with NaN, compared with a float64
reference. Small tiles (16) so that every case has several key tiles, row blocks and
value chunks, and several splits. Each comparison also checks that the result is not
trivial, and one check shows that a deliberately wrong result is caught.

GPU part (``-m gpu``, skipped without CUDA): DeepSeek-V3 shapes (128 heads, 512 + 64) in
bf16 against the fp32 reference and the fused split-KV kernel, and CUDA-graph capture.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.testing import interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from kit.kernels import TOL, check_close, gen as _gen, global_counts, interpreter_tests, make_inputs, merge, poisoned, ref32, ref64, rel_err  # noqa: E402,F401,E501


def _wide():
    from dcp_pass.runtime.decode.kernels import mla_wide as w

    return w


def _base():
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    return m


def _attend(call, kernel="wide", out=None, lse_out=None, **options):
    """`call` on a named kernel (or, with ``config``, the kernel it configures)."""
    from dcp_pass.runtime.decode.backends import attend

    return attend(call, None if "config" in options else kernel, out, lse_out, **options)


# ======================================================================================
# CPU checks (run in the interpreter worker)
# ======================================================================================
def _cfg(block_m=16, block_v=16, num_splits=None):
    w = _wide()
    return w.WideConfig(block_m, 16, 16, 4, 1, block_v, 4, 1, num_splits)


def _nontrivial(out, ref_out, ref_lse):
    """The comparison means something: visible rows exist and the output is not ~0."""
    assert (~torch.isneginf(ref_lse)).any(), "case has no visible key at all"
    assert ref_out.abs().max().item() > 1e-3, "reference output is ~0"
    assert out.double().abs().max().item() > 1e-3, "output is ~0"


def _run(dtype, *, B=2, S=2, H=4, Dl=32, Dr=8, T=40, fused=False, v_dim=None, mask=None, kv_lens=None,
         q_pos=None, stripe=(1, 0), lse_base="e", num_splits=None, config=None, q_transpose=False, via=None):
    g = _gen()
    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, Dl, Dr, T, dtype, fused=fused, v_dim=v_dim, gen=g)
    if q_transpose:  # non-contiguous query: stored [B, H, S, D]
        q_lat = q_lat.transpose(1, 2).contiguous().transpose(1, 2)
    scale = 0.7 / math.sqrt(q_lat.shape[-1])
    call = AttentionCall(q_lat, q_rope, kv, pe, vd, scale, mask=mask, q_pos=q_pos, kv_lens=kv_lens, stripe=stripe,
                         lse_base=lse_base)
    out, lse = poisoned(B, S, H, vd, dtype, "cpu")
    options = {} if num_splits is None else dict(num_splits=num_splits)
    if via == "triton":  # by its name, with its default tiles
        _attend(call, "wide", out, lse, **options)
    else:
        _attend(call, out=out, lse_out=lse, config=config if config is not None else _cfg(), **options)
    ro, rl = ref64(call)
    check_close(out, lse, ro, rl, TOL[dtype], lse_base)
    _nontrivial(out, ro, rl)
    return out, lse


def check_basic_separate_fp32():
    # 2 x 5 x 4 = 40 rows: 3 row blocks of 16; 32 value columns: 2 chunks; 40 keys: 3 tiles
    _run(torch.float32, S=5, num_splits=2)


def check_basic_fused_fp16():
    _run(torch.float16, fused=True, S=5, num_splits=2)


def check_single_split_writes_final_output():
    _run(torch.float32, num_splits=1)
    _run(torch.float16, fused=True, num_splits=1, kv_lens=torch.tensor([0, 17]))


def check_many_splits_more_than_tiles_fp32():
    _run(torch.float32, num_splits=7, T=45)  # 3 tiles, 7 splits: empty splits
    _run(torch.float32, num_splits=3, T=100, config=_cfg(block_m=32, block_v=32))


def check_ragged_kv_lens_incl_0_and_1_fp16():
    lens = torch.tensor([0, 1, 40, 17])
    _run(torch.float16, B=4, kv_lens=lens, num_splits=2)
    _run(torch.float16, B=4, kv_lens=lens, fused=True, num_splits=1)


def check_kv_lens_int32_and_overlong_fp32():
    _run(torch.float32, kv_lens=torch.tensor([99, 3], dtype=torch.int32), num_splits=2)


def check_additive_mask_with_neg_inf_rows_fp32():
    B, S, H, T = 2, 2, 4, 33
    g = _gen()
    mask = torch.randn(B, S, H, T, generator=g)
    mask[mask < -1.0] = float("-inf")
    mask[1, 0, 2, :] = float("-inf")  # one fully masked row
    mask[0, 1, :, 16:32] = float("-inf")  # a whole key tile masked for some rows
    _run(torch.float32, B=B, S=S, H=H, T=T, mask=mask, num_splits=2)


def check_broadcast_mask_fp16():
    B, S, H, T = 2, 2, 4, 33
    mask = torch.zeros(B, 1, 1, T)  # stride 0 over S and H
    mask[:, :, :, ::3] = float("-inf")
    mask[:, :, :, 1::5] = -2.5
    _run(torch.float16, B=B, S=S, H=H, T=T, mask=mask, fused=True)


def check_shared_mask_row_fp32():
    """A mask broadcast over heads (decode causal mask): one row per request, read once per tile."""
    B, S, H, T = 3, 1, 8, 37
    mask = torch.zeros(B, 1, 1, T)
    for b in range(B):
        mask[b, ..., T - 9 * b:] = float("-inf")  # requests differ: the wrong row is caught
    mask[1, ..., ::4] = -1.5
    _run(torch.float32, B=B, S=S, H=H, T=T, mask=mask, num_splits=2)
    _run(torch.float16, B=B, S=2, H=H, T=T, mask=mask, fused=True)  # S > 1, S stride 0: shared too
    per_head = torch.zeros(B, 1, H, T)  # one token, a mask per head: not shared
    for h in range(H):
        per_head[:, :, h, h::H] = float("-inf")
    _run(torch.float32, B=B, S=1, H=H, T=T, mask=per_head)


def check_causal_c2_r1_fp32():
    B, S, T = 2, 3, 40
    q_pos = torch.tensor([[40, 45, 58], [0, 3, 7]])  # row 1: the query at 0 sees no key (k * 2 + 1 > 0)
    _run(torch.float32, B=B, S=S, T=T, q_pos=q_pos, stripe=(2, 1), num_splits=2)
    _run(torch.float16, B=B, S=S, T=T, q_pos=q_pos, stripe=(2, 1), fused=True,
         kv_lens=global_counts(torch.tensor([33, 40]), 2, 1), num_splits=1)


def check_base2_lse():
    _run(torch.float32, lse_base="2", num_splits=2)
    _run(torch.float16, lse_base="2", kv_lens=torch.tensor([0, 9]), fused=True)


def check_non_pow2_dims_and_narrow_values_fp32():
    _run(torch.float32, Dl=24, Dr=6, T=37, H=3, S=1)  # separate tail of 6
    _run(torch.float32, fused=True, Dl=24, Dr=6, T=21, H=5, S=1)  # one 30-column GEMM (masked chunks)
    _run(torch.float32, Dl=32, Dr=8, v_dim=20)


def check_non_contiguous_query_fp32():
    _run(torch.float32, q_transpose=True, S=3)


def check_entry_point_routing():
    """path='wide' and DCP_MLA_WIDE=1 reach the wide kernel; 'split' the fused one."""
    from dcp_pass.runtime.decode.call import AttentionCall
    from dcp_pass.runtime.decode.kernels.registry import KERNELS, TRITON_KERNELS, choose

    w, m = _wide(), _base()
    _run(torch.float32, via="triton", num_splits=2)
    q_lat, q_rope, kv, pe, vd = make_inputs(1, 1, 4, 32, 8, 20, torch.float32, gen=_gen())
    shape = AttentionCall(q_lat, q_rope, kv, pe, vd, 0.2).shape
    assert KERNELS["wide"].offered(shape) is not None  # CPU: never automatic
    assert choose(shape, TRITON_KERNELS).name == "split"
    assert w.WideConfig().kernels == ("wide",) and m.MLAKernelConfig(16, 16, 4, 1, 1).kernels == ("split",)
    try:
        _attend(AttentionCall(q_lat, q_rope, kv, pe, vd, 0.2), "bogus")
    except ValueError as e:
        assert "unknown attention backend 'bogus'" in str(e), str(e)
    else:
        raise AssertionError("an unknown kernel name must raise")
    old = os.environ.get("DCP_MLA_WIDE")
    try:
        os.environ["DCP_MLA_WIDE"] = "1"
        assert choose(shape, TRITON_KERNELS).name == "wide"
        os.environ["DCP_MLA_WIDE"] = "0"
        assert choose(shape, TRITON_KERNELS).name == "split"
    finally:
        if old is None:
            os.environ.pop("DCP_MLA_WIDE", None)
        else:
            os.environ["DCP_MLA_WIDE"] = old
    # the two kernels agree on the same data
    call = AttentionCall(q_lat, q_rope, kv, pe, vd, 0.2)
    ow, lw = _attend(call, "wide", num_splits=2)
    os_, ls = _attend(call, "split")
    assert rel_err(ow, os_) < 1e-5 and (lw - ls).abs().max().item() < 1e-4


def check_empty_shard_T0():
    for dtype in (torch.float32, torch.float16):
        q_lat, q_rope, kv, pe, vd = make_inputs(2, 2, 3, 32, 8, 0, dtype, gen=_gen())
        out, lse = poisoned(2, 2, 3, vd, dtype, "cpu")
        _attend(AttentionCall(q_lat, q_rope, kv, pe, vd, 0.1), "wide", out, lse)
        assert (out == 0).all() and torch.isneginf(lse).all()


def check_dcp_striping_merge_fused_fp16():
    """Stripes of one sequence in global positions (causal c=3), merged: equals the full attention."""
    g = _gen()
    c, L_list, S = 3, [45, 7, 3], 2
    B, H = len(L_list), 4
    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, 32, 8, max(L_list), torch.float16, fused=True, gen=g)
    lens = torch.tensor(L_list)
    q_pos = lens.view(B, 1) - S + torch.arange(S).view(1, S)
    full_o, full_l = ref64(AttentionCall(q_lat, q_rope, kv, pe, vd, 0.5, kv_lens=lens, q_pos=q_pos))
    outs, lses = [], []
    for r in range(c):
        kv_r = kv[:, r::c].contiguous()
        o, lse = poisoned(B, S, H, vd, torch.float16, "cpu")
        _attend(AttentionCall(q_lat, None, kv_r, None, vd, 0.5, kv_lens=lens, q_pos=q_pos, stripe=(c, r)), out=o,
                lse_out=lse, config=_cfg(), num_splits=2)
        outs.append(o)
        lses.append(lse)
    mo, ml = merge(torch.stack(outs), torch.stack(lses))
    check_close(mo, ml.float(), full_o, full_l, TOL[torch.float16])
    _nontrivial(mo, full_o, full_l)


def check_wrong_result_is_caught():
    """The comparison is sensitive: one key too few, or a wrong scale, must fail it."""
    g = _gen()
    q_lat, q_rope, kv, pe, vd = make_inputs(2, 1, 4, 32, 8, 40, torch.float32, gen=g)
    lens = torch.tensor([40, 23])
    ro, rl = ref64(AttentionCall(q_lat, q_rope, kv, pe, vd, 0.3, kv_lens=lens))
    for kw in (dict(kv_lens=lens - torch.tensor([0, 1])), dict(kv_lens=lens, scale=0.31)):
        scale = kw.pop("scale", 0.3)
        o, l_ = _attend(AttentionCall(q_lat, q_rope, kv, pe, vd, scale, **kw), config=_cfg(), num_splits=2)
        try:
            check_close(o, l_, ro, rl, TOL[torch.float32])
        except AssertionError:
            pass
        else:
            raise AssertionError(f"a wrong result passed the check ({kw}, scale={scale})")


CPU_CHECKS = interpreter.check_names(globals())


# ======================================================================================
# pytest side
# ======================================================================================
cpu_results, test_cpu_interpreter = interpreter_tests(__file__, ROOT, CPU_CHECKS)


# ---------------------------------------------------------------- GPU (real shapes, bf16)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCALE = 192 ** -0.5


def _chosen(q, kv, lens, q_pos=None, stripe=(1, 0)) -> str:
    """The kernel the "triton" backend picks for a fused-cache call."""
    from dcp_pass.runtime.decode.backends import choose_kernel

    return choose_kernel(AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens, q_pos=q_pos, stripe=stripe),
                         "triton").name


def _gpu_case(dtype, B, S, H, T, fused, lens=None, q_pos=None, stripe=(1, 0), mask=None, lse_base="e", tol=2e-2,
              num_splits=None, vs_split=True):
    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, 512, 64, T, dtype, "cuda", fused=fused, gen=_gen())
    call = AttentionCall(q_lat, q_rope, kv, pe, vd, SCALE, mask=mask, q_pos=q_pos, kv_lens=lens, stripe=stripe,
                         lse_base=lse_base)
    out, lse = poisoned(B, S, H, vd, dtype, "cuda")
    _attend(call, "wide", out, lse, **({} if num_splits is None else dict(num_splits=num_splits)))
    ro, rl = ref32(call)
    check_close(out, lse, ro, rl, tol, lse_base)
    _nontrivial(out, ro, rl)
    if vs_split:  # the fused split-KV kernel on the same data: both near the reference, near each other
        so, sl = _attend(call, "split")
        e_ws, e_sr = rel_err(out, so), rel_err(so, ro)
        assert e_ws < 2 * tol, f"wide vs split rel err {e_ws:.3e}"
        fin = ~torch.isneginf(sl)
        assert torch.equal(fin, ~torch.isneginf(lse))
        if fin.any():
            assert (lse[fin] - sl[fin]).abs().max().item() < 0.05
        print(f"wide vs ref {rel_err(out, ro):.2e}, split vs ref {e_sr:.2e}, wide vs split {e_ws:.2e}")
    return q_lat, q_rope, kv, pe, vd


@gpu
@needs_cuda
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.gpu_full
def test_gpu_wide_bf16_real_shapes(fused):
    lens = torch.tensor([4096, 1, 0, 2500], device="cuda")
    _gpu_case(torch.bfloat16, 4, 1, 128, 4096, fused, lens=lens)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.gpu_full
def test_gpu_wide_bf16_64k(num_splits):
    B, T = 2, 65536
    lens = torch.tensor([T, 40001], device="cuda")
    _gpu_case(torch.bfloat16, B, 1, 128, T, True, lens=lens, num_splits=num_splits)


@gpu
@needs_cuda
def test_gpu_wide_bf16_b8_auto_route():
    """B=8, H=128 (fp16: no Gluon): the chooser's automatic choice is the wide kernel, and it is right."""
    B, T = 8, 16384
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.float16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.float16)
    lens = torch.randint(1, T + 1, (B,), device="cuda")
    if os.environ.get("DCP_MLA_WIDE") != "0":
        assert _chosen(q, kv, lens) == "wide"
    call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens)
    o, lse = _attend(call, "triton")
    ro, rl = ref32(call)
    check_close(o, lse, ro, rl, 2e-2)
    _nontrivial(o, ro, rl)


@gpu
@needs_cuda
@pytest.mark.gpu_full
def test_gpu_causal_call_at_64_heads_routes_to_wide():
    """64 heads, B=8, fp16 (no Gluon: it takes bf16 only): plain calls measured faster on the
    split kernel, causal calls on the two-GEMM kernel (the split kernel's 64-row tile costs
    1.27x with a causal cap, path_table.CALL_COST); the dispatcher follows the kind of call,
    and the causal call it routes is right."""
    B, T, c, r = 8, 32768, 2, 1
    q = torch.randn(B, 1, 64, 576, device="cuda", dtype=torch.float16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.float16)
    glens = torch.randint(T, 2 * T + 1, (B,), device="cuda")
    q_pos = (glens - 1).view(B, 1)
    if os.environ.get("DCP_MLA_WIDE") is None:
        assert _chosen(q, kv, glens, stripe=(c, r)) == "split"
        assert _chosen(q, kv, glens, q_pos=q_pos, stripe=(c, r)) == "wide"
    call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=glens, q_pos=q_pos, stripe=(c, r))
    o, lse = _attend(call, "triton")
    ro, rl = ref32(call)
    check_close(o, lse, ro, rl, 2e-2)
    _nontrivial(o, ro, rl)


@gpu
@needs_cuda
def test_gpu_wide_fp16_base2_mask_causal_multitoken():
    B, S, H, T, c, r = 3, 2, 64, 3000, 2, 1  # 128 rows
    local = torch.tensor([3000, 1700, 9], device="cuda")
    q_pos = local.view(B, 1) * c - S + torch.arange(S, device="cuda").view(1, S)
    mask = torch.zeros(B, 1, H, c * T, device="cuda")  # over global positions: rank 1's are the odd ones
    mask[..., 1::c][..., ::7] = float("-inf")
    mask[0, :, 5, :] = float("-inf")
    _gpu_case(torch.float16, B, S, H, T, False, lens=global_counts(local, c, r), q_pos=q_pos, stripe=(c, r), mask=mask,
              lse_base="2")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.gpu_full
def test_gpu_wide_mask_128_heads(dtype, tol):
    B, T, H = 2, 1500, 128
    mask = torch.randn(B, 1, H, T, device="cuda")
    mask[mask < -1.5] = float("-inf")
    _gpu_case(dtype, B, 1, H, T, True, lens=torch.tensor([1500, 333], device="cuda"), mask=mask, tol=tol)


@gpu
@needs_cuda
@pytest.mark.gpu_full
def test_gpu_wide_cuda_graph_capture():
    B, S, H, T = 8, 1, 128, 8192
    q = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.randint(1, T, (B,), device="cuda")
    call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens)
    _attend(call, "wide")  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, l_ = _attend(call, "wide")
    for _ in range(2):  # new data and new lengths, same graph
        q.copy_(torch.randn_like(q))
        lens.copy_(torch.randint(1, T, (B,), device="cuda"))
        lens[0] = 0
        graph.replay()
        torch.cuda.synchronize()
        ro, rl = ref32(call)
        check_close(o, l_, ro, rl, 2e-2)
        _nontrivial(o, ro, rl)


if __name__ == "__main__" and "--worker" in sys.argv:
    interpreter.worker_main(globals(), ROOT)
