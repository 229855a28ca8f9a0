"""attn_backend="flashinfer": FlashInfer's BatchMLAPagedAttentionWrapper.

CPU tests (always run): the host-side planning (visible key counts under striped
causality, row chunks, per-request page lists), the table entry, the cudagraphs and
mask refusals, and the whole adapter against the torch reference with FlashInfer's
wrapper replaced by an emulation of its documented semantics (requests of
``qo_indptr``, pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, the first
``kv_len[i]`` tokens of those pages, non-causal, base-2 LSE). GPU tests run the real
wrapper and skip when flashinfer is not importable or there is no CUDA device.
"""
from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch

from dcp_pass.options import DcpOptionError, DcpOptions
from dcp_pass.runtime.decode.backends import ATTENTION_BACKENDS, attend, attention_lse_base, resolve_attention_backend
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.kernels import flashinfer_mla as fim
from dcp_pass.runtime.decode.kernels.reference import attention_reference

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_gpu_flashinfer = pytest.mark.skipif(not (HAS_FLASHINFER and torch.cuda.is_available()),
                                          reason="needs flashinfer and a CUDA device")


# --------------------------------------------------------------------------------------
# host-side planning
# --------------------------------------------------------------------------------------
def _brute_counts(lens, S, T, q_pos, c, r):
    B = len(lens)
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        for s in range(S):
            n = 0
            for k in range(min(max(lens[b], 0), T)):
                if q_pos is None or k * c + r <= int(q_pos[b, s]):
                    n += 1
            out[b, s] = n
    return out


@pytest.mark.parametrize("c, r", [(1, 0), (2, 1), (4, 0), (4, 3), (3, 2)])
def test_visible_counts_match_striped_causality(c, r):
    g = torch.Generator().manual_seed(c * 10 + r)
    lens = [0, 1, 7, 12, 30]
    S, T = 3, 20
    q_pos = torch.randint(-2, 70, (len(lens), S), generator=g)
    got = fim.visible_counts(torch.tensor(lens), S, T, q_pos, c, r)
    assert torch.equal(got, _brute_counts(lens, S, T, q_pos, c, r))
    assert torch.equal(fim.visible_counts(torch.tensor(lens), S, T), _brute_counts(lens, S, T, None, c, r))


def test_visible_counts_broadcast_positions():
    # one position per row ([B, 1]) serves every query token of the row
    got = fim.visible_counts(torch.tensor([9, 9]), 2, None, torch.tensor([[3], [8]]), 2, 1)
    assert got.tolist() == [[2, 2], [4, 4]]


def test_row_chunks():
    assert fim.row_chunks([1] * 5, [10] * 5, 1, work_cap=2) == [(0, 2), (2, 4), (4, 5)]
    assert fim.row_chunks([1] * 5, [10] * 5, 1, pos_cap=25) == [(0, 2), (2, 4), (4, 5)]
    assert fim.row_chunks([1] * 5, [10] * 5, 1, max_rows=3) == [(0, 3), (3, 5)]
    assert fim.row_chunks([2, 2], [1, 1], 2) == [(0, 2)]
    assert fim.row_chunks([], [], 1) == []
    with pytest.raises(ValueError, match="work items"):
        fim.row_chunks([3], [1], 2, work_cap=5)
    with pytest.raises(ValueError, match="32-bit"):
        fim.row_chunks([1], [100], 1, pos_cap=50)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        fim.row_chunks([1], [1], 1, max_rows=0)


def test_paged_request_pages():
    counts = torch.tensor([0, 5, 4, 9])
    rows = torch.tensor([0, 0, 1, 2])
    indptr, flat = fim.paged_request_pages(counts, rows, 4, 3)
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 0, 2, 3, 6]
    assert flat.tolist() == [0, 1, 3, 6, 7, 8]
    with pytest.raises(ValueError, match="pages"):
        fim.paged_request_pages(torch.tensor([13]), torch.tensor([0]), 4, 3)


def test_rows_within_span():
    t = SimpleNamespace(shape=(8, 1000, 512), stride=lambda d=None: (1 << 30, 576, 1)[d])
    # each row's tail spans 999 * 576 + 512 elements; rows start 2**30 apart: 4 fit in 2**32
    assert fim._rows_within_span([t]) == 4
    huge = SimpleNamespace(shape=(1, 1 << 23, 576), stride=lambda d=None: ((1 << 23) * 576, 576, 1)[d])
    assert fim._rows_within_span([huge]) == 0


# --------------------------------------------------------------------------------------
# the table and the pass's refusals
# --------------------------------------------------------------------------------------
def test_table_entry():
    entry = ATTENTION_BACKENDS["flashinfer"]
    assert entry.kernels == ("flashinfer",)
    assert entry.lse_base == "2" == attention_lse_base("flashinfer")
    assert entry.capturable is False and entry.plans_on_host and entry.takes_mask is False
    assert ATTENTION_BACKENDS["triton"].capturable and ATTENTION_BACKENDS["triton"].takes_mask


def test_auto_offers_flashinfer_where_it_plans_without_a_sync(monkeypatch):
    """"auto" chooses among the Triton kernels and FlashInfer: FlashInfer only for calls whose
    key counts the host knows, unmasked and without a causal cap, and where it measured
    faster (a fake table here: the real one is the H200's)."""
    from dcp_pass.runtime.decode.call import CallShape
    from dcp_pass.runtime.decode.kernels import path_table, registry

    assert registry.considered("auto")[-2:] == ("flashinfer", "torch")
    assert registry.considered("torch") == ("torch",) and "flashinfer" not in registry.considered(None)
    monkeypatch.setattr(fim, "_installed", lambda: True)
    monkeypatch.setattr(path_table, "MEASURED", ((16, 8, 32768, {"split": 0.2, "flashinfer": 0.1}),))
    path_table.fastest.cache_clear()
    try:
        names = registry.considered("auto")
        shape = dict(batch=8, heads=16, keys=32768, fused=False)
        if registry.KERNELS["split"].supports(CallShape(**shape)) is not None:
            pytest.skip("no Triton here")
        assert registry.choose(CallShape(host_lens=True, **shape), names).name == "flashinfer"
        assert "sync" in fim.offered(CallShape(host_lens=False, **shape))
        assert registry.choose(CallShape(host_lens=False, **shape), names).name == "split"
        assert registry.choose(CallShape(host_lens=True, causal=True, **shape), names).name == "split"
        assert registry.choose(CallShape(host_lens=True, mask="row", **shape), names).name == "split"
        assert fim.unmeasured(CallShape(host_lens=True, **shape)) is False
    finally:
        path_table.fastest.cache_clear()


def test_availability_reasons(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    if not HAS_FLASHINFER:
        assert "not installed" in fim.unavailable(cuda, torch.bfloat16)
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    assert "needs CUDA tensors, the model is on cpu" in fim.unavailable(cpu, torch.bfloat16)
    assert "float16/bfloat16" in fim.unavailable(cuda, torch.float32)
    # unsupported dtype: the compiled op's non-strict resolution falls back to the reference
    assert resolve_attention_backend("flashinfer", cuda, torch.float32, strict=False).name == "torch"


def _patches(device, **options):
    from dcp_pass.backend import inner_config_patches

    mode = options.pop("mode", None)
    return inner_config_patches(DcpOptions.from_mapping(options), device, mode)


def test_cudagraphs_on_with_flashinfer_where_the_backend_holds_the_count():
    from dcp_pass.backend import inner_config_patches

    cuda = torch.device("cuda", 0)
    opts = DcpOptions.from_mapping(dict(attn_backend="flashinfer"))
    assert inner_config_patches(opts, cuda, None, host_counts=True) == {"triton.cudagraphs": True}
    forced = DcpOptions.from_mapping(dict(attn_backend="flashinfer", cudagraphs=True))
    assert inner_config_patches(forced, cuda, None, host_counts=True) == {"triton.cudagraphs": True}


def test_cudagraphs_off_with_flashinfer():
    cuda = torch.device("cuda", 0)
    assert _patches(cuda, attn_backend="flashinfer") == {"triton.cudagraphs": False}
    assert _patches(cuda, attn_backend="flashinfer", mode="reduce-overhead")["triton.cudagraphs"] is False
    assert _patches(cuda, attn_backend="flashinfer", cudagraphs=False) == {"triton.cudagraphs": False}
    assert _patches(torch.device("cpu"), attn_backend="flashinfer") == {}
    with pytest.raises(DcpOptionError, match="cannot run inside CUDA-graph capture"):
        _patches(cuda, attn_backend="flashinfer", cudagraphs=True)
    assert _patches(cuda, attn_backend="triton") == {"triton.cudagraphs": True}


def test_masked_layer_runs_on_auto():
    """A masked layer (a prefill's causal mask) under attn_backend="flashinfer" runs on "auto"'s
    kernels, and its report says so; unmasked layers keep FlashInfer."""
    from dcp_pass.rewrites.attention import layer_backend

    masked, plain = SimpleNamespace(masks=[object()], rewrite_notes=[]), SimpleNamespace(masks=[], rewrite_notes=[])
    assert layer_backend(masked, SimpleNamespace(attn_backend="flashinfer")) == "auto"
    assert layer_backend(masked, SimpleNamespace(attn_backend="flashinfer")) == "auto"
    assert masked.rewrite_notes == ["masked: attention auto (flashinfer takes no additive score mask)"]
    assert layer_backend(plain, SimpleNamespace(attn_backend="flashinfer")) == "flashinfer" and not plain.rewrite_notes
    assert layer_backend(masked, SimpleNamespace(attn_backend="triton")) == "triton"


def test_kernel_input_checks():
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="float16/bfloat16"):
        fim._check_kernel_inputs(torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float32), None)
    with pytest.raises(ValueError, match="one dtype"):
        fim._check_kernel_inputs(torch.zeros(1, dtype=bf), torch.zeros(1, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="CUDA"):
        fim._check_kernel_inputs(torch.zeros(1, dtype=bf), torch.zeros(1, dtype=bf), None)
    q = torch.zeros(1, 1, 2, 512, dtype=bf)
    with pytest.raises(ValueError, match="latent 512 \\+ rope 64"):
        fim._operands(q, torch.zeros(1, 1, 2, 32, dtype=bf), torch.zeros(1, 3, 512, dtype=bf),
                      torch.zeros(1, 3, 32, dtype=bf), 512)
    with pytest.raises(ValueError, match="rope part"):
        fim._operands(q, None, torch.zeros(1, 3, 512, dtype=bf), None, 512)


def test_mask_refused_at_run():
    q = torch.zeros(1, 1, 2, 512)
    with pytest.raises(NotImplementedError, match="no additive mask"):
        fim.run(AttentionCall(q, torch.zeros(1, 1, 2, 64), torch.zeros(1, 3, 512), torch.zeros(1, 3, 64), 512, 1.0,
                              mask=torch.zeros(1, 1, 2, 3)))


# --------------------------------------------------------------------------------------
# the adapter against the reference, FlashInfer's wrapper emulated
# --------------------------------------------------------------------------------------
class EmulatedWrapper:
    """FlashInfer 0.2.x BatchMLAPagedAttentionWrapper semantics, non-causal, in float64."""

    def __init__(self):
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32
        assert (head_dim_ckv, head_dim_kpe) == (512, 64) and causal is False
        assert qo_indptr.device.type == kv_indptr.device.type == kv_len_arr.device.type == "cpu"
        self.qo, self.kvp, self.idx, self.lens = qo_indptr, kv_indptr, kv_indices, kv_len_arr
        self.page_size, self.scale, self.heads = page_size, sm_scale, num_heads
        self.plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        assert return_lse and out.shape == q_nope.shape and lse.shape == q_nope.shape[:2]
        assert q_nope.shape[1] == self.heads
        for i in range(self.lens.numel()):
            q0, q1 = int(self.qo[i]), int(self.qo[i + 1])
            n = int(self.lens[i])
            pages = self.idx[int(self.kvp[i]):int(self.kvp[i + 1])].long()
            tok = torch.arange(n)
            page = pages[tok // self.page_size]
            ckv = ckv_cache[page, tok % self.page_size].double()
            kpe = kpe_cache[page, tok % self.page_size].double()
            s = (torch.einsum("qhd,td->qht", q_nope[q0:q1].double(), ckv)
                 + torch.einsum("qhd,td->qht", q_pe[q0:q1].double(), kpe)) * self.scale
            m = torch.logsumexp(s, -1)
            o = torch.einsum("qht,td->qhd", torch.exp(s - m.unsqueeze(-1)), ckv)
            out[q0:q1] = o.to(out.dtype)
            lse[q0:q1] = (m / math.log(2)).float()  # base 2; an empty request gives garbage (-inf / nan)
        return out, lse


@pytest.fixture
def emulated(monkeypatch):
    wrapper = EmulatedWrapper()
    runner = fim._Runner(wrapper)
    monkeypatch.setattr(fim, "_runner", lambda device: runner)
    monkeypatch.setattr(fim, "_check_kernel_inputs", lambda q, kv, pe: None)  # fp32 CPU tensors here
    return wrapper


def _inputs(B, S, H, T, fused=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(B, S, H, 576 if fused else 512, generator=g).to(dtype)
    q_rope = None if fused else torch.randn(B, S, H, 64, generator=g).to(dtype)
    kv = torch.randn(B, T, 576 if fused else 512, generator=g).to(dtype)
    pe = None if fused else torch.randn(B, T, 64, generator=g).to(dtype)
    return q_lat, q_rope, kv, pe


def _close(got, want, rtol=1e-4):
    (o, lse), (ro, rlse) = got, want
    assert o.shape == ro.shape and lse.shape == rlse.shape
    torch.testing.assert_close(o.double(), ro.double(), rtol=rtol, atol=rtol)
    torch.testing.assert_close(lse.double(), rlse.double(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("fused", [False, True])
def test_dense_decode_emulated(emulated, base, fused):
    q_lat, q_rope, kv, pe = _inputs(3, 1, 4, 9, fused=fused)
    lens = torch.tensor([9, 0, 4])  # an empty shard row: output 0, LSE -inf
    call = AttentionCall(q_lat, q_rope, kv, pe, 512, 0.05, kv_lens=lens, lse_base=base)
    got = fim.run(call)
    _close(got, attention_reference(call))
    assert torch.isneginf(got[1][1]).all() and (got[0][1] == 0).all()


def test_dense_without_lengths_and_short_values(emulated):
    q_lat, q_rope, kv, pe = _inputs(2, 1, 3, 6)
    call = AttentionCall(q_lat, q_rope, kv, pe, 384, 0.1)
    _close(fim.run(call), attention_reference(call))


@pytest.mark.parametrize("c, r", [(1, 0), (4, 1), (4, 3)])
def test_striped_causal_verification_emulated(emulated, c, r):
    B, S, H, T = 2, 3, 2, 7
    q_lat, q_rope, kv, pe = _inputs(B, S, H, T, seed=c + r)
    kv_len = torch.tensor([4 * c + 2, 6 * c])  # global lengths including the S verified tokens
    q_pos = kv_len.view(-1, 1) - S + torch.arange(S).view(1, -1)
    call = AttentionCall(q_lat, q_rope, kv, pe, 512, 0.07, kv_lens=kv_len, q_pos=q_pos, stripe=(c, r))
    _close(fim.run(call), attention_reference(call))


def test_global_lengths_with_a_stripe(emulated):
    # global counts, the kernel takes rank r's share
    c, r = 4, 3
    q_lat, q_rope, kv, pe = _inputs(3, 1, 2, 6)
    glob = torch.tensor([21, 4, 3])
    local = glob // c + (r < glob % c).long()
    got = fim.run(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=glob, stripe=(c, r)))
    _close(got, attention_reference(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=local)))
    assert torch.isneginf(got[1][2]).all()  # 3 global keys: none on rank 3


def test_plan_reused_across_layers(emulated):
    q_lat, q_rope, kv, pe = _inputs(2, 1, 2, 5)
    lens = torch.tensor([5, 3])
    for _ in range(3):  # three layers of one step: one plan
        fim.run(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=lens))
    assert emulated.plans == 1
    fim.run(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=torch.tensor([5, 4])))
    assert emulated.plans == 2


def test_row_chunks_split_plans(emulated, monkeypatch):
    monkeypatch.setattr(fim, "WORK_CAP", 2)
    q_lat, q_rope, kv, pe = _inputs(5, 1, 3, 6)
    lens = torch.tensor([6, 2, 0, 5, 1])
    call = AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=lens)
    got = fim.run(call)
    assert emulated.plans == 3  # rows (0, 1), (2, 3), (4,)
    _close(got, attention_reference(call))


@pytest.fixture
def emulated_graph(monkeypatch):
    """Each plan shape's fixed-buffer wrapper, emulated (plan shape -> runner)."""
    runners = {}
    monkeypatch.setattr(fim, "_graph_runner",
                        lambda device, shape, requests: runners.setdefault(shape, fim._Runner(EmulatedWrapper())))
    return runners


@pytest.mark.parametrize("c, r", [(1, 0), (2, 1), (4, 3)])
def test_step_count_plans_before_each_call_emulated(emulated, emulated_graph, monkeypatch, c, r):
    """Calls that know the step's count on the host (host_lens) plan on their shape's
    fixed-buffer wrapper and register its planner with the graph's step; a "replay" (the op
    inside capture, planning nothing) then runs on the plan the step made for its own count,
    rows with no key (count 1 on rank 1) giving 0 and -inf."""
    from dcp_pass.runtime.decode import step_count

    B, H, T = 2, 3, 6
    q_lat, q_rope, kv, pe = _inputs(B, 1, H, T, seed=c + r)
    buffer = torch.zeros(1, dtype=torch.int64)  # the graph's device count (here on the CPU)
    plans = step_count.HostPlans()

    def call(count):
        return AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=buffer, stripe=(c, r), host_lens=count)

    counts = [1, 2, 3, c * T - 1, c * T]
    for i, count in enumerate(counts):
        buffer.fill_(count)
        if i == 2:
            monkeypatch.setattr(fim, "_capturing", lambda: True)  # the graph is captured, then replayed
        with step_count.step(plans, count):
            got = fim.run(call(count))
        want = attention_reference(call(count).replace(host_lens=None))
        _close(got, want)
        if count < r + 1:
            assert torch.isneginf(got[1]).all() and (got[0] == 0).all()
    assert emulated.plans == 0 and len(plans) == 1 and len(emulated_graph) == 1
    (runner,) = emulated_graph.values()
    assert runner.wrapper.plans == len({min(T, (n + c - 1 - r) // c) for n in counts})


def test_capture_refused_without_a_plan(emulated, emulated_graph, monkeypatch):
    from dcp_pass.runtime.decode import step_count

    q_lat, q_rope, kv, pe = _inputs(2, 1, 2, 5)
    buffer = torch.tensor([4])
    monkeypatch.setattr(fim, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="no host copy of its key counts"):
        fim.run(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=buffer))
    with step_count.step(step_count.HostPlans(), 4), pytest.raises(RuntimeError, match="not run once outside"):
        fim.run(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=buffer, host_lens=4))
    q_pos = torch.tensor([[3], [3]])
    with pytest.raises(RuntimeError, match="causal cap"):
        fim.run(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=buffer, host_lens=4, q_pos=q_pos))


def test_host_lens_is_a_one_element_count():
    q_lat, q_rope, kv, pe = _inputs(2, 1, 2, 5)
    with pytest.raises(ValueError, match="one-element kv_lens"):
        AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=torch.tensor([4, 5]), host_lens=4)
    with pytest.raises(ValueError, match="one-element kv_lens"):
        AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=4, host_lens=4)


def test_whole_shard_empty(emulated):
    q_lat, q_rope, kv, pe = _inputs(2, 1, 2, 0)
    out, lse = fim.run(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1))
    assert (out == 0).all() and torch.isneginf(lse).all() and emulated.plans == 0


@pytest.mark.parametrize("S", [1, 3])
def test_paged_emulated(emulated, S):
    g = torch.Generator().manual_seed(S)
    B, H, P, pages = 3, 2, 4, 9
    q_lat = torch.randn(B, S, H, 512, generator=g)
    q_rope = torch.randn(B, S, H, 64, generator=g)
    kv_pool = torch.randn(pages, P, 512, generator=g)
    pe_pool = torch.randn(pages, P, 64, generator=g)
    table = torch.tensor([[3, 1, 7], [0, 0, 0], [8, 2, 5]])
    lens = torch.tensor([10, 0, 12])  # each row's local keys
    extra = {}
    if S > 1:  # rank 1 of 2: global counts whose share is lens, global query positions
        extra = dict(q_pos=torch.tensor([[15, 16, 17], [0, 1, 2], [21, 22, 23]]), stripe=(2, 1))
        lens = lens * 2
    call = AttentionCall(q_lat, q_rope, kv_pool, pe_pool, 512, 0.05, kv_lens=lens, lse_base="2", page_table=table,
                         **extra)
    _close(fim.run(call), attention_reference(call))


# --------------------------------------------------------------------------------------
# the real FlashInfer (GPU)
# --------------------------------------------------------------------------------------
def _gpu_inputs(B, S, H, T, fused=False, seed=0):
    q_lat, q_rope, kv, pe = _inputs(B, S, H, T, fused=fused, seed=seed)
    cast = lambda t: None if t is None else (t * 0.5).to("cuda", torch.bfloat16)  # noqa: E731
    return cast(q_lat), cast(q_rope), cast(kv), cast(pe)


def _ref64(call):
    """The reference in float64 from float64 copies, LSE in the call's base."""
    from dcp_pass.runtime.decode.kernels.reference import attention_reference

    d = lambda t: None if t is None else t.double()  # noqa: E731
    return attention_reference(call.replace(q_lat=d(call.q_lat), q_rope=d(call.q_rope), kv=d(call.kv), pe=d(call.pe)))


def _gpu_check(got, want):
    (o, lse), (ro, rlse) = got, want
    rel = (o.double() - ro.double()).norm() / ro.double().norm().clamp_min(1e-30)
    assert float(rel) < 2e-2
    finite = torch.isfinite(rlse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite].double(), rlse[finite].double(), rtol=2e-3, atol=2e-3)


@needs_gpu_flashinfer
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_dense_decode(H, fused):
    B, T = 4, 1500
    q_lat, q_rope, kv, pe = _gpu_inputs(B, 1, H, T, fused=fused)
    lens = torch.tensor([1500, 0, 777, 1], device="cuda")
    scale = 1 / math.sqrt(192)
    for base in ("2", "e"):
        call = AttentionCall(q_lat, q_rope, kv, pe, 512, scale, kv_lens=lens, lse_base=base)
        _gpu_check(fim.run(call), _ref64(call))


@needs_gpu_flashinfer
def test_gpu_striped_causal_and_paged():
    B, S, H, T, c, r = 2, 3, 128, 700, 4, 2
    q_lat, q_rope, kv, pe = _gpu_inputs(B, S, H, T, seed=1)
    kv_len = torch.tensor([2001, 2790], device="cuda")
    q_pos = kv_len.view(-1, 1) - S + torch.arange(S, device="cuda").view(1, -1)
    call = AttentionCall(q_lat, q_rope, kv, pe, 512, 0.04, kv_lens=kv_len, q_pos=q_pos, stripe=(c, r))
    ref = _ref64(call)
    _gpu_check(fim.run(call), ref)
    P = 64
    n_pages = T // P + 1
    pool = torch.zeros(2 * n_pages + 3, P, 512, dtype=kv.dtype, device="cuda")
    pepool = torch.zeros(2 * n_pages + 3, P, 64, dtype=kv.dtype, device="cuda")
    table = torch.randperm(pool.shape[0], device="cuda")[: 2 * n_pages].view(2, n_pages)
    padded = torch.zeros(B, n_pages * P, 512, dtype=kv.dtype, device="cuda")
    padded[:, :T] = kv
    pad_pe = torch.zeros(B, n_pages * P, 64, dtype=kv.dtype, device="cuda")
    pad_pe[:, :T] = pe
    pool[table] = padded.view(B, n_pages, P, 512)
    pepool[table] = pad_pe.view(B, n_pages, P, 64)
    _gpu_check(fim.run(call.replace(kv=pool, pe=pepool, page_table=table)), ref)


@needs_gpu_flashinfer
def test_gpu_backend_table_run():
    q_lat, q_rope, kv, pe = _gpu_inputs(2, 1, 16, 300)
    assert resolve_attention_backend("flashinfer", q_lat.device, kv.dtype).name == "flashinfer"
    call = AttentionCall(q_lat, q_rope, kv, pe, 512, 0.1, kv_lens=torch.tensor([300, 17], device="cuda"), lse_base="2")
    _gpu_check(attend(call, "flashinfer"), _ref64(call))


@needs_gpu_flashinfer
def test_gpu_captured_step_replays_each_steps_plan():
    """The op inside a captured CUDA graph: run once in a step outside capture (its planner
    registers), captured, then replayed after steps of new counts: every replay equals the
    reference at its own count, the rank's empty rows (count 1 on rank 1 of 2) 0 and -inf."""
    from dcp_pass.runtime.decode import ops  # noqa: F401  (registers torch.ops.dcp.*)
    from dcp_pass.runtime.decode import step_count

    B, H, T, c, r = 4, 16, 1024, 2, 1
    q_lat, q_rope, kv, pe = _gpu_inputs(B, 1, H, T, seed=3)
    buffer = torch.ones(1, dtype=torch.int64, device="cuda")
    plans = step_count.HostPlans()

    def op():
        return torch.ops.dcp.mla_local_attention(q_lat, q_rope, kv, pe, step_count.STEP_COUNT, c, r, 512, 0.05, None,
                                                 "e", "flashinfer", kv_lens=buffer)

    with step_count.step(plans, 1):
        op()
    graph = torch.cuda.CUDAGraph()
    with step_count.step(plans, 1), torch.cuda.graph(graph):
        out, lse = op()
    assert len(plans) == 1
    for count in (1, 2, 3, 700, 2 * T - 1, 2 * T, 5):
        buffer.fill_(count)
        with step_count.step(plans, count):
            graph.replay()
        torch.cuda.synchronize()
        want = _ref64(AttentionCall(q_lat, q_rope, kv, pe, 512, 0.05, kv_lens=buffer.clone(), stripe=(c, r)))
        if count < 2:
            assert (out == 0).all() and torch.isneginf(lse).all()
        else:
            _gpu_check((out, lse), want)


@needs_gpu_flashinfer
def test_gpu_int_position_decode_captures_flashinfer(monkeypatch):
    """A reference-style model (int start_pos) at V3's attention sizes (512 + 64 latent, 16
    heads) on one GPU, fast path, attn_backend="flashinfer", inductor with CUDA graphs "auto":
    the decode graph keeps CUDA graphs (its plan made on the host from the step count before
    each replay), so the adapter's Python runs only while the graph warms up and records, and
    the bf16 logits teacher-forced over 40 steps stay as close to the fp32 eager model's as
    the Triton kernels' do."""
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    torch.set_grad_enabled(False)
    args = ModelArgs(max_batch_size=4, max_seq_len=64, vocab_size=256, dim=256, inter_dim=512, n_layers=2,
                     n_dense_layers=2, n_heads=16, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
                     v_head_dim=64)
    tokens = torch.randint(0, 256, (4, 46), generator=torch.Generator().manual_seed(4)).cuda()

    def drive(model):
        outs = [model(tokens[:, :6], 0).float().clone()]
        outs += [model(tokens[:, p:p + 1], p).float().clone() for p in range(6, tokens.shape[1])]
        return torch.stack(outs)

    want = drive(build_model(args, rank=0, seed=2, device="cuda"))
    bf16 = ModelArgs(**{**args.__dict__, "dtype": torch.bfloat16})
    planned = []
    real = fim._run_dense_planned
    monkeypatch.setattr(fim, "_run_dense_planned", lambda *a: planned.append(1) or real(*a))
    errors = {}
    for backend in ("flashinfer", "triton"):
        torch._dynamo.reset()
        planned.clear()
        dcp = DcpBackend(dcp_size=1, fast_path=True, attn_backend=backend)
        got = drive(torch.compile(build_model(bf16, rank=0, seed=2, device="cuda"), backend=dcp))
        errors[backend] = ((got - want).abs().amax() / want.abs().amax()).item()
        if backend == "flashinfer":
            assert 0 < len(planned) <= 2 * 4, len(planned)  # 2 layers x (warm-up, recording, ...): not per step
    assert errors["flashinfer"] < 3e-2 and errors["flashinfer"] < 2 * errors["triton"] + 1e-2, errors
