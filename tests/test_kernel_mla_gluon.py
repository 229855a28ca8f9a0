"""Tests of the Gluon one-read MLA kernel (dcp_pass.runtime.decode.kernels.gluon.lock_step).

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

from kit.kernels import check_close, global_counts, gluon_kernel, poisoned, ref32  # noqa: E402,F401
from kit.offline import compiles_offline, offline_module  # noqa: E402

from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402


def test_not_offered_off_its_scope():
    from dcp_pass.runtime.decode.kernels.registry import KERNELS

    q = torch.zeros(1, 1, 8, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    for form in ("gluon_lock_step", "gluon_roles"):
        supports = KERNELS[form].supports
        assert supports(AttentionCall(q, None, kv, None, 512, 1.0).shape) is not None  # CPU tensors
        assert supports(AttentionCall(q, None, kv, None, 512, 1.0, mask=torch.zeros(1, 1, 1, 16)).shape) is not None
        assert supports(AttentionCall(q.float(), None, kv.float(), None, 512, 1.0).shape) is not None
    # a mask row per request is taken (the kernel reads [B, T] of it); one that differs by
    # head, or by query token when there are several, is not
    from dcp_pass.runtime.decode.kernels.common import mask_rows_shared

    B, S, H, T = 2, 3, 4, 16

    def shared(shape, s):
        return mask_rows_shared(torch.broadcast_to(torch.zeros(shape), (B, s, H, T)).stride(), s)

    assert shared((B, 1, 1, T), S)
    assert shared((B, 1, 1, T), 1)
    assert not shared((B, 1, H, T), S)
    assert not shared((B, S, 1, T), S)
    assert shared((B, 1, 1, T), 1)


def _offline():
    """(gluon.lock_step, benchmarks/offline_gluon.py), or skip where it cannot run."""
    from dcp_pass.runtime.decode.kernels.gluon import lock_step as G

    return G, offline_module("offline_gluon")


@compiles_offline
def test_compiles_for_hopper_with_this_triton():
    """The kernel is valid Gluon for the installed Triton (its API moves between releases:
    3.6 -> 3.9 renamed the async copy and the barrier), fits shared memory, and the default
    tile does not spill; the mask + causal variant compiles too."""
    G, off = _offline()
    plain = off.compile_config(G.GluonConfig())
    assert plain["stack"] == 0, plain
    assert plain["smem_kib"] <= 227 and {"64x256x16", "64x32x16"} <= set(plain["hgmma"]), plain
    masked = off.compile_config(G.GluonConfig(), mask=True, causal=True)
    assert masked["smem_kib"] <= 227 and masked["n_hgmma"] == plain["n_hgmma"], masked


@compiles_offline
def test_schedule_6_compiles_plain_and_masked():
    """Schedule 6 (two ring buffers as two allocations, two tiles per iteration) is valid Gluon
    here, with and without a mask row and causal cap, and fits shared memory (the mask rows
    travel in two small buffers beside the tiles); the defaults are 6 and q columns in
    registers only on the Triton they were measured with, and a masked call keeps q in
    shared memory unless configured otherwise."""
    G, off = _offline()
    six = off.compile_config(G.GluonConfig(schedule=6, q_reg=0))
    three = off.compile_config(G.GluonConfig(schedule=3, q_reg=0))
    assert six["smem_kib"] <= 227 and six["n_hgmma"] == 2 * three["n_hgmma"]  # two tiles' GEMMs per iteration
    masked = off.compile_config(G.GluonConfig(schedule=6, q_reg=0), mask=True, causal=True)
    assert masked["smem_kib"] <= 227 and masked["n_hgmma"] == six["n_hgmma"], masked
    import triton

    on_36 = triton.__version__.startswith("3.6")
    assert G.GluonConfig().kernels == (("gluon_roles", "gluon_lock_step") if on_36 else ("gluon_lock_step",))
    assert G.GluonConfig().lock_step_schedule() == (6 if on_36 else 3)
    assert G.GluonConfig(schedule=2).lock_step_schedule() == 2
    assert G.GluonConfig(64, 32, 3).kernels == ("gluon_lock_step",)  # not the role-split kernel's tiles
    # a masked call configured with the role-split kernel (which has no mask) takes the lock-step default
    assert G.lock_step_schedule(G.GluonConfig(schedule=G.Schedule.ROLE_SPLIT), masked=True) == (6 if on_36 else 3)
    assert G.GluonConfig(schedule=G.Schedule.ROLE_SPLIT).tag() == "gluon 64x64/8w/2s/v10"
    assert G.GluonConfig().q_reg_for(masked=False) == (256 if on_36 else 0)
    assert G.GluonConfig().q_reg_for(masked=True) == 0
    assert G.GluonConfig(q_reg=128).q_reg_for(masked=True) == 128


@compiles_offline
def test_role_split_kernel_compiles_for_hopper():
    """The role-split kernel (gluon/roles.py) is valid Gluon here, with one fused cache and
    with two: no spill, its two wgmma shapes (the scorer's whole 64 x 64 score tile, both
    value halves), 36 score steps + 2 x 4 value steps per tile, within shared memory; plain,
    and with a decode step's mask row and a causal cap."""
    _, off = _offline()
    for separate, masked in ((False, False), (True, False), (False, True)):
        r = off.compile_roles(separate_rope=separate, mask=masked, causal=masked)
        assert r["stack"] == 0 and r["smem_kib"] <= 227, r
        assert set(r["hgmma"]) == {"64x64x16", "64x256x16"} and r["n_hgmma"] == 36 + 8, r


def test_a_kernel_this_triton_cannot_build_is_dropped_not_raised(monkeypatch):
    """The chooser falls back (once, for the process) when the kernel it picked does not compile."""
    from triton.compiler.errors import CompilationError

    from dcp_pass.runtime.decode import backends
    from dcp_pass.runtime.decode.call import CallShape
    from dcp_pass.runtime.decode.kernels import mla_wide, registry
    from dcp_pass.runtime.decode.kernels.gluon import seesaw

    roles = gluon_kernel("gluon.roles")

    def broken(*args, **kwargs):
        raise CompilationError("kernel.py", None, "async_copy_global_to_shared has been removed")

    h200 = CallShape(heads=128, batch=8, keys=32768)  # a call a Gluon kernel (the seesaw one) is chosen for
    monkeypatch.setattr(roles, "run", broken)
    monkeypatch.setattr(seesaw, "run", broken)
    monkeypatch.setattr(mla_wide, "run", lambda call, out, lse_out: ("wide ran",))
    monkeypatch.setattr(registry, "UNUSABLE", {})
    monkeypatch.setattr(CallShape, "of", classmethod(lambda cls, call: h200))
    monkeypatch.setattr(backends, "resolve_attention_backend", lambda *a, **k: backends.ATTENTION_BACKENDS["triton"])
    call = AttentionCall(torch.zeros(8, 1, 128, 576), None, torch.zeros(8, 4, 576), None, 512, 1.0)
    with pytest.warns(RuntimeWarning, match="not usable"):
        result, kernel = backends.attend_with_kernel(call, "auto")
    assert result == ("wide ran",) and kernel.name == "wide"
    assert "CompilationError" in registry.UNUSABLE["gluon"]
    assert registry.choose(h200, registry.TRITON_KERNELS).name == "wide"
    with pytest.raises(CompilationError):  # an explicitly named kernel raises what it raises
        backends.attend(call, "gluon_seesaw")


def _chosen(q_lat, q_rope, kv, pe, mask=None) -> str:
    """The kernel the "triton" backend picks for these operands."""
    from dcp_pass.runtime.decode.backends import choose_kernel

    return choose_kernel(AttentionCall(q_lat, q_rope, kv, pe, 512, SCALE, mask), "triton").name


gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="needs a Hopper GPU")
SCALE = 192 ** -0.5


def _gluon(call, out=None, lse_out=None, config=None, num_splits=None):
    """`call` on the Gluon kernel `config` configures (default GluonConfig())."""
    from dcp_pass.runtime.decode.backends import attend
    from dcp_pass.runtime.decode.kernels.gluon.common import GLUON_DEFAULT

    options = {} if num_splits is None else dict(num_splits=num_splits)
    return attend(call, None, out, lse_out, config=config or GLUON_DEFAULT, **options)


def _case(B, T, lens, num_splits=None, stripe=(1, 0), config=None):
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
    _gluon(AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens, stripe=stripe), out, lse, config, num_splits)
    ro, rl = ref32(AttentionCall(q, None, clean, None, 512, SCALE, kv_lens=local))
    check_close(out, lse, ro, rl, 2e-2)
    return q, kv, lens


@gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.gpu_full
def test_gpu_gluon_ragged_nan_beyond_lengths(num_splits):
    _case(4, 8192, [8192, 1, 0, 5001], num_splits)


@gpu
@needs_hopper
def test_gpu_gluon_striped_lengths_and_tiles():
    from dcp_pass.runtime.decode.kernels.gluon import lock_step as G

    for cfg in (G.GluonConfig(64, 32, 3), G.GluonConfig(64, 64, 2, schedule=1), G.GluonConfig(64, 64, 2, schedule=2),
                G.GluonConfig(q_reg=128), G.GluonConfig(q_reg=256), G.GluonConfig(schedule=6, q_reg=0),
                G.GluonConfig(schedule=6, q_reg=128), G.GluonConfig(schedule=6, q_reg=256),
                G.GluonConfig(schedule=G.Schedule.ROLE_SPLIT), G.GluonConfig()):
        _case(3, 4100, [8199, 77, 2], stripe=(2, 1), config=cfg)


@gpu
@needs_hopper
@pytest.mark.parametrize("tag", ["64,64,2,3,0", "64,64,2,3,128", "64,64,2,2,0", "64,64,2,6,0", "64,64,2,6,128",
                                 "64,64,2,6,256", "64,64,2,10,0"])
@pytest.mark.gpu_full
def test_gpu_gluon_drifting_and_wide_scores(tag):
    """Scores whose running max keeps rising along the cache (keys grow in norm), jumps once
    (one huge early key) or spans ~2^20 within a tile (q scaled x8): the online rescaling
    must follow each. Against the fp32 reference, with several splits, and one NaN key
    (its request's rows NaN, the others untouched)."""
    from dcp_pass.runtime.decode.kernels.gluon import lock_step as G

    cfg = G.GluonConfig.parse(tag)
    g = torch.Generator(device="cuda").manual_seed(11)
    B, T = 4, 6000
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    q[2] *= 8
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv[0] *= torch.linspace(0.2, 3.0, T, device="cuda").to(torch.bfloat16)[:, None]  # max rises tile after tile
    kv[1, 5] *= 40  # one early key dominates every later tile
    lens = torch.tensor([T, T, 4321, 3000], device="cuda")
    for ns in (None, 3):
        out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
        call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens)
        _gluon(call, out, lse, cfg, ns)
        ro, rl = ref32(call)
        check_close(out, lse, ro, rl, 2e-2)
    bad = kv.clone()
    bad[3, 1234, 7] = float("nan")
    out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
    _gluon(AttentionCall(q, None, bad, None, 512, SCALE, kv_lens=lens), out, lse, cfg)
    assert torch.isnan(out[3]).all()
    check_close(out[:3], lse[:3], ro[:3], rl[:3], 2e-2)


@gpu
@needs_hopper
def test_gpu_gluon_cuda_graph_capture():
    B, T = 8, 4096
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), 100, device="cuda")
    call = AttentionCall(q, None, kv, None, 512, SCALE, kv_lens=lens)
    run = lambda: _gluon(call)  # noqa: E731
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, lse = run()
    lens.copy_(torch.randint(1, T + 1, (B,), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    ro, rl = ref32(call)
    check_close(o, lse, ro, rl, 2e-2)


@gpu
@needs_hopper
@pytest.mark.parametrize("tag", [None, "64,64,2,3,0", "64,64,2,6,128", "64,64,2,10,0"])
@pytest.mark.gpu_full
def test_gpu_gluon_shared_mask_and_causal_stripes(tag):
    """A decode mask row per request (-inf and finite entries, one request fully masked), and
    the causal cap of a striped multi-token call (c=2, r=1), each against the fp32 reference;
    the default (the role-split kernel, which takes both), the lock-step form's schedule 3
    ring and schedule 6 with q columns in registers, and the role-split kernel by name."""
    from dcp_pass.runtime.decode.kernels.gluon import lock_step as G

    cfg = G.GluonConfig.parse(tag) if tag else None

    g = torch.Generator(device="cuda").manual_seed(5)
    B, T = 3, 3000
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.zeros(B, 1, 1, T, device="cuda")
    mask[0, ..., 2000:] = float("-inf")
    mask[1, ..., ::7] = -3.0
    mask[2] = float("-inf")  # no visible key: output 0, LSE -inf
    lens = torch.tensor([T, 2500, T], device="cuda")
    assert _chosen(q, None, kv, None, mask).startswith("gluon") or os.environ.get("DCP_MLA_GLUON") == "0"
    out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
    call = AttentionCall(q, None, kv, None, 512, SCALE, mask=mask, kv_lens=lens)
    _gluon(call, out, lse, cfg, 3)
    ro, rl = ref32(call)
    check_close(out, lse, ro, rl, 2e-2)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    # the same mask as every other column of a wider row (stride 2 along the keys): the
    # kernel copies the row with its tile, element by element
    wide = torch.full((B, 1, 1, 2 * T), 7.0, device="cuda")
    wide[..., ::2] = mask
    out2, lse2 = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
    _gluon(call.replace(mask=wide[..., ::2]), out2, lse2, cfg)
    check_close(out2, lse2, ro, rl, 2e-2)

    # 3 tokens x 40 heads: rows of different query positions share a 64-row block
    S, c, r, H = 3, 2, 1, 40
    q2 = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    glens = torch.tensor([5001, 1, 4000], device="cuda")  # global counts; rank 1 holds odd positions
    q_pos = glens.view(B, 1) - S + torch.arange(S, device="cuda").view(1, S)
    out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
    call = AttentionCall(q2, None, kv, None, 512, SCALE, kv_lens=glens, q_pos=q_pos, stripe=(c, r))
    _gluon(call, out, lse, cfg)
    ro, rl = ref32(call)
    check_close(out, lse, ro, rl, 2e-2)
    # positions past int32 (the kernel compares in int32, clamped): every key visible
    far = torch.full((B, S), 2 ** 40, device="cuda")
    out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
    call = AttentionCall(q2, None, kv, None, 512, SCALE, kv_lens=glens, q_pos=far)
    _gluon(call, out, lse, cfg)
    ro, rl = ref32(call)
    check_close(out, lse, ro, rl, 2e-2)


@gpu
@needs_hopper
@pytest.mark.gpu_full
def test_gpu_gluon_separate_rope_cache_as_the_reference_model_keeps_it():
    """kv [B, T, 512] and pe [B, T, 64] in two buffers, q_lat / q_rope separate: the layout
    DeepSeek's reference model (and so the int-position decode graph) hands the op."""
    from dcp_pass.runtime.decode.kernels.gluon import lock_step as G

    g = torch.Generator(device="cuda").manual_seed(9)
    B, T = 4, 5000
    q_lat = torch.randn(B, 1, 128, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    q_rope = torch.randn(B, 1, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, T, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    pe = torch.randn(B, T, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor([T, 3, 0, 4097], device="cuda")
    from dcp_pass.runtime.decode.kernels.registry import KERNELS

    assert KERNELS["gluon_lock_step"].supports(AttentionCall(q_lat, q_rope, kv, pe, 512, SCALE).shape) is None
    if os.environ.get("DCP_MLA_GLUON") != "0":
        assert _chosen(q_lat, q_rope, kv, pe).startswith("gluon")
    out, lse = poisoned(B, 1, 128, 512, torch.bfloat16, "cuda")
    from dcp_pass.runtime.decode.backends import attend

    call = AttentionCall(q_lat, q_rope, kv, pe, 512, SCALE, kv_lens=lens)
    attend(call, "triton", out, lse)
    ro, rl = ref32(call)
    check_close(out, lse, ro, rl, 2e-2)


@gpu
@needs_hopper
@pytest.mark.parametrize("num_splits", [None, 2, 7])
@pytest.mark.gpu_full
def test_gpu_role_split_kernel_multi_token_rows_and_partial_blocks(num_splits):
    """The role-split kernel on rows that are (token, head) pairs of a 3-token call with 40
    heads (120 rows: a full and a partial 64-row block), a separate rope cache, ragged
    striped lengths with an empty request, NaN past every length; beside the lock-step
    kernel on the same call, both against the fp32 reference."""
    from dcp_pass.runtime.decode.kernels.gluon import lock_step as G

    g = torch.Generator(device="cuda").manual_seed(5)
    B, S, H, T = 3, 3, 40, 3000
    q = torch.randn(B, S, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, T, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    pe = torch.randn(B, T, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor([5999, 0, 1001], device="cuda")  # global counts under a (2, 1) stripe
    local = torch.div(lens + 2 - 1 - 1, 2, rounding_mode="floor").clamp(max=T)
    clean_kv, clean_pe = kv.clone(), pe.clone()
    for b in range(B):
        kv[b, local[b]:], pe[b, local[b]:] = float("nan"), float("nan")
        clean_kv[b, local[b]:], clean_pe[b, local[b]:] = 0, 0
    q_lat, q_rope = q[..., :512], q[..., 512:]
    ro, rl = ref32(AttentionCall(q_lat, q_rope, clean_kv, clean_pe, 512, SCALE, kv_lens=local))
    for cfg in (G.GluonConfig(schedule=G.Schedule.ROLE_SPLIT), G.GluonConfig(schedule=6)):
        out, lse = poisoned(B, S, H, 512, torch.bfloat16, "cuda")
        _gluon(AttentionCall(q_lat, q_rope, kv, pe, 512, SCALE, kv_lens=lens, stripe=(2, 1)), out, lse, cfg, num_splits)
        check_close(out, lse, ro, rl, 2e-2)
        assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()  # the empty request
