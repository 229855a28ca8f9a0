"""Tests of the split-KV MLA kernel (dcp_pass.runtime.decode.kernels.mla_attention) and the torch reference.

CPU part: the Triton kernels run under Triton's interpreter. TRITON_INTERPRET=1 must be
set before triton is imported, and setting it inside a shared pytest process would turn
every other module's kernels into interpreted ones, so the CPU checks run in one worker
subprocess (this file run as a script) and each pytest test reports one check's result.
Small shapes, fp32 and fp16 only (a bf16 tl.dot is wrong in the interpreter), random data
drawn fresh for every check, outputs poisoned with NaN, compared with a float64 reference.

GPU part (``-m gpu``, skipped without CUDA): real DeepSeek-V3 shapes in bf16 against the
fp32 reference, plus CUDA-graph capture.
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

from kit.kernels import TOL, check_close, gen as _gen, global_counts, interpreter_tests, make_inputs, merge, poisoned, ref32, ref64  # noqa: E402,F401,E501


def _mod():
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    return m


def _attend(call, kernel="split", out=None, lse_out=None, **options):
    """`call` on a named kernel (or, with ``config``, the kernel it configures)."""
    from dcp_pass.runtime.decode.backends import attend

    return attend(call, None if "config" in options else kernel, out, lse_out, **options)


def _reference(call):
    from dcp_pass.runtime.decode.kernels.reference import attention_reference

    return attention_reference(call)


# ======================================================================================
# CPU checks (run in the interpreter worker)
# ======================================================================================
def _run_and_compare(dtype, *, B=2, S=2, H=4, Dl=32, Dr=8, T=40, fused=False, v_dim=None, mask=None,
                     kv_lens=None, q_pos=None, stripe=(1, 0), lse_base="e", num_splits=None, q_transpose=False,
                     config=None, kernel="split"):
    g = _gen()
    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, Dl, Dr, T, dtype, fused=fused, v_dim=v_dim, gen=g)
    if q_transpose:  # non-contiguous query: stored [B, H, S, D]
        q_lat = q_lat.transpose(1, 2).contiguous().transpose(1, 2)
    scale = 0.7 / math.sqrt(q_lat.shape[-1])
    call = AttentionCall(q_lat, q_rope, kv, pe, vd, scale, mask=mask, q_pos=q_pos, kv_lens=kv_lens, stripe=stripe,
                         lse_base=lse_base)
    out, lse = poisoned(B, S, H, vd, dtype, "cpu")
    options = {k: v for k, v in (("num_splits", num_splits), ("config", config)) if v is not None}
    _attend(call, kernel, out, lse, **options)
    ro, rl = ref64(call)
    check_close(out, lse, ro, rl, TOL[dtype], lse_base)
    # the public reference (fp32) agrees too
    po, pl = _reference(call)
    check_close(po, pl, ro, rl, TOL[dtype], lse_base)


def check_basic_fp32():
    _run_and_compare(torch.float32)


def check_basic_fp16():
    _run_and_compare(torch.float16)


def check_fused_cache_fp16():
    _run_and_compare(torch.float16, fused=True, Dl=32, Dr=8)


def check_non_pow2_dims_fp32():
    _run_and_compare(torch.float32, Dl=24, Dr=6, T=37, H=3, S=1)
    _run_and_compare(torch.float32, fused=True, Dl=24, Dr=6, T=21, H=5, S=1)


def check_v_dim_narrower_than_keys_fp32():
    _run_and_compare(torch.float32, Dl=32, Dr=8, v_dim=20)


def check_single_split_and_many_splits_fp32():
    _run_and_compare(torch.float32, num_splits=1)
    _run_and_compare(torch.float32, num_splits=7, T=45)  # more splits than tiles: empty splits


def check_nan_key_in_one_split_reaches_the_merged_row_fp32():
    """A NaN key inside one request's length poisons that request's rows through the
    stage-2 merge (its split's LSE is NaN), and only that request's: NaN in, NaN out."""
    g = _gen()
    B, S, H, T = 2, 1, 4, 48
    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, 16, 8, T, torch.float32, gen=g)
    kv[0, 30, 3] = float("nan")  # request 0, in the third of five splits
    out, lse = _attend(AttentionCall(q_lat, q_rope, kv, pe, vd, 0.2), num_splits=5)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all(), "the NaN key was dropped by the merge"
    ro, rl = ref64(AttentionCall(q_lat[1:], q_rope[1:], kv[1:], pe[1:], vd, 0.2))
    check_close(out[1:], lse[1:], ro, rl, TOL[torch.float32])


def check_value_split_programs_fp32():
    """v_split=2: two programs per row block, each accumulating half of the value columns."""
    m = _mod()
    cfg = m.MLAKernelConfig(16, 16, 4, 1, 3, 2)
    _run_and_compare(torch.float32, config=cfg, kv_lens=torch.tensor([0, 29]), lse_base="2")
    _run_and_compare(torch.float32, config=cfg, fused=True, q_pos=torch.tensor([[50, 61], [3, 4]]), stripe=(2, 1))
    _run_and_compare(torch.float32, config=m.MLAKernelConfig(16, 16, 4, 1, 1, 2), Dl=32, Dr=8, v_dim=24)


def check_value_split_fp16_mask():
    m = _mod()
    mask = torch.zeros(2, 1, 4, 40)
    mask[..., 1::4] = float("-inf")
    _run_and_compare(torch.float16, config=m.MLAKernelConfig(16, 16, 4, 1, 2, 2), mask=mask)


def check_ragged_kv_lens_with_empty_rows_fp16():
    lens = torch.tensor([0, 17, 40, 5])
    _run_and_compare(torch.float16, B=4, kv_lens=lens)
    _run_and_compare(torch.float16, B=4, kv_lens=lens, num_splits=1)


def check_kv_lens_int32_and_overlong_fp32():
    _run_and_compare(torch.float32, B=2, kv_lens=torch.tensor([99, 3], dtype=torch.int32))


def _striped_lens_case(kernel):
    """Global counts with stripe=(c, r) give what the rank's own counts give.

    Counts 0, 1, c-1, c, 2c+1 and past the shard, as [B] and as one broadcast [1] count:
    the kernels take (n + c - 1 - r) // c themselves (the op passes global counts through)."""
    B, S, H, T = 4, 1, 4, 24
    for c, r in ((2, 0), (2, 1), (3, 2), (4, 1)):
        g = _gen()
        q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, 32, 8, T, torch.float32, gen=g)
        scale = 0.7 / math.sqrt(q_lat.shape[-1])
        # counts past int32 (int64 tensors) are counts past the shard, negative ones empty
        for glob in (torch.tensor([0, 1, c - 1, 2 * c + 1]), torch.tensor([c * T + 5, c, 1, 3 * c]),
                     torch.tensor([2 * c + 3]), torch.tensor([2 ** 32 + 5, 2 ** 31 - 1, 2 ** 31, -2 ** 40])):
            local = ((glob.clamp(min=0) + c - 1 - r) // c).expand(B)
            ro, rl = ref64(AttentionCall(q_lat, q_rope, kv, pe, vd, scale, kv_lens=local.contiguous()))
            call = AttentionCall(q_lat, q_rope, kv, pe, vd, scale, kv_lens=glob, stripe=(c, r))
            out, lse = _attend(call, kernel)
            check_close(out, lse, ro, rl, TOL[torch.float32])
            po, pl = _reference(call)
            check_close(po, pl, ro, rl, TOL[torch.float32])


def check_striped_global_lens_split_kernel_fp32():
    _striped_lens_case("split")


def check_striped_global_lens_wide_kernel_fp32():
    _striped_lens_case("wide")


def check_additive_mask_fp32():
    B, S, H, T = 2, 2, 4, 33
    g = _gen()
    mask = torch.randn(B, S, H, T, generator=g)
    mask[mask < -1.0] = float("-inf")
    mask[1, 0, 2, :] = float("-inf")  # one fully masked row
    _run_and_compare(torch.float32, B=B, S=S, H=H, T=T, mask=mask)


def check_broadcast_mask_fp16():
    B, S, H, T = 2, 2, 4, 33
    mask = torch.zeros(B, 1, 1, T)
    mask[:, :, :, ::3] = float("-inf")
    mask[:, :, :, 1::5] = -2.5
    _run_and_compare(torch.float16, B=B, S=S, H=H, T=T, mask=mask)


def check_shared_mask_row_decode_fp32():
    # one query token, a per-request mask broadcast over heads (a decode step's causal
    # mask): the kernel loads one mask row per tile for the whole head block; the other
    # requests' rows differ, so reading the wrong request's row is caught
    B, S, H, T = 3, 1, 8, 37
    mask = torch.zeros(B, 1, 1, T)
    for b in range(B):
        mask[b, ..., T - 9 * b:] = float("-inf")
    mask[1, ..., ::4] = -1.5
    _run_and_compare(torch.float32, B=B, S=S, H=H, T=T, mask=mask)
    m = _mod()
    assert m.smem_estimate(64, 64, 2, 512, 64, 2, True, False, True) < m.smem_estimate(64, 64, 2, 512, 64, 2, True)


def check_per_head_mask_single_token_fp16():
    # one query token but a mask that differs per head: must not take the shared-row path
    B, S, H, T = 2, 1, 4, 29
    mask = torch.zeros(B, S, H, T)
    for h in range(H):
        mask[:, :, h, h::H] = float("-inf")
    _run_and_compare(torch.float16, B=B, S=S, H=H, T=T, mask=mask)


def check_base2_lse_fp32():
    _run_and_compare(torch.float32, lse_base="2")
    _run_and_compare(torch.float32, lse_base="2", kv_lens=torch.tensor([0, 9]))


def check_empty_shard_T0():
    for dtype in (torch.float32, torch.float16):
        q_lat, q_rope, kv, pe, vd = make_inputs(2, 2, 3, 32, 8, 0, dtype, gen=_gen())
        call = AttentionCall(q_lat, q_rope, kv, pe, vd, 0.1)
        out, lse = poisoned(2, 2, 3, vd, dtype, "cpu")
        _attend(call, "split", out, lse)
        assert (out == 0).all() and torch.isneginf(lse).all()
        ro, rl = _reference(call)
        assert (ro == 0).all() and torch.isneginf(rl).all()


def check_non_contiguous_query_fp32():
    _run_and_compare(torch.float32, q_transpose=True, S=3)


def check_causal_global_positions_fp32():
    B, S, T = 2, 3, 20
    c, r = 3, 1
    q_pos = torch.tensor([[40, 45, 58], [2, 3, 7]])  # row 1: only a few keys visible
    _run_and_compare(torch.float32, B=B, S=S, T=T, q_pos=q_pos, stripe=(c, r))
    q_pos0 = torch.tensor([[0, 0, 1], [0, 5, 6]])  # rank 1 owns pos 1, 4, 7..: query at 0 sees none
    _run_and_compare(torch.float32, B=B, S=S, T=T, q_pos=q_pos0, stripe=(c, r), num_splits=1)
    # positions outside int32 (the kernels compare in int32): far ahead sees every key,
    # far behind none, and 2^31 - 1 / 2^31 sit at the clamp
    far = torch.tensor([[2 ** 40, -2 ** 40, 2 ** 31 - 1], [2 ** 31, -1, 5]])
    for kernel in ("split", "wide"):
        for stripe in ((c, r), (1, 0)):
            _run_and_compare(torch.float32, B=B, S=S, T=T, q_pos=far, stripe=stripe, kernel=kernel)


def _striping(dtype, c, L_list, S, fused, tol):
    """Split a full sequence into c stripes, attend per stripe in global positions, merge."""
    g = _gen()
    B, H, Dl, Dr = len(L_list), 4, 32, 8
    Lmax = max(L_list)
    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, Dl, Dr, Lmax, dtype, fused=fused, gen=g)
    scale = 0.5
    lens = torch.tensor(L_list)
    # the S new tokens are the last S positions of each sequence (speculative verification)
    q_pos = lens.view(B, 1) - S + torch.arange(S).view(1, S)
    full_o, full_l = ref64(AttentionCall(q_lat, q_rope, kv, pe, vd, scale, kv_lens=lens, q_pos=q_pos))
    outs, lses = [], []
    for r in range(c):
        kv_r = kv[:, r::c].contiguous()
        pe_r = pe[:, r::c].contiguous() if pe is not None else None
        lens_r = torch.div(lens - r + c - 1, c, rounding_mode="floor").clamp(min=0)  # L//c + (r < L%c)
        assert torch.equal(lens_r, lens // c + (r < lens % c).long())
        T_r = kv_r.shape[1]
        if T_r == 0:
            kv_r = kv.new_zeros(B, 0, kv.shape[-1])
        o, lse = poisoned(B, S, H, vd, dtype, "cpu")
        # the rank's caches with the global counts and positions: the kernel takes its share
        _attend(AttentionCall(q_lat, q_rope, kv_r, pe_r, vd, scale, kv_lens=lens, q_pos=q_pos, stripe=(c, r)),
                "split", o, lse)
        assert torch.isfinite(o).all()
        outs.append(o)
        lses.append(lse)
    mo, ml = merge(torch.stack(outs), torch.stack(lses))
    check_close(mo, ml.float(), full_o, full_l, tol)


def check_dcp_striping_merge_fp32():
    _striping(torch.float32, 3, [31, 26, 2], S=3, fused=False, tol=TOL[torch.float32])


def check_dcp_striping_merge_fused_fp16():
    _striping(torch.float16, 4, [45, 7, 3], S=2, fused=True, tol=TOL[torch.float16])


def _paged(dtype, fused, P, lens_list, mask=False, causal=False):
    from dcp_pass.runtime.decode.kernels.reference import gather_pages

    g = _gen()
    B, S, H, Dl, Dr = len(lens_list), 2, 4, 32, 8
    max_pages = max(1, -(-max(lens_list) // P))
    num_pages = B * max_pages + 3
    q_lat, q_rope, kv_all, pe_all, vd = make_inputs(B, S, H, Dl, Dr, num_pages * P, dtype, fused=fused, gen=g)
    pool = kv_all[0].reshape(num_pages, P, -1)  # batch row 0 of the draw serves as the pool
    pe_pool = pe_all[0].reshape(num_pages, P, -1) if pe_all is not None else None
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.full((B, max_pages), -1, dtype=torch.int32)
    k = 0
    for b in range(B):
        for j in range(-(-lens_list[b] // P)):
            page_table[b, j] = perm[k]
            k += 1
    lens = torch.tensor(lens_list)  # each row's local keys
    scale = 0.3
    T = max_pages * P
    msk = None
    if mask:
        msk = torch.randn(B, S, H, T, generator=g)
        msk[msk < -1.2] = float("-inf")
    extra = dict(kv_lens=lens)
    if causal:  # rank 1 of 2: global counts and positions
        extra = dict(kv_lens=global_counts(lens, 2, 1), q_pos=lens.view(B, 1) * 2 - S + torch.arange(S).view(1, S),
                     stripe=(2, 1))
        if mask:  # the call's mask is over global positions: the rank's columns are every other one from 1
            wide = torch.zeros(B, S, H, 2 * T)
            wide[..., 1::2] = msk
            msk = wide
    paged = AttentionCall(q_lat, q_rope, pool, pe_pool, vd, scale, mask=msk, page_table=page_table, **extra)
    out, lse = poisoned(B, S, H, vd, dtype, "cpu")
    _attend(paged, "split", out, lse)
    # contiguous copy of each row's pages, through the float64 reference
    kv_c = gather_pages(pool, page_table)
    pe_c = gather_pages(pe_pool, page_table) if pe_pool is not None else None
    dense = paged.replace(kv=kv_c, pe=pe_c, page_table=None)
    ro, rl = ref64(dense)
    check_close(out, lse, ro, rl, TOL[dtype])
    po, pl = _reference(paged)
    check_close(po, pl, ro, rl, TOL[dtype])
    # and the contiguous Triton path on the same data agrees with the paged one
    co, cl = _attend(dense)
    check_close(co, cl, ro, rl, TOL[dtype])


def check_paged_vs_contiguous_fp32():
    _paged(torch.float32, False, 8, [19, 0, 33])


def check_paged_fused_mask_causal_fp16():
    _paged(torch.float16, True, 16, [40, 5], mask=True, causal=True)


def check_dispatcher_cpu_uses_reference():
    from dcp_pass.runtime.decode.backends import attend

    q_lat, q_rope, kv, pe, vd = make_inputs(1, 1, 2, 32, 8, 9, torch.float32, gen=_gen())
    call = AttentionCall(q_lat, q_rope, kv, pe, vd, 0.2)
    o, l = attend(call, "triton", strict=False)
    ro, rl = _reference(call)
    assert torch.equal(o, ro) and torch.equal(l, rl)


def check_bad_arguments():
    q_lat, q_rope, kv, pe, vd = make_inputs(1, 1, 2, 32, 8, 9, torch.float32, gen=_gen())
    for run in (_reference, _attend):
        for args in ((q_lat, q_rope, kv, None, vd, 0.1), (q_lat, None, kv, pe, vd, 0.1)):
            try:
                run(AttentionCall(*args))
            except ValueError:
                pass
            else:
                raise AssertionError("mismatched rope operands must raise ValueError")
    try:
        AttentionCall(q_lat, q_rope, kv, pe, vd, 0.1, lse_base="10")
    except ValueError:
        pass
    else:
        raise AssertionError("bad lse_base must raise")


def check_bf16_in_interpreter_raises():
    """bf16 on CPU must fail loudly: the interpreter's bf16 tl.dot gives values ~1e9."""
    q_lat, q_rope, kv, pe, vd = make_inputs(1, 1, 16, 32, 16, 9, torch.bfloat16, gen=_gen())
    for kernel in ("split", "wide"):
        try:
            _attend(AttentionCall(q_lat, q_rope, kv, pe, vd, 0.2), kernel)
        except ValueError as e:
            assert "interpreter" in str(e) and "float32 or float16" in str(e), str(e)
        else:
            raise AssertionError(f"{kernel}: bf16 under the interpreter must raise")


CPU_CHECKS = interpreter.check_names(globals())


# ======================================================================================
# pytest side
# ======================================================================================
cpu_results, test_cpu_interpreter = interpreter_tests(__file__, ROOT, CPU_CHECKS)


# ---------------------------------------------------------------- GPU (real shapes, bf16)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DSV3 = dict(Dl=512, Dr=64, scale=192 ** -0.5)


def _gpu_case(dtype, B, S, H, T, fused, lens=None, q_pos=None, stripe=(1, 0), mask=None, lse_base="e", tol=2e-2):
    q_lat, q_rope, kv, pe, vd = make_inputs(B, S, H, DSV3["Dl"], DSV3["Dr"], T, dtype, "cuda", fused=fused, gen=_gen())
    call = AttentionCall(q_lat, q_rope, kv, pe, vd, DSV3["scale"], mask=mask, q_pos=q_pos, kv_lens=lens, stripe=stripe,
                         lse_base=lse_base)
    out, lse = poisoned(B, S, H, vd, dtype, "cuda")
    # the fused split-KV kernel at every head count (the chooser would send 128 heads to
    # the two-GEMM or a Gluon kernel, which their own test files cover)
    _attend(call, "split", out, lse)
    ro, rl = ref32(call)
    check_close(out, lse, ro, rl, tol, lse_base)
    return q_lat, q_rope, kv, pe, vd


@gpu
@needs_cuda
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.gpu_full
def test_gpu_bf16_real_shapes(H, fused):
    lens = torch.tensor([4096, 1, 0, 2500], device="cuda")
    _gpu_case(torch.bfloat16, 4, 1, H, 4096, fused, lens=lens)


@gpu
@needs_cuda
def test_gpu_fp16_base2_mask_causal_multitoken():
    B, S, H, T, c, r = 3, 4, 16, 3000, 2, 1
    local = torch.tensor([3000, 1700, 9], device="cuda")
    q_pos = (local.view(B, 1) * c - S + torch.arange(S, device="cuda").view(1, S))
    mask = torch.zeros(B, 1, 1, c * T, device="cuda")  # over global positions: rank 1's are the odd ones
    mask[..., 1::c][..., ::7] = float("-inf")
    _gpu_case(torch.float16, B, S, H, T, True, lens=global_counts(local, c, r), q_pos=q_pos, stripe=(c, r), mask=mask,
              lse_base="2")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.gpu_full
def test_gpu_mask_128_heads_fits_shared_memory(dtype, tol):
    """A pipelined mask (and fp32 tiles) must shrink the tuned tile to fit shared memory."""
    B, T, H = 2, 1500, 128
    mask = torch.randn(B, 1, H, T, device="cuda")
    mask[mask < -1.5] = float("-inf")
    _gpu_case(dtype, B, 1, H, T, True, lens=torch.tensor([1500, 333], device="cuda"), mask=mask, tol=tol)


@gpu
@needs_cuda
def test_gpu_paged_bf16():
    from dcp_pass.runtime.decode.kernels.reference import gather_pages

    B, S, H, P = 4, 1, 128, 64
    lens_l = [5000, 64, 0, 777]
    max_pages = -(-max(lens_l) // P)
    num_pages = B * max_pages
    pool = torch.randn(num_pages, P, 576, device="cuda", dtype=torch.bfloat16)
    pt = torch.randperm(num_pages, device="cuda").view(B, max_pages).to(torch.int32)
    q = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(lens_l, device="cuda")
    out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
    call = AttentionCall(q, None, pool, None, 512, DSV3["scale"], kv_lens=lens, page_table=pt)
    _attend(call, "split", out, lse)
    ro, rl = ref32(call.replace(kv=gather_pages(pool, pt), page_table=None))
    check_close(out, lse, ro, rl, 2e-2)


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    B, S, H, T = 8, 1, 128, 8192
    q = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.randint(1, T, (B,), device="cuda")
    call = AttentionCall(q, None, kv, None, 512, DSV3["scale"], kv_lens=lens)
    _attend(call, "split")  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, l = _attend(call, "split")
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.randint(1, T, (B,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ro, rl = ref32(call)
    check_close(o, l, ro, rl, 2e-2)


if __name__ == "__main__" and "--worker" in sys.argv:
    interpreter.worker_main(globals(), ROOT)
