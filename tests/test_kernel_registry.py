"""The registry of attention kernels and its chooser (dcp_pass/runtime/decode/kernels/registry.py).

No GPU needed: the chooser reads a call's CallShape, so the calls are described. The pins
are the choices the GPU makes (the same kernel for the same call as before the registry):
on an H200 (compute capability 9, Triton 3.6) and on other platforms, for the layouts,
dtypes, head counts, kinds of call, alignments, environment switches and backends
listed, each row of letters is one description per head count (16, 32, 64, 128), four
kinds of call each (plain, a mask row per request, a mask per head, a causal cap): one letter
where the choice is the same for every batch (1, 8, 32) and keys per rank (4K, 32K, 128K)
listed, the letters in brackets where it depends on them (at 128 heads the seesaw kernel
measured faster from 32K keys, the role-split one at 4K). The warp-specialised Gluon forms
take a decode step's mask row and causal caps; the lock-step one runs them where those cannot
(rows 8- but not 16-aligned, Tritons other than 3.6).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dcp_pass.runtime.decode.backends import ATTENTION_BACKENDS, AttentionBackendUnavailable, choose_kernel
from dcp_pass.runtime.decode.call import AttentionCall, CallShape
from dcp_pass.runtime.decode.kernels import registry
from dcp_pass.runtime.decode.kernels.gluon.common import HAS_GLUON, GluonConfig, Schedule

needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon")

LETTER = {"gluon_seesaw": "E", "gluon_roles": "R", "gluon_lock_step": "L", "wide": "W", "split": "S", "torch": "T"}
KINDS = {"plain": dict(), "row": dict(mask="row"), "head": dict(mask="full"), "causal": dict(causal=True)}
LAYOUTS = {  # d_main, d_tail, v_dim, fused
    "fused576": dict(d_main=512, d_tail=64, v_dim=512, fused=True),
    "sep512": dict(d_main=512, d_tail=64, v_dim=512, fused=False),
    "sep128": dict(d_main=128, d_tail=32, v_dim=128, fused=False),
    "fused200": dict(d_main=200, d_tail=24, v_dim=200, fused=True),
    "fused2048": dict(d_main=2048, d_tail=64, v_dim=2048, fused=True),
    "heads128": dict(d_main=128, d_tail=0, v_dim=128, fused=False),  # with per_head=True: GQA / MHA
}
ALIGN = {"a16": dict(gluon_aligned=True, rows16=True), "a8": dict(gluon_aligned=True, rows16=False),
         "a4": dict(gluon_aligned=False, rows16=False)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ENV = {"": {}, "WIDE=0": {"DCP_MLA_WIDE": "0"}, "WIDE=1": {"DCP_MLA_WIDE": "1"}, "GLUON=0": {"DCP_MLA_GLUON": "0"}}


def shape(layout="fused576", dtype="bf16", align="a16", capability=9, triton="3.6.0", **kw) -> CallShape:
    return CallShape(device="cuda", capability=capability, triton=triton, dtype=DTYPES[dtype], **LAYOUTS[layout],
                     **ALIGN[align], **kw)


def pick(s: CallShape, backend="auto") -> str:
    """What the op runs: the registry's chooser for the backend asked for."""
    return registry.select(s, backend).winner


def letters(monkeypatch, env="", backend="auto", **kw) -> str:
    for name in ("DCP_MLA_WIDE", "DCP_MLA_GLUON"):
        monkeypatch.delenv(name, raising=False)
    for name, value in ENV[env].items():
        monkeypatch.setenv(name, value)
    rows = []
    for heads in (16, 32, 64, 128):
        row = ""
        for kind in KINDS.values():
            seen = {LETTER[pick(shape(heads=heads, batch=b, keys=t, **kind, **kw), backend)]
                    for b in (1, 8, 32) for t in (4096, 32768, 131072)}
            row += seen.pop() if len(seen) == 1 else f"[{''.join(sorted(seen))}]"
        rows.append(row)
    return " ".join(rows)


# (description, keyword arguments of `letters`, expected): per head count 16 32 64 128, the
# kinds plain / mask row / mask per head / causal
PINS = [
    ("H200 bf16 fused", dict(), "SSSS SSSS RRSR [ER][ER]W[ER]"),
    ("H200 bf16 two caches", dict(layout="sep512"), "SSSS SSSS RRSR [ER][ER]W[ER]"),
    ("H200 fp16 fused", dict(dtype="fp16"), "SSSS SSSS SSSW WWWW"),
    ("H200 fp16 two caches", dict(layout="sep512", dtype="fp16"), "SSSS SSSS SSSW WWWW"),
    ("H200 fp32: the checking mode", dict(dtype="fp32"), "TTTT TTTT TTTT TTTT"),
    ("fp32, runtime features' default", dict(dtype="fp32", backend=None), "SSSS SSSS SSSS SSSS"),
    ("fp32, backend 'triton'", dict(dtype="fp32", backend="triton"), "SSSS SSSS SSSS SSSS"),
    ("rows 8-aligned", dict(align="a8"), "SSSS SSSS LLSL LLWL"),
    ("two caches, rows 8-aligned", dict(layout="sep512", align="a8"), "SSSS SSSS LLSL LLWL"),
    ("rows 4-aligned", dict(align="a4"), "SSSS SSSS SSSW WWWW"),
    ("compute capability 8", dict(capability=8), "SSSS SSSS SSSW WWWW"),
    ("Triton 3.9", dict(triton="3.9.0"), "SSSS SSSS LLSL LLWL"),
    ("capability 8, Triton 3.9", dict(capability=8, triton="3.9.0"), "SSSS SSSS SSSW WWWW"),
    ("fp16, Triton 3.9", dict(dtype="fp16", triton="3.9.0"), "SSSS SSSS SSSW WWWW"),
    ("DCP_MLA_WIDE=0", dict(env="WIDE=0"), "SSSS SSSS RRSR [ER][ER]S[ER]"),
    ("DCP_MLA_WIDE=1", dict(env="WIDE=1"), "WWWW WWWW WWWW WWWW"),
    ("DCP_MLA_GLUON=0", dict(env="GLUON=0"), "SSSS SSSS SSSW WWWW"),
    ("fp16, DCP_MLA_WIDE=0", dict(dtype="fp16", env="WIDE=0"), "SSSS SSSS SSSS SSSS"),
    ("fp16, DCP_MLA_WIDE=1", dict(dtype="fp16", env="WIDE=1"), "WWWW WWWW WWWW WWWW"),
    ("runtime features' default", dict(backend=None), "SSSS SSSS RRSR [ER][ER]W[ER]"),
    ("backend 'triton'", dict(backend="triton"), "SSSS SSSS RRSR [ER][ER]W[ER]"),
    ("paged", dict(paged=True, backend="triton"), "SSSS SSSS SSSS SSSS"),
    ("paged fp16", dict(paged=True, dtype="fp16", backend="triton"), "SSSS SSSS SSSS SSSS"),
    ("128 + 32 columns", dict(layout="sep128"), "SSSS SSSS SSSS SSSS"),
    ("128 + 32 columns fp16", dict(layout="sep128", dtype="fp16"), "SSSS SSSS SSSS SSSS"),
    ("200 + 24 columns", dict(layout="fused200"), "SSSS SSSS SSSS SSSS"),
    ("2048 columns: no Triton kernel", dict(layout="fused2048"), "TTTT TTTT TTTT TTTT"),
    ("two query tokens", dict(tokens=2), "SSSS RRSR [ER][ER]W[ER] [ER][ER]W[ER]"),
]


@needs_gluon
@pytest.mark.parametrize("what, kw, expected", PINS, ids=[p[0] for p in PINS])
def test_the_chosen_kernel_is_pinned(monkeypatch, what, kw, expected):
    assert letters(monkeypatch, **kw) == expected


def test_registry_order_and_entries():
    assert list(registry.KERNELS) == ["gluon_seesaw", "gluon_roles", "gluon_lock_step", "gluon_fp8", "gluon_fp8_narrow",
                                      "wide", "split", "per_head", "flashinfer", "torch"]
    assert registry.TRITON_KERNELS == ATTENTION_BACKENDS["triton"].kernels
    assert {k: v.cost_key for k, v in registry.KERNELS.items()} == {
        "gluon_seesaw": "seesaw", "gluon_roles": "gluon", "gluon_lock_step": "gluon", "gluon_fp8": None,
        "gluon_fp8_narrow": None, "wide": "wide", "split": "split", "per_head": "per_head", "flashinfer": "flashinfer",
        "torch": None}
    # fp8 calls are chosen by timings on fp8 rows, under keys of their own
    assert {k: v.fp8_cost_key for k, v in registry.KERNELS.items() if v.fp8_cost_key} == {
        "gluon_fp8": "gluon_fp8", "gluon_fp8_narrow": "gluon_fp8_narrow", "wide": "wide_fp8", "split": "split_fp8"}
    assert tuple(k for k, v in registry.KERNELS.items() if v.replayable) == registry.TRITON_KERNELS
    for kernel in registry.KERNELS.values():  # every entry's module has the registry's functions
        impl = kernel.impl()
        assert callable(impl.supports) and callable(impl.run), kernel.name


@needs_gluon
def test_reasons_say_why():
    s = shape(heads=128)
    assert "one row per request" in registry.KERNELS["gluon_roles"].supports(dataclasses.replace(s, mask="full"))
    assert "multiples of 16" in registry.KERNELS["gluon_roles"].supports(dataclasses.replace(s, rows16=False))
    assert "Hopper" in registry.KERNELS["gluon_lock_step"].supports(dataclasses.replace(s, capability=8))
    assert "page pools" in registry.KERNELS["wide"].supports(dataclasses.replace(s, paged=True))
    assert "16-bit caches on CUDA" in registry.KERNELS["wide"].offered(dataclasses.replace(s, dtype=torch.float32))
    assert "fewer than 64 query rows" in registry.KERNELS["gluon_lock_step"].offered(dataclasses.replace(s, heads=16))
    assert "Triton 3.6" in registry.KERNELS["gluon_roles"].offered(dataclasses.replace(s, triton="3.9.0"))
    assert "1024 + 256" in registry.KERNELS["split"].supports(shape(layout="fused2048"))
    assert registry.KERNELS["torch"].supports(s) is None
    for name in ("gluon_roles", "gluon_lock_step", "wide", "split", "flashinfer"):  # not MLA kernels' calls
        assert "the per-head kernel" in registry.KERNELS[name].supports(dataclasses.replace(s, per_head=True))
        assert "torch reference only" in registry.KERNELS[name].supports(dataclasses.replace(s, offset_lens=True))
    assert "not an MLA latent cache" in registry.KERNELS["per_head"].supports(s)
    heads = dataclasses.replace(s, per_head=True, d_main=128, d_tail=0, v_dim=128, fused=False)
    assert "up to 256" in registry.KERNELS["per_head"].supports(dataclasses.replace(heads, d_main=320))
    assert "float16, bfloat16 or float32" in registry.KERNELS["per_head"].supports(
        dataclasses.replace(heads, dtype=torch.float64))
    assert "one dtype" in registry.KERNELS["per_head"].supports(dataclasses.replace(heads, same_dtypes=False))


@pytest.mark.parametrize("dtype, backend, expected", [
    ("bf16", "auto", "per_head"), ("fp16", "auto", "per_head"), ("bf16", "triton", "per_head"),
    ("bf16", None, "per_head"), ("fp32", "auto", "torch"), ("fp32", "triton", "per_head"), ("bf16", "torch", "torch"),
    ("bf16", "flashinfer", "torch"),
])
def test_per_head_calls_choose_the_per_head_kernel_on_cuda(monkeypatch, dtype, backend, expected):
    """GQA / MHA calls on CUDA: the per-head kernel for every head count, kind of call and
    size under "auto" and "triton" (fp32 "auto" is the reference's checking mode); the
    reference for "torch", and where nothing else takes the call."""
    for name in ("DCP_MLA_WIDE", "DCP_MLA_GLUON"):
        monkeypatch.delenv(name, raising=False)
    for heads in (8, 32, 128):
        for kind in KINDS.values():
            for tokens, batch, keys in ((1, 1, 4096), (4, 8, 32768), (1, 32, 131072)):
                s = shape("heads128", dtype=dtype, heads=heads, tokens=tokens, batch=batch, keys=keys, per_head=True,
                          **kind)
                assert pick(s, backend) == expected, (s.describe(), backend)
    big = dataclasses.replace(shape("heads128", per_head=True), d_main=512, v_dim=512)
    assert pick(big) == "torch"  # head dims past 256: the reference


@needs_gluon
def test_a_group_that_cannot_be_built_is_no_longer_offered(monkeypatch):
    monkeypatch.setattr(registry, "UNUSABLE", {})
    s = shape(heads=128)
    assert registry.choose(s, registry.TRITON_KERNELS).name == "gluon_roles"
    with pytest.warns(RuntimeWarning, match="not usable"):
        registry.mark_unusable(registry.KERNELS["gluon_roles"], RuntimeError("async_copy has been removed"))
    assert registry.UNUSABLE == {"gluon": "RuntimeError: async_copy has been removed"}
    assert registry.choose(s, registry.TRITON_KERNELS).name == "wide"  # both Gluon forms dropped
    assert registry.choose(dataclasses.replace(s, mask="row"), registry.TRITON_KERNELS).name == "wide"


def test_gluon_configs_name_their_kernels(monkeypatch):
    from dcp_pass.runtime.decode.kernels.gluon import common as gluon_common

    monkeypatch.setattr(gluon_common, "_on_triton_36", lambda: True)
    assert GluonConfig().kernels == ("gluon_roles", "gluon_lock_step")
    assert GluonConfig(schedule=Schedule.ROLE_SPLIT).kernels == ("gluon_roles", "gluon_lock_step")
    assert GluonConfig(64, 32, 3).kernels == ("gluon_lock_step",)  # not the role-split kernel's tiles
    assert GluonConfig(schedule=Schedule.TWO_BUFFERS).kernels == ("gluon_lock_step",)
    assert GluonConfig().lock_step_schedule() == GluonConfig(schedule=10).lock_step_schedule() == 6
    assert GluonConfig(schedule=2).lock_step_schedule() == 2
    assert GluonConfig().tag() == "gluon 64x64/8w/2s/v10"
    assert GluonConfig(schedule=6, q_reg=128).tag() == "gluon 64x64/8w/2s/v6/qreg128"
    assert GluonConfig().q_reg_for(masked=False) == 256 and GluonConfig().q_reg_for(masked=True) == 0
    monkeypatch.setattr(gluon_common, "_on_triton_36", lambda: False)
    assert GluonConfig().kernels == ("gluon_lock_step",)
    assert GluonConfig().lock_step_schedule() == 3 and GluonConfig().q_reg_for(masked=False) == 0
    assert GluonConfig.parse("64,64,2,10,0").schedule == Schedule.ROLE_SPLIT


def _cpu_call(T=16, pad=0, **kw):
    q = torch.zeros(2, 1, 4, 512)
    base = torch.zeros(2, T, 512 + pad)
    pe = kw.pop("pe", True)
    return AttentionCall(q if pe else torch.zeros(2, 1, 4, 576), torch.zeros(2, 1, 4, 64) if pe else None,
                         base[..., :512] if pe else torch.zeros(2, T, 576), torch.zeros(2, T, 64) if pe else None, 512,
                         0.1, **kw)


def test_call_shape_from_tensors():
    s = _cpu_call().shape
    assert (s.device, s.capability, s.dtype, s.batch, s.tokens, s.heads, s.keys) == ("cpu", None, torch.float32, 2, 1,
                                                                                      4, 16)
    assert (s.d_main, s.d_tail, s.v_dim, s.fused, s.mask, s.causal, s.gluon_aligned, s.rows16) == (
        512, 64, 512, False, "none", False, True, True)
    assert _cpu_call(pad=8).shape.rows16 is False and _cpu_call(pad=8).shape.gluon_aligned is True
    assert _cpu_call(pad=4).shape.gluon_aligned is False
    assert _cpu_call(mask=torch.zeros(2, 1, 1, 16)).shape.mask == "row"
    assert _cpu_call(mask=torch.zeros(2, 1, 4, 16)).shape.mask == "full"
    assert _cpu_call(q_pos=torch.zeros(2, 1), stripe=(2, 1)).shape.kind == "causal"
    fused = _cpu_call(pe=False).shape
    assert (fused.fused, fused.d_main, fused.d_tail) == (True, 512, 64)
    # the rank's view: a host count cuts the rows, a window start too; device counts keep them
    assert _cpu_call(kv_lens=11, stripe=(2, 1)).shape.keys == 5 and not _cpu_call(kv_lens=11).shape.lens
    window = _cpu_call(kv_lens=13, kv_start=4, stripe=(3, 2))  # rank 2 of 3 owns 5, 8, 11 in [4, 13)
    assert window.shard().first_row == 1 and window.shape.keys == 3
    assert _cpu_call(kv_lens=torch.tensor([7]), kv_start=4, stripe=(2, 0)).shape.offset_lens
    heads = AttentionCall(torch.zeros(2, 1, 4, 8), None, torch.zeros(2, 6, 2, 8), None, 5, 0.1, v=torch.zeros(2, 6, 2, 5))
    assert heads.shape.per_head and heads.shape.d_main == 8 and heads.shape.v_dim == 5


def test_explicit_kernels_refuse_calls_they_cannot_run():
    call = _cpu_call()
    with pytest.raises(AttentionBackendUnavailable, match="gluon_lock_step: it needs a Hopper GPU"):
        choose_kernel(call, "gluon_lock_step")
    assert choose_kernel(call, "gluon_lock_step", strict=False).name == "torch"
    assert choose_kernel(call, "auto").name == "torch"  # CPU: the reference


@needs_gluon
def test_fp8_calls_are_chosen_by_their_own_timings(monkeypatch):
    """An fp8 call compares the kernels' fp8 timings (split_fp8, wide_fp8, gluon_fp8), never
    their bf16 ones, and a bf16 call never the fp8 ones: a kernel's speed on packed fp8 rows
    is not its speed on bf16 rows (the two-GEMM kernel was 0.87 ms on bf16 and 1.40 on fp8
    at 128 heads, B=8, 128K)."""
    from dcp_pass.runtime.decode.kernels import path_table

    monkeypatch.setattr(registry, "UNUSABLE", {})
    monkeypatch.setattr(path_table, "MEASURED", (
        (128, 8, 131072, {"split": 1.1, "wide": 0.9, "gluon": 0.6, "split_fp8": 4.9, "wide_fp8": 1.4,
                          "gluon_fp8": 0.7}),
        (16, 8, 131072, {"split": 0.30, "wide": 0.6, "split_fp8": 0.44, "wide_fp8": 0.7}),
    ))
    path_table.fastest.cache_clear()
    try:
        s = dataclasses.replace(shape(layout="sep512", heads=128, batch=8, keys=131072), dtype=torch.float8_e4m3fn,
                                kv_quant="fp8_e4m3", query_dtype=torch.bfloat16)
        assert registry.choose(s, registry.TRITON_KERNELS).name == "gluon_fp8"
        assert registry.choose(dataclasses.replace(s, heads=16), registry.TRITON_KERNELS).name == "split"
        bf16 = shape(heads=128, batch=8, keys=131072)
        assert registry.choose(bf16, registry.TRITON_KERNELS).name == "gluon_roles"  # "gluon" 0.6: no fp8 key read
    finally:
        path_table.fastest.cache_clear()
