"""The fp8 latent cache in the attention kernels: the torch reference, the split-KV and the two-GEMM
Triton kernels read float8_e4m3fn latent rows with one fp32 scale per 128 columns (AttentionCall.kv_scale).

Both are compared with the float64 reference of the dequantised cache (every fp8 value times
its scale, exact in float64), under each fp8 read (DCP_FP8_READ): they agree to fp32 rounding
(fp16 queries: to fp16 rounding of P, or of the dequantised tile for the ``dequant`` read).
Dense and paged caches, masks, causal caps, striped device counts, split counts and the
two-program value split; NaN in a cache row reaches exactly the rows that see it. The ``fold``
read is at least as exact as ``dequant`` (fp16 queries: LSE error ~1e-5 against ~1e-2), and
takes bf16 queries of any magnitude into its fp16 dots.

CPU part: the Triton checks run under Triton's interpreter in one worker subprocess (this file
run as a script), as in test_kernel_mla.py. GPU part (``-m gpu``, skipped without CUDA):
DeepSeek-V3 shapes in bf16 against the fp32 reference of the dequantised cache.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from dcp_pass import env
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.testing import interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from kit.kernels import (TOL, check_close, fp8_call, gen as _gen, global_counts, interpreter_tests, poisoned,  # noqa: E402
                         ref32, ref64, rel_err)

from dcp_pass.runtime.decode.kernels.common import FP8_READS  # noqa: E402  (the kernels' fp8 reads)


def _attend(call, kernel, out=None, lse_out=None, **options):
    from dcp_pass.runtime.decode.backends import attend

    return attend(call, kernel if "config" not in options else None, out, lse_out, **options)


def _compare(call, kernel, dtype, **options):
    B, S, H, _ = call.q_lat.shape
    out, lse = poisoned(B, S, H, call.v_dim, dtype, call.q_lat.device)
    _attend(call, kernel, out, lse, **options)
    ro, rl = ref64(call)
    check_close(out, lse, ro, rl, TOL[dtype], call.lse_base)


def _paged(call: AttentionCall, P: int, g) -> AttentionCall:
    """`call`'s dense caches as shuffled pages of P rows (kv, scales and rope alike)."""
    B, T = call.kv.shape[:2]
    pages = -(-T // P)
    perm = torch.randperm(B * pages, generator=g)
    table = perm.view(B, pages).to(torch.int32)

    def pool(t):
        padded = torch.nn.functional.pad(t.float(), (0, 0, 0, pages * P - T)).to(t.dtype) if pages * P != T else t
        out = torch.empty(B * pages, P, t.shape[-1], dtype=t.dtype)
        out[perm] = padded.reshape(B * pages, P, t.shape[-1])
        return out

    return call.replace(kv=pool(call.kv), kv_scale=pool(call.kv_scale), pe=pool(call.pe), page_table=table)


# ======================================================================================
# CPU checks of the split kernel (run in the interpreter worker)
# ======================================================================================
def _cases(dtype):
    g = _gen()
    B, S, H, Dl, Dr, T = 2, 1, 4, 160, 8, 37  # 160 latent columns: one whole and one partial scale block
    yield fp8_call(B, S, H, Dl, Dr, T, dtype, gen=g)
    yield fp8_call(B, S, H, Dl, Dr, T, dtype, gen=g, kv_lens=global_counts(torch.tensor([37, 5]), 2, 1),
                   stripe=(2, 1))
    mask = torch.zeros(B, 1, 1, 2 * T)
    mask[..., ::5] = float("-inf")
    yield fp8_call(B, S, H, Dl, Dr, T, dtype, gen=g, mask=mask, kv_lens=2 * T, stripe=(2, 0), lse_base="2")
    q_pos = torch.tensor([[40, 41, 42], [3, 4, 5]])
    yield fp8_call(B, 3, H, Dl, Dr, T, dtype, gen=g, q_pos=q_pos, stripe=(2, 0))




def _errors(call, kernel):
    """(output rel err, largest LSE abs err) against the float64 reference of the dequantised cache."""
    out, lse = _attend(call, kernel)
    ro, rl = ref64(call)
    seen = torch.isfinite(rl)
    return rel_err(out, ro), (lse.double()[seen] - rl[seen]).abs().max().item()


def check_split_fp32_matches_dequantised_f64():
    for read in FP8_READS:
        with env.overridden("DCP_FP8_READ", read):
            for call in _cases(torch.float32):
                _compare(call, "split", torch.float32)
                _compare(call, "split", torch.float32, num_splits=3)


def check_split_fp16_matches_dequantised_f64():
    for read in FP8_READS:
        with env.overridden("DCP_FP8_READ", read):
            for call in _cases(torch.float16):
                _compare(call, "split", torch.float16)


def check_wide_fp32_and_fp16_match_dequantised_f64():
    for read in FP8_READS:
        with env.overridden("DCP_FP8_READ", read):
            for dtype in (torch.float32, torch.float16):
                for call in _cases(dtype):
                    _compare(call, "wide", dtype)
            g = _gen()  # 256 value columns: two value chunks, each inside one scale block
            _compare(fp8_call(2, 1, 4, 256, 8, 50, torch.float32, gen=g, kv_lens=torch.tensor([50, 9])), "wide",
                     torch.float32, num_splits=2)


def check_fold_is_at_least_as_exact_as_dequant():
    """fp16 queries, rows spanning four decades: the fold read (fp8 values exact in the dots,
    the scales on scores and P) against the dequantising read (every value times its scale,
    rounded to fp16), both against float64."""
    g = _gen()
    for kernel in ("split", "wide"):
        call = fp8_call(2, 1, 16, 256, 16, 96, torch.float16, gen=g, kv_lens=torch.tensor([96, 40]))
        with env.overridden("DCP_FP8_READ", "dequant"):
            deq_out, deq_lse = _errors(call, kernel)
        for read in ("fold", "fold_once"):
            with env.overridden("DCP_FP8_READ", read):
                fold_out, fold_lse = _errors(call, kernel)
            # the outputs of both reads are stored in fp16: below its rounding (2^-11 of the largest
            # output) the two errors are the output's rounding, not the read's, and either may be
            # the larger on a given draw (fresh data each run); the LSE, kept in fp32, tells them apart
            assert fold_out <= max(deq_out * 1.05, 2.0 ** -11) and fold_lse <= deq_lse, (
                kernel, read, fold_out, deq_out, fold_lse, deq_lse)
            assert fold_lse < 1e-4, (kernel, read, fold_lse)


def check_unset_read_is_each_kernels_default():
    """With DCP_FP8_READ unset the split kernel launches its fold read and the two-GEMM kernel
    its dequantising read (the faster read of each on the H200); set, it wins for both."""
    from dcp_pass.runtime.decode.kernels import common, mla_attention, mla_wide

    call = fp8_call(2, 1, 16, 256, 16, 40, torch.float32, gen=_gen(), kv_lens=torch.tensor([40, 9]))

    def folds(module):
        with common.recording_launches() as launches:
            module.run(call)
        return {bool(options.get("FP8_FOLD")) for _, _, _, _, options in launches if "FP8_FOLD" in options}

    with env.overridden("DCP_FP8_READ", None):
        assert folds(mla_attention) == {True}, folds(mla_attention)
        assert folds(mla_wide) == {False}, folds(mla_wide)
    with env.overridden("DCP_FP8_READ", "fold"):
        assert True in folds(mla_wide)
    with env.overridden("DCP_FP8_READ", "dequant"):
        assert folds(mla_attention) == {False}


def check_bf16_queries_fold_into_fp16_range():
    """bf16 queries of any magnitude (1e-6 to 1e6: past fp16's range either way) read an fp8
    latent through the fold read's fp16 dots: each query row and block is divided by a power
    of two into fp16's range. Without rope columns every dot runs in fp16, so the interpreter
    runs it (its bf16 dot is wrong); the output is bf16 (2^-9 rounding)."""
    from dcp_pass.runtime.decode.kernels import mla_attention, mla_wide

    g = _gen()
    base = fp8_call(2, 1, 16, 256, 0, 96, torch.float32, gen=g, kv_lens=torch.tensor([96, 40]))
    for read, magnitude in ((r, m) for r in ("fold", "fold_once") for m in (1e-6, 1.0, 1e6)):
        with env.overridden("DCP_FP8_READ", read):
            call = AttentionCall((base.q_lat * magnitude).bfloat16(), None, base.kv, None, 256,
                                 0.5 / (256 ** 0.5 * magnitude), kv_lens=base.kv_lens, kv_scale=base.kv_scale)
            ro, rl = ref64(call)
            for module in (mla_attention, mla_wide):
                out, lse = module.run(call)
                check_close(out.float(), lse, ro, rl, 1e-2)
                assert (lse.double() - rl).abs().max().item() < 1e-4, (module.__name__, read, magnitude)


def check_split_value_split_and_paged():
    from dcp_pass.runtime.decode.kernels.mla_attention import MLAKernelConfig

    g = _gen()
    call = fp8_call(2, 1, 4, 256, 8, 50, torch.float32, gen=g, kv_lens=torch.tensor([50, 9]))
    # two programs per row block, each accumulating half of the value columns
    _compare(call, None, torch.float32, config=MLAKernelConfig(16, 16, 4, 1, 2, v_split=2))
    _compare(_paged(call, 16, g), "split", torch.float32)


def check_split_nan_reaches_the_rows_that_see_it():
    g = _gen()
    call = fp8_call(2, 1, 4, 128, 8, 20, torch.float32, gen=g, kv_lens=torch.tensor([20, 20]))
    kv_scale = call.kv_scale.clone()
    kv_scale[0, 7, 0] = float("nan")  # request 0, one key row
    call = call.replace(kv_scale=kv_scale)
    out, lse = _attend(call, "split")
    assert torch.isnan(out[0]).all(), "request 0 sees the NaN row: every output is NaN"
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all(), "request 1 does not see it"


def check_packed_rows_through_the_op():
    """The op's packed fp8 rows (fused: latent, scales and rope in one row) equal the call on their views."""
    from dcp_pass.runtime.decode import ops  # noqa: F401  (registers torch.ops.dcp.*)
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, pack

    g = _gen()
    B, H, Dl, Dr, T = 2, 4, 128, 8, 30
    layout = Fp8Layout(Dl, Dr, torch.float32)
    values = torch.randn(B, T, Dl + Dr, generator=g)
    packed = pack(values, layout)
    q = torch.randn(B, 1, H, Dl + Dr, generator=g)
    lens = torch.tensor([30 * 2, 11], dtype=torch.long)
    for backend in ("split", "torch"):
        out, lse = torch.ops.dcp.mla_local_attention(q, None, packed, None, 0, 2, 1, Dl, 0.1, None, "e", backend,
                                                     kv_lens=lens, kv_format=layout.spec())
        from dcp_pass.runtime.decode.kv_format import views

        lat, sc, rope = views(packed, layout)
        ro, rl = ref64(AttentionCall(q[..., :Dl], q[..., Dl:], lat, rope, Dl, 0.1, kv_lens=lens, stripe=(2, 1),
                                     kv_scale=sc))
        check_close(out, lse, ro, rl, TOL[torch.float32])


CPU_CHECKS = interpreter.check_names(globals())


# ======================================================================================
# pytest side: the reference (no Triton), the worker's results
# ======================================================================================
@pytest.mark.parametrize("case", range(4))
def test_reference_matches_dequantised_f64(case):
    from dcp_pass.runtime.decode.kernels.reference import attention_reference

    call = list(_cases(torch.float32))[case]
    out, lse = attention_reference(call)
    ro, rl = ref64(call)
    check_close(out, lse, ro, rl, TOL[torch.float32], call.lse_base)


def test_reference_paged_and_bf16_queries():
    from dcp_pass.runtime.decode.kernels.reference import attention_reference

    g = _gen()
    call = fp8_call(2, 1, 4, 160, 8, 40, torch.float32, gen=g, kv_lens=torch.tensor([40, 3]))
    out, lse = attention_reference(_paged(call, 16, g))
    ro, rl = ref64(call)
    check_close(out, lse, ro, rl, TOL[torch.float32])
    bf = call.replace(q_lat=call.q_lat.bfloat16(), q_rope=call.q_rope.bfloat16(), pe=call.pe.bfloat16())
    out, lse = attention_reference(bf)
    check_close(out.float(), lse, *ref64(bf), 1e-2)


def test_reference_nan_in_nan_out():
    from dcp_pass.runtime.decode.kernels.reference import attention_reference

    call = fp8_call(2, 1, 4, 128, 8, 20, torch.float32, gen=_gen())
    kv = call.kv.clone()
    kv[1, 3, 5] = float("nan")
    out, _ = attention_reference(call.replace(kv=kv))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_fp8_operands_are_checked():
    call = fp8_call(1, 1, 2, 128, 8, 4, torch.float32, gen=_gen())
    with pytest.raises(ValueError, match="one scale per 128 columns"):
        call.replace(kv_scale=call.kv_scale[..., :0])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        call.replace(kv=call.kv.float())


def test_which_kernels_take_fp8():
    """The chooser sees an fp8 call's format: the bf16 Gluon kernels give a reason, the split
    and two-GEMM kernels take it, and between those two the chooser goes by their timings on
    fp8 rows (the two-GEMM kernel at 128 heads, the split kernel at 16)."""
    from dcp_pass.runtime.decode.call import CallShape
    from dcp_pass.runtime.decode.kernels.registry import KERNELS, TRITON_KERNELS, choose

    shape = CallShape(dtype=torch.float8_e4m3fn, query_dtype=torch.bfloat16, same_dtypes=True, kv_quant="fp8_e4m3",
                      batch=8, heads=128, keys=32768, fused=False)
    if KERNELS["split"].supports(shape) is not None:
        pytest.skip(f"no Triton here: {KERNELS['split'].supports(shape)}")
    for name in ("gluon_roles", "gluon_lock_step"):
        reason = KERNELS[name].supports(shape)
        assert reason is not None and "fp8" in reason, (name, reason)
    for name in ("split", "wide", "torch"):
        assert KERNELS[name].supports(shape) is None, name
    assert choose(shape, ("wide", "split")).name == "wide"
    narrow = CallShape(dtype=torch.float8_e4m3fn, query_dtype=torch.bfloat16, kv_quant="fp8_e4m3", batch=8, heads=16,
                       keys=32768, fused=False)
    assert choose(narrow, ("wide", "split")).name == "split"
    unscaled = CallShape(dtype=torch.float8_e4m3fn, same_dtypes=False, fused=False)
    assert "float16, bfloat16 or float32" in KERNELS["split"].supports(unscaled)


cpu_results, test_cpu_interpreter = interpreter_tests(__file__, ROOT, CPU_CHECKS)


# ---------------------------------------------------------------- GPU (real shapes, bf16)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("read", FP8_READS)
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.gpu_full
def test_gpu_fp8_real_shapes(H, paged, read, monkeypatch):
    """DeepSeek-V3 shapes, bf16 queries and rope, each fp8 read: the split and two-GEMM kernels
    against the fp32 reference of the dequantised cache (a dequantising read rounds the
    dequantised values to bf16, a fold read keeps them exact and rounds P). Rows
    span one decade of magnitude: at four, scores reach ~300 and bf16's relative rounding alone
    moves the LSE by ~0.8, which an absolute LSE bound cannot tell from a wrong kernel."""
    monkeypatch.setenv("DCP_FP8_READ", read)
    g = _gen()
    lens = torch.tensor([4096, 1, 0, 2500], device="cuda")
    call = fp8_call(4, 1, H, 512, 64, 4096, torch.bfloat16, "cuda", gen=g, kv_lens=lens, scale=192 ** -0.5,
                    spread=1.0)
    if paged:
        call = _paged(call.replace(q_lat=call.q_lat.cpu(), q_rope=call.q_rope.cpu(), kv=call.kv.cpu(),
                                   pe=call.pe.cpu(), kv_scale=call.kv_scale.cpu(), kv_lens=lens.cpu()), 64, g)
        call = call.replace(q_lat=call.q_lat.cuda(), q_rope=call.q_rope.cuda(), kv=call.kv.cuda(), pe=call.pe.cuda(),
                            kv_scale=call.kv_scale.cuda(), page_table=call.page_table.cuda(), kv_lens=lens)
    from dcp_pass.runtime.decode.backends import choose_kernel

    ro, rl = ref32(call)
    # auto's choice (on a Hopper with Triton 3.6 one of the Gluon fp8 kernels for the unpaged
    # call, by the path table) is a kernel, not the reference, and runs this call as well
    chosen = choose_kernel(call, "auto").name
    assert chosen != "torch", chosen
    for kernel in dict.fromkeys((("split",) if paged else ("split", "wide")) + (chosen,)):  # (each once)
        out, lse = poisoned(4, 1, H, 512, torch.bfloat16, "cuda")
        _attend(call, kernel, out, lse)
        check_close(out, lse, ro, rl, 2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.gpu_full
def test_gpu_fold_at_least_as_exact_as_dequant(H, monkeypatch):
    """bf16 queries on the GPU: the fold read (fp8 values and queries unrounded in fp16 dots,
    P rounded to fp16) against the dequantising read (every value times its scale rounded to
    bf16), both against the fp32 reference of the dequantised cache, on the kernel "auto" picks."""
    g = _gen()
    lens = torch.tensor([4096, 3000], device="cuda")
    call = fp8_call(2, 1, H, 512, 64, 4096, torch.bfloat16, "cuda", gen=g, kv_lens=lens, scale=192 ** -0.5,
                    spread=1.0)
    ro, rl = ref32(call)
    errors = {}
    for read in ("fold", "fold_once", "dequant"):
        monkeypatch.setenv("DCP_FP8_READ", read)
        out, lse = _attend(call, "auto")
        errors[read] = (rel_err(out, ro), (lse - rl).abs().max().item())
    # (the outputs' own bf16 rounding is most of both output errors: a margin for its noise)
    for read in ("fold", "fold_once"):
        assert errors[read][0] <= errors["dequant"][0] * 1.1 and errors[read][1] <= errors["dequant"][1], errors


@gpu
@needs_cuda
def test_gpu_fp8_cuda_graph_capture():
    g = _gen()
    lens = torch.randint(1, 8192, (8,), device="cuda")
    call = fp8_call(8, 1, 128, 512, 64, 8192, torch.bfloat16, "cuda", gen=g, kv_lens=lens, scale=192 ** -0.5,
                    spread=1.0)
    _attend(call, "split")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, l = _attend(call, "split")
    call.q_lat.copy_(torch.randn_like(call.q_lat))
    lens.copy_(torch.randint(1, 8192, (8,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    check_close(o, l, *ref32(call), 2e-2)


if __name__ == "__main__" and "--worker" in sys.argv:
    interpreter.worker_main(globals(), ROOT)
