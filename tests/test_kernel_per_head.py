"""Tests of the per-head split-KV kernel (dcp_pass.runtime.decode.kernels.per_head_attention).

CPU part: the kernel runs under Triton's interpreter in one worker subprocess (this file run
as a script, TRITON_INTERPRET=1 set before triton's import; see tests/test_kernel_mla.py),
each pytest test reporting one check's result. Small shapes, fp32 and fp16 (a bf16 tl.dot is
wrong in the interpreter), fresh random data for every check, outputs poisoned with NaN,
compared with the float64 reference of the same call.

GPU part (``-m gpu``, skipped without CUDA): a Llama-8B-shaped layer and the other head dims
in bf16 against the fp32 reference, CUDA-graph capture and replay, and the op inside
torch.compile.
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

from kit.kernels import TOL, check_close, gen as _gen, global_counts, interpreter_tests, merge, poisoned, ref32, ref64  # noqa: E402,E501


def _attend(call, out=None, lse_out=None, **options):
    from dcp_pass.runtime.decode.backends import attend

    return attend(call, "per_head", out, lse_out, **options)


def _operands(B, S, H, Hk, D, Dv, T, dtype, device="cpu", hf_layout=False, gen=None):
    """Random q [B, S, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv]; ``hf_layout``: k and v stored
    [B, Hk, T, D] (Hugging Face's cache) and read through a transposed view."""
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)  # noqa: E731
    q = rnd(B, S, H, D)
    if hf_layout:
        return q, rnd(B, Hk, T, D).transpose(1, 2), rnd(B, Hk, T, Dv).transpose(1, 2)
    return q, rnd(B, T, Hk, D), rnd(B, T, Hk, Dv)


def _case(dtype, *, B=2, S=1, H=8, Hk=2, D=16, Dv=16, T=40, lse_base="e", num_splits=None, config=None,
          hf_layout=False, **call_kw):
    g = _gen()
    q, k, v = _operands(B, S, H, Hk, D, Dv, T, dtype, hf_layout=hf_layout, gen=g)
    call = AttentionCall(q, None, k, None, Dv, 0.8 / math.sqrt(D), v=v, lse_base=lse_base, **call_kw)
    out, lse = poisoned(B, S, H, Dv, dtype, "cpu")
    options = {k: v for k, v in (("num_splits", num_splits), ("config", config)) if v is not None}
    _attend(call, out, lse, **options)
    ro, rl = ref64(call)
    check_close(out, lse, ro, rl, TOL[dtype], lse_base)
    return call, out, lse


# ======================================================================================
# CPU checks (run in the interpreter worker)
# ======================================================================================
def check_gqa_ratios_ragged_counts_fp32():
    """Query heads per kv head 1, 4 and 8; device counts 0, 1 and ragged; one and several splits."""
    for H, Hk in ((4, 4), (8, 2), (8, 1)):
        lens = torch.tensor([0, 1, 29])
        _case(torch.float32, B=3, H=H, Hk=Hk, kv_lens=lens)
        _case(torch.float32, B=3, H=H, Hk=Hk, kv_lens=lens, num_splits=5, lse_base="2")
        _case(torch.float32, B=3, H=H, Hk=Hk, kv_lens=lens, num_splits=1)


def check_gqa_fp16_host_count_and_no_count():
    _case(torch.float16, H=8, Hk=2, kv_lens=33)
    _case(torch.float16, H=8, Hk=8, T=24)
    _case(torch.float16, H=16, Hk=2, S=2, kv_lens=torch.tensor([1, 40]))


def check_head_dims_fp32():
    """Head dims 64, 128 (values 128, 256) and 192 (values 128): columns past a power of two
    are masked; Hugging Face's [B, Hk, T, D] cache read through a transposed view."""
    for D, Dv in ((64, 64), (192, 128), (128, 256)):
        _case(torch.float32, B=2, H=4, Hk=1, D=D, Dv=Dv, T=20, kv_lens=torch.tensor([17, 3]), hf_layout=True)


def check_row_blocks_fp32():
    """More rows per kv head than one block holds (S x group > 16 in the interpreter's tiles
    when block rows are capped): several row blocks read one head's tiles."""
    from dcp_pass.runtime.decode.kernels.per_head_attention import PerHeadConfig

    _case(torch.float32, B=2, S=5, H=8, Hk=1, T=30, kv_lens=torch.tensor([30, 7]),
          config=PerHeadConfig(16, 16, 4, 1, 2))


def _striped(dtype, c, glens, *, S=1, H=8, Hk=2, D=16, Dv=16, mask=None, q_pos=None, kv_start=0, host=False):
    """Each rank's call over its stripe of one cache, merged exactly: equals the unsplit
    reference of the whole cache (and each rank's partial equals its own reference)."""
    g = _gen()
    B = len(glens)
    T = max(glens)
    T_loc = -(-T // c)
    q, k, v = _operands(B, S, H, Hk, D, Dv, T_loc * c, dtype, gen=g)
    scale = 0.5 / math.sqrt(D)
    outs, lses = [], []
    for r in range(c):
        if host:
            lens = int(glens[0])
        else:
            lens = torch.tensor(glens)
        call = AttentionCall(q, None, k[:, r::c], None, Dv, scale, v=v[:, r::c], kv_lens=lens, stripe=(c, r),
                             mask=mask, q_pos=q_pos, kv_start=kv_start)
        out, lse = poisoned(B, S, H, Dv, dtype, "cpu")
        _attend(call, out, lse)
        ro, rl = ref64(call)
        check_close(out, lse, ro, rl, TOL[dtype])
        outs.append(out.double())
        lses.append(lse.double())
    mo, ml = merge(torch.stack(outs), torch.stack(lses))
    full = AttentionCall(q, None, k, None, Dv, scale, v=v, kv_lens=int(glens[0]) if host else torch.tensor(glens),
                         mask=mask, q_pos=q_pos, kv_start=kv_start)
    fo, fl = ref64(full)
    check_close(mo.to(dtype), ml.float(), fo, fl, TOL[dtype])


def check_stripes_merge_to_the_whole_fp32():
    _striped(torch.float32, 2, [37, 1, 0])
    _striped(torch.float32, 3, [41, 2, 5], H=4, Hk=4)


def check_windows_fp32():
    """A window start (kv_start) with a host count and with device counts (the view starts
    rows in, and the kernel takes the rank's share of the global count past them)."""
    _case(torch.float32, kv_lens=35, kv_start=9, stripe=(2, 1))
    _case(torch.float32, kv_lens=torch.tensor([35, 12]), kv_start=9, stripe=(2, 1))
    _case(torch.float32, kv_lens=torch.tensor([35, 3]), kv_start=9, stripe=(3, 0))  # request 1 before the window
    _striped(torch.float32, 2, [30, 30], kv_start=11, host=True)
    _striped(torch.float32, 2, [30, 21], kv_start=11)


def check_masks_fp32():
    """An additive mask over global key positions: per head and token (with -inf entries and a
    fully masked row), and one row per request (a decode step's)."""
    g = _gen()
    B, S, H, T = 2, 2, 8, 36
    full = torch.randn(B, S, H, T, generator=g)
    full[full < -1.0] = float("-inf")
    full[1, 0, 3] = float("-inf")  # a row with no visible key: 0 and -inf
    _case(torch.float32, B=B, S=S, H=H, T=T, kv_lens=T, mask=full)
    row = torch.randn(B, 1, 1, 2 * T, generator=g)
    row[..., ::5] = float("-inf")
    _case(torch.float32, B=B, S=1, H=H, T=T, kv_lens=torch.tensor([2 * T, T + 3]), stripe=(2, 1), mask=row)
    _striped(torch.float32, 2, [2 * T - 1, 2 * T - 1], mask=row[..., :2 * T - 1], host=True)


def check_bool_masks_fp32():
    """A boolean keep mask (True: visible), read in place as bytes: per head and token with a
    fully masked row, one row per request striped over two ranks, and causal plus a padding
    row (a padded prefill's form); each equals the additive mask of the same pattern."""
    g = _gen()
    B, S, H, T = 2, 3, 8, 36
    keep = torch.rand(B, S, H, T, generator=g) > 0.3
    keep[1, 0, 3] = False  # no visible key: 0 and -inf
    call, out, lse = _case(torch.float32, B=B, S=S, H=H, T=T, kv_lens=T, mask=keep)
    additive = torch.where(keep, 0.0, float("-inf"))
    ro, rl = ref64(call.replace(mask=additive))
    check_close(out, lse, ro, rl, TOL[torch.float32])
    row = torch.rand(B, 1, 1, 2 * T, generator=g) > 0.25
    _case(torch.float32, B=B, S=1, H=H, T=T, kv_lens=torch.tensor([2 * T, T + 3]), stripe=(2, 1), mask=row)
    _striped(torch.float32, 2, [2 * T - 1, 2 * T - 1], mask=row[..., :2 * T - 1], host=True)
    padding = torch.ones(B, 1, 1, 20, dtype=torch.bool)
    padding[1, ..., :4] = False  # request 1 left-padded by 4
    _striped(torch.float32, 2, [20, 20], S=S, mask=padding, q_pos=torch.arange(17, 20).view(1, S), host=True)


def check_mask_fp16():
    g = _gen()
    mask = torch.randn(2, 1, 8, 40, generator=g)
    mask[..., ::3] = float("-inf")
    _case(torch.float16, kv_lens=40, mask=mask)


def check_causal_multi_token_fp32():
    """S query tokens at the end of each request's count (speculative verification), striped."""
    c, S = 2, 3
    glens = torch.tensor([40, 5, 2])
    q_pos = glens.view(-1, 1) - S + torch.arange(S).view(1, S)
    _striped(torch.float32, c, glens.tolist(), S=S, q_pos=q_pos)
    _case(torch.float32, B=3, S=S, T=20, kv_lens=glens, stripe=(c, 1), q_pos=q_pos, lse_base="2", num_splits=3)


def check_causal_fp16():
    q_pos = torch.tensor([[10, 11], [30, 31]])
    _case(torch.float16, S=2, T=40, kv_lens=torch.tensor([12, 32]), q_pos=q_pos)


def check_nan_inside_the_count_propagates_fp32():
    """A NaN key reaches every row of its group in its request (through the split merge),
    a NaN value the same rows' outputs; other heads and requests stay exact."""
    g = _gen()
    B, S, H, Hk, D, T = 2, 1, 8, 2, 16, 48
    q, k, v = _operands(B, S, H, Hk, D, D, T, torch.float32, gen=g)
    k[0, 30, 1, 5] = float("nan")  # request 0, kv head 1 (query heads 4-7), in the third of five splits
    v[1, 3, 0, 2] = float("nan")  # request 1, kv head 0 (query heads 0-3)
    call = AttentionCall(q, None, k, None, D, 0.2, v=v, kv_lens=torch.tensor([48, 20]))
    out, lse = _attend(call, num_splits=5)
    assert torch.isnan(out[0, :, 4:]).all() and torch.isnan(lse[0, :, 4:]).all(), "the NaN key was dropped"
    assert torch.isnan(out[1, :, :4]).any(), "the NaN value was dropped"
    ro, rl = ref64(call)
    assert torch.equal(torch.isnan(out), torch.isnan(ro)), "NaN pattern differs from the reference"
    check_close(out[0, :, :4], lse[0, :, :4], ro[0, :, :4], rl[0, :, :4], TOL[torch.float32])
    check_close(out[1, :, 4:], lse[1, :, 4:], ro[1, :, 4:], rl[1, :, 4:], TOL[torch.float32])


def check_stale_nan_rows_past_the_count_are_not_read_fp32():
    """Rows past each request's count (a reused slot) hold NaN: never read, output exact."""
    g = _gen()
    B, H, Hk, D, T = 3, 8, 2, 16, 40
    q, k, v = _operands(B, 1, H, Hk, D, D, T, torch.float32, gen=g)
    glens = [27, 4, 0]  # rank 1 of 2 holds 13, 2 and 0 keys: the last tile of each spans stale rows
    c, r = 2, 1
    k_loc, v_loc = k[:, r::c].clone(), v[:, r::c].clone()
    for b, n in enumerate(glens):
        local = (n + c - 1 - r) // c
        k_loc[b, local:] = float("nan")
        v_loc[b, local:] = float("nan")
    call = AttentionCall(q, None, k_loc, None, D, 0.3, v=v_loc, kv_lens=torch.tensor(glens), stripe=(c, r))
    out, lse = poisoned(B, 1, H, D, torch.float32, "cpu")
    _attend(call, out, lse, num_splits=3)
    ro, rl = ref64(call)
    check_close(out, lse, ro, rl, TOL[torch.float32])
    for b, n in enumerate(glens):  # a host count: the view ends at the rank's last row
        one = AttentionCall(q[b:b + 1], None, k_loc[b:b + 1], None, D, 0.3, v=v_loc[b:b + 1], kv_lens=n,
                            stripe=(c, r))
        out, lse = _attend(one)
        check_close(out, lse, ro[b:b + 1], rl[b:b + 1], TOL[torch.float32])


def check_empty_shard_and_refusals():
    """No rows (T = 0): 0 and -inf without a launch; bad operands and MLA calls are refused."""
    from dcp_pass.runtime.decode.kernels import per_head_attention as m

    q, k, v = _operands(2, 1, 4, 2, 16, 16, 0, torch.float32)
    out, lse = _attend(AttentionCall(q, None, k, None, 16, 0.1, v=v))
    assert (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = _operands(2, 1, 6, 4, 16, 16, 8, torch.float32)
    try:
        _attend(AttentionCall(q, None, k, None, 16, 0.1, v=v))
        raise AssertionError("6 query heads over 4 kv heads ran")
    except ValueError as e:
        assert "multiple" in str(e)
    mla = AttentionCall(torch.zeros(1, 1, 4, 32), None, torch.zeros(1, 8, 32), None, 32, 0.1).shape
    assert "not an MLA latent cache" in m.supports(mla)
    q, k, v = _operands(1, 1, 4, 2, 16, 16, 8, torch.bfloat16)
    assert "bfloat16 wrongly" in m.supports(AttentionCall(q, None, k, None, 16, 0.1, v=v).shape)
    q, k, v = _operands(1, 1, 4, 2, 320, 16, 8, torch.float32)
    assert "up to 256" in m.supports(AttentionCall(q, None, k, None, 16, 0.1, v=v).shape)


CPU_CHECKS = interpreter.check_names(globals())


# ======================================================================================
# pytest side
# ======================================================================================
cpu_results, test_cpu_interpreter = interpreter_tests(__file__, ROOT, CPU_CHECKS)


# ---------------------------------------------------------------- GPU (real shapes, bf16)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_call(B, S, H, Hk, D, Dv, T, dtype=torch.bfloat16, hf_layout=True, **kw):
    q, k, v = _operands(B, S, H, Hk, D, Dv, T, dtype, "cuda", hf_layout=hf_layout, gen=_gen())
    return AttentionCall(q, None, k, None, Dv, D ** -0.5, v=v, **kw)


def _gpu_check(call, tol=2e-2, lse_base="e"):
    B, S, H, _ = call.q_lat.shape
    out, lse = poisoned(B, S, H, call.v.shape[-1], call.q_lat.dtype, "cuda")
    from dcp_pass.runtime.decode.backends import attend_with_kernel

    (out, lse), kernel = attend_with_kernel(call, "auto", out, lse)
    assert kernel.name == "per_head"
    ro, rl = ref32(call)
    check_close(out, lse, ro, rl, tol, lse_base)


@gpu
@needs_cuda
@pytest.mark.parametrize("D,Dv", [(128, 128), (64, 64), (192, 128), (128, 256)])
@pytest.mark.gpu_full
def test_gpu_bf16_llama_shapes(D, Dv):
    lens = torch.tensor([16384, 1, 0, 9000, 4097, 16000, 2, 333], device="cuda")
    _gpu_check(_gpu_call(8, 1, 32, 8, D, Dv, 16384, kv_lens=lens))


@gpu
@needs_cuda
def test_gpu_bf16_striped_causal_mask_window():
    B, S, H, Hk, T, c, r = 3, 4, 32, 8, 3000, 2, 1
    local = torch.tensor([3000, 1700, 9], device="cuda")
    glens = global_counts(local, c, r)
    q_pos = glens.view(B, 1) - S + torch.arange(S, device="cuda").view(1, S)
    mask = torch.zeros(B, 1, 1, c * T, device="cuda")
    mask[..., 1::c][..., ::7] = float("-inf")
    _gpu_check(_gpu_call(B, S, H, Hk, 128, 128, T, kv_lens=glens, stripe=(c, r), q_pos=q_pos, mask=mask,
                         lse_base="2"), lse_base="2")
    _gpu_check(_gpu_call(B, 1, H, Hk, 128, 128, T, kv_lens=glens, stripe=(c, r), kv_start=1000))
    _gpu_check(_gpu_call(B, 1, 16, 16, 128, 128, T, dtype=torch.float16, kv_lens=2 * T - 5, stripe=(c, 0)))
    keep = torch.rand(B, S, H, c * T, device="cuda") > 0.2  # a boolean mask, read in place
    keep[0, 1, 5] = False
    _gpu_check(_gpu_call(B, S, H, Hk, 128, 128, T, kv_lens=glens, stripe=(c, r), mask=keep))
    _gpu_check(_gpu_call(B, S, H, Hk, 128, 128, T, kv_lens=glens, stripe=(c, r), q_pos=q_pos, mask=keep[:, :1, :1]))


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    B, H, Hk, T = 8, 32, 8, 8192
    lens = torch.randint(1, T, (B,), device="cuda")
    call = _gpu_call(B, 1, H, Hk, 128, 128, T, kv_lens=lens)
    _attend(call)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = _attend(call)
    call.q_lat.copy_(torch.randn_like(call.q_lat))
    lens.copy_(torch.randint(1, T, (B,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ro, rl = ref32(call)
    check_close(o, lse, ro, rl, 2e-2)


@gpu
@needs_cuda
@pytest.mark.gpu_full
def test_gpu_op_under_torch_compile():
    """dcp.local_attention inside a compiled function (inductor, CUDA graphs on) runs the kernel."""
    import dcp_pass.runtime.decode.ops  # noqa: F401 - registers torch.ops.dcp

    B, H, Hk, T, c, r = 4, 32, 8, 2048, 2, 0
    q, k, v = _operands(B, 1, H, Hk, 128, 128, T, torch.bfloat16, "cuda", hf_layout=True, gen=_gen())

    def step(q, k, v):
        return torch.ops.dcp.local_attention(q, k, v, 2 * T - 3, c, r, 128 ** -0.5, None, "e", "auto")

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        o, lse = compiled(q, k, v)
    torch.cuda.synchronize()
    ro, rl = ref32(AttentionCall(q, None, k, None, 128, 128 ** -0.5, v=v, kv_lens=2 * T - 3, stripe=(c, r)))
    check_close(o, lse, ro, rl, 2e-2)


@gpu
@needs_cuda
@pytest.mark.gpu_full
def test_gpu_hf_llama_generates_through_the_kernel(monkeypatch):
    """A Hugging Face Llama (GQA, 4 query heads over 2 kv heads) compiled with fast_path under
    inductor and CUDA graphs: the decode's attention runs on this kernel, bf16 generate within
    bf16 noise of the fp32 eager model."""
    pytest.importorskip("transformers")
    import torch._dynamo

    import hf_tiny
    from kit import hf

    from dcp_pass.backend import DcpBackend
    from dcp_pass.runtime.decode.kernels import per_head_attention as ph

    calls = []
    run = ph.run
    monkeypatch.setattr(ph, "run", lambda call, *a, **kw: calls.append(call.shape.describe()) or run(call, *a, **kw))
    torch._dynamo.reset()
    device = torch.device("cuda")
    prompts = hf.PROMPTS.to(device)
    want = hf.generate(hf_tiny.tiny_model("llama_gqa").to(device), prompts, 10)
    model = hf_tiny.tiny_model("llama_gqa", dtype=torch.bfloat16).to(device)
    model.compile(backend=DcpBackend(dcp_size=1, tp_size=1, fast_path=True, inner="inductor"))
    got = hf.generate(model, prompts, 10)
    torch._dynamo.reset()
    assert calls, "the per-head kernel did not run"
    assert hf.logits_error(got, want) < 5e-2


if __name__ == "__main__" and "--worker" in sys.argv:
    interpreter.worker_main(globals(), ROOT)
