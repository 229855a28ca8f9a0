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
    assert entry.capturable is False and entry.takes_mask is False
    assert ATTENTION_BACKENDS["triton"].capturable and ATTENTION_BACKENDS["triton"].takes_mask


def test_availability_reasons(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    if not HAS_FLASHINFER:
        assert "not installed" in fim.flashinfer_unavailable(cuda, torch.bfloat16)
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    assert "needs CUDA tensors, the model is on cpu" in fim.flashinfer_unavailable(cpu, torch.bfloat16)
    assert "float16/bfloat16" in fim.flashinfer_unavailable(cuda, torch.float32)
    # unsupported dtype: the compiled op's non-strict resolution falls back to the reference
    assert resolve_attention_backend("flashinfer", cuda, torch.float32, strict=False).name == "torch"


def _patches(device, **options):
    from dcp_pass.backend import inner_config_patches

    mode = options.pop("mode", None)
    return inner_config_patches(DcpOptions.from_mapping(options), device, mode)


def test_cudagraphs_off_with_flashinfer():
    cuda = torch.device("cuda", 0)
    assert _patches(cuda, attn_backend="flashinfer") == {"triton.cudagraphs": False}
    assert _patches(cuda, attn_backend="flashinfer", mode="reduce-overhead")["triton.cudagraphs"] is False
    assert _patches(cuda, attn_backend="flashinfer", cudagraphs=False) == {"triton.cudagraphs": False}
    assert _patches(torch.device("cpu"), attn_backend="flashinfer") == {}
    with pytest.raises(DcpOptionError, match="cannot run inside CUDA-graph capture"):
        _patches(cuda, attn_backend="flashinfer", cudagraphs=True)
    assert _patches(cuda, attn_backend="triton") == {"triton.cudagraphs": True}


def test_masked_layer_refused_at_compile():
    from dcp_pass.rewrites.attention import check_backend_mask
    from dcp_pass.rewrites.match import NearMiss

    masked, plain = SimpleNamespace(masks=[object()]), SimpleNamespace(masks=[])
    with pytest.raises(NearMiss, match="'flashinfer' takes no additive score mask"):
        check_backend_mask(masked, SimpleNamespace(attn_backend="flashinfer"))
    check_backend_mask(plain, SimpleNamespace(attn_backend="flashinfer"))
    check_backend_mask(masked, SimpleNamespace(attn_backend="triton"))
    check_backend_mask(masked, SimpleNamespace(attn_backend="auto"))


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
