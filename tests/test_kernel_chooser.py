"""The kernel chooser's trace (kernels/registry.py: select, SelectionTrace), the capabilities it
reads, the choices it keeps per layer, and the report line that shows them.

The chooser reads a call's CallShape, so most calls here are described, not built: MLA bf16
and per-head calls on an H200 (compute capability 9, Triton 3.6), fp32 caches (the checking
mode), fp8 latents, CPU calls, and the environment switches. Where the module's supports
decides (it needs Triton), the test says so and skips without it. The last test runs a small
model on two gloo ranks on CPU and reads the report.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dcp_pass.options import DcpOptionError, DcpOptions
from dcp_pass.runtime.decode import backends
from dcp_pass.runtime.decode.call import CallShape
from dcp_pass.runtime.decode.kernels import registry
from dcp_pass.runtime.decode.kernels.common import HAS_TRITON
from dcp_pass.runtime.decode.kernels.gluon.common import HAS_GLUON
from dcp_pass.testing import run_ranks

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the kernels' supports need Triton")
needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon")

MLA_KERNELS = ("gluon_seesaw", "gluon_roles", "gluon_lock_step", "gluon_fp8", "gluon_fp8_narrow", "wide", "split",
               "flashinfer")
MLA_BF16 = CallShape(heads=128, batch=8, keys=32768)  # DeepSeek's 512 + 64 fused cache, H200
PER_HEAD = CallShape(heads=32, batch=8, keys=32768, d_main=128, d_tail=0, v_dim=128, fused=False, per_head=True)
FP8 = CallShape(heads=128, batch=8, keys=32768, fused=False, dtype=torch.float8_e4m3fn, query_dtype=torch.bfloat16,
                kv_quant="fp8_e4m3")
CPU_FP32 = CallShape(device="cpu", capability=None, dtype=torch.float32, heads=4, keys=16)


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
    for name in ("DCP_MLA_WIDE", "DCP_MLA_GLUON"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(registry, "UNUSABLE", {})


def reasons(trace) -> dict:
    return {r.kernel: (r.kind, r.reason) for r in trace.rejections}


def check_accounts_for_every_candidate(trace):
    """Every kernel considered is the winner or rejected once, and the candidates keep registry order."""
    named = [r.kernel for r in trace.rejections] + [trace.winner]
    assert sorted(named) == sorted(trace.candidates), trace
    assert list(trace.candidates) == [n for n in registry.KERNELS if n in trace.candidates]


def test_cpu_call_runs_on_the_reference_and_says_why_not_the_others():
    trace = registry.select(CPU_FP32, "auto")
    assert trace.winner == "torch" and trace.candidates == registry.considered("auto")
    check_accounts_for_every_candidate(trace)
    others = ", ".join(n for n in registry.considered("auto") if n != "torch")
    assert trace.line() == (f"torch (auto: fallback, no other kernel takes the call; {others}: needs CUDA tensors, "
                            f"the call's are on cpu)")
    # the runtime features' default and a named backend that cannot run here: the reference
    assert registry.select(CPU_FP32, None).candidates == registry.considered(None)
    assert "flashinfer" not in registry.considered(None) and registry.considered("torch") == ("torch",)
    assert registry.select(CPU_FP32, "torch").why == "runs every call"


def test_fp32_caches_on_cuda_are_the_checking_mode():
    trace = registry.select(dataclasses.replace(MLA_BF16, dtype=torch.float32), "auto")
    assert trace.winner == "torch"
    why = reasons(trace)
    for name in ("gluon_seesaw", "gluon_roles", "gluon_lock_step"):
        assert why[name] == ("unsupported", "takes bfloat16 caches, not float32")
    assert why["gluon_fp8"] == ("unsupported", "reads fp8_e4m3 latent caches only")
    for name in ("wide", "split"):
        assert why[name] == ("not offered", "'auto' leaves float32 caches to the reference (the checking mode)")
    assert why["flashinfer"] == ("unsupported", "takes bfloat16/float16 caches, not float32")
    assert why["per_head"][1] == "reads per-head keys and values, not an MLA latent cache"


@needs_gluon
def test_mla_bf16_on_cuda(monkeypatch):
    from dcp_pass.runtime.decode.kernels import flashinfer_mla

    monkeypatch.setattr(flashinfer_mla, "_installed", lambda: True)  # its offer, not its installation
    trace = registry._select(MLA_BF16, registry.considered("auto"), "auto", "auto")
    check_accounts_for_every_candidate(trace)
    assert trace.winner in ("gluon_seesaw", "gluon_roles") and trace.why.startswith("fastest in the path table")
    assert trace.winner == registry.choose(MLA_BF16, registry.considered("auto")).name
    why = reasons(trace)
    assert why["per_head"] == ("unsupported", "reads per-head keys and values, not an MLA latent cache")
    assert why["gluon_fp8_narrow"] == ("unsupported", "reads fp8_e4m3 latent caches only")
    assert why["flashinfer"][0] == "not offered" and "sync" in why["flashinfer"][1]
    assert why["torch"] == ("not chosen", "fallback")
    assert {why[n] for n in ("wide", "split")} == {("slower", "by the path table")}
    roles = registry.select(dataclasses.replace(MLA_BF16, keys=4096), "auto")  # the role-split form measured faster
    assert roles.winner == "gluon_roles"
    assert reasons(roles)["gluon_lock_step"] == ("not chosen", "timed as gluon_roles, which comes first")
    assert trace.line().startswith(f"{trace.winner} (auto: fastest in the path table nearest 128 rows, B=8, 32768 keys")
    assert "; torch: fallback" in trace.line()
    # a named backend: its own kernels and the fallback
    named = registry.select(MLA_BF16, "triton")
    assert named.candidates == registry.TRITON_KERNELS + ("torch",) and named.winner == trace.winner


@needs_triton
def test_per_head_calls_on_cuda():
    trace = registry.select(PER_HEAD, "auto")
    check_accounts_for_every_candidate(trace)
    assert (trace.winner, trace.why) == ("per_head", "the only candidate")
    assert trace.line() == (f"per_head (auto: the only candidate; {', '.join(MLA_KERNELS)}: reads MLA latent caches, "
                            f"not per-head keys and values; torch: fallback)")
    big = dataclasses.replace(PER_HEAD, d_main=512, v_dim=512)  # past the kernel's 256 columns: its supports says
    assert registry.select(big, "auto").winner == "torch"
    assert "up to 256" in reasons(registry.select(big, "auto"))["per_head"][1]


def test_fp8_latents_only_reach_the_kernels_that_read_them():
    trace = registry.select(FP8, "auto")
    why = reasons(trace)
    for name in ("gluon_seesaw", "gluon_roles", "gluon_lock_step", "flashinfer"):
        assert why[name] == ("unsupported", "reads 16-bit caches, not an fp8_e4m3 latent"), name
    assert {n for n, k in registry.KERNELS.items() if k.caps.fp8_cache} == {"gluon_fp8", "gluon_fp8_narrow", "wide",
                                                                             "split", "torch"}
    assert backends.fp8_backends() == ("triton", "torch")
    if HAS_GLUON:
        assert trace.winner in ("gluon_fp8", "gluon_fp8_narrow", "wide", "split")
    with pytest.raises(DcpOptionError, match="attn_backend='flashinfer' reads 16-bit caches only; use attn_backend "
                                             "'auto', 'triton', 'torch'"):
        DcpOptions.from_mapping({"dcp_size": 2, "kv_cache_dtype": "fp8_e4m3", "attn_backend": "flashinfer"})


def test_environment_switches(monkeypatch):
    monkeypatch.setenv("DCP_MLA_GLUON", "0")
    monkeypatch.setenv("DCP_MLA_WIDE", "0")
    why = reasons(registry.select(MLA_BF16, "auto"))
    for name in ("gluon_seesaw", "gluon_roles", "gluon_lock_step"):
        assert why[name] == ("switched off", "DCP_MLA_GLUON=0"), name
    assert why["wide"] == ("switched off", "DCP_MLA_WIDE=0")
    assert "wide: switched off by DCP_MLA_WIDE=0" in registry.select(MLA_BF16, "auto").line()
    monkeypatch.setenv("DCP_MLA_WIDE", "1")  # the remembered choice does not outlive the switch
    trace = registry.select(MLA_BF16, "auto")
    if HAS_TRITON:
        assert (trace.winner, trace.why) == ("wide", "forced by DCP_MLA_WIDE=1")
        assert reasons(trace)["split"] == ("not chosen", "DCP_MLA_WIDE=1")
    assert registry.forced() == "wide"
    monkeypatch.delenv("DCP_MLA_WIDE")
    monkeypatch.delenv("DCP_MLA_GLUON")
    assert registry.forced() is None and "switched off" not in registry.select(MLA_BF16, "auto").line()


def test_a_group_that_failed_to_build_is_unusable_here(monkeypatch):
    monkeypatch.setattr(registry, "UNUSABLE", {"gluon": "RuntimeError: async_copy has been removed"})
    trace = registry.select(MLA_BF16, "auto")
    assert reasons(trace)["gluon_roles"] == ("unusable here", "RuntimeError: async_copy has been removed")
    assert "gluon_seesaw, gluon_roles, gluon_lock_step: unusable here (RuntimeError: async_copy" in trace.line()


@needs_triton
def test_capabilities_never_refuse_what_the_module_would_run():
    """The records are a coarse first look: on CUDA, whatever a record refuses, the kernel's own
    supports (or offered, or the old backend rules for fp32 under "auto") refuses as well, so
    reading them first changes no choice."""
    shapes = [MLA_BF16, PER_HEAD, FP8, CallShape(heads=16, dtype=torch.float16, paged=True),
              CallShape(mask="full"), CallShape(mask="row", causal=True), CallShape(offset_lens=True),
              CallShape(dtype=torch.float32), dataclasses.replace(PER_HEAD, dtype=torch.float16, mask="full")]
    for shape in shapes:
        for kernel in registry.KERNELS.values():
            if kernel.caps.reason(shape) is not None and kernel.name != "flashinfer":
                assert kernel.supports(shape) is not None, (kernel.name, shape.describe())


def test_backends_read_their_kernels_entries():
    table = backends.ATTENTION_BACKENDS
    assert table["triton"].kernels == registry.TRITON_KERNELS and "per_head" in registry.TRITON_KERNELS
    assert (table["triton"].lse_base, table["flashinfer"].lse_base, table["torch"].lse_base) == ("e", "2", "e")
    assert backends.attention_lse_base("auto") == "e"
    assert not table["flashinfer"].takes_mask and not table["flashinfer"].capturable
    assert table["triton"].available(torch.device("cpu")) == "needs CUDA tensors, the model is on cpu"
    assert table["torch"].available(torch.device("cpu")) is None
    for name, kernel in registry.KERNELS.items():
        assert kernel.caps.backend in table, name


def test_choices_are_kept_per_site_without_growing(monkeypatch):
    monkeypatch.setattr(registry, "LAST_SELECTIONS", type(registry.LAST_SELECTIONS)())
    cpu, fp32 = registry.select(CPU_FP32, "auto"), registry.select(dataclasses.replace(MLA_BF16, dtype=torch.float32))
    sites = [("report", -1, "layers.0.attn"), ("report", -1, "layers.1.attn")]
    with registry.collecting(sites):  # one graph call: its attention calls, in its layers' order
        registry.record(cpu)
        registry.record(fp32)
    assert [registry.trace_for(s) for s in sites] == [cpu, fp32]
    with registry.collecting(sites):  # replayed launches ran no chooser: the earlier choices stay
        pass
    with registry.collecting(sites):  # a count that does not match its layers: attributed to none
        registry.record(fp32)
    assert [registry.trace_for(s) for s in sites] == [cpu, fp32]
    registry.record(cpu)  # a call outside a compiled graph: kept by what was asked and the call
    assert registry.trace_for(("auto", CPU_FP32.describe())) is cpu
    for i in range(registry._SITES_SIZE + 10):
        with registry.collecting([("report", -1, f"layer{i}")]):
            registry.record(cpu)
    assert len(registry.LAST_SELECTIONS) == registry._SITES_SIZE
    assert all(isinstance(t, registry.SelectionTrace) for t in registry.LAST_SELECTIONS.values())


def test_report_line_before_any_call():
    from dcp_pass.report import DcpReport, GraphReport, LayerReport

    report = DcpReport(dcp_size=2)
    report.graphs.append(GraphReport(0, [LayerReport("layers.0.attn", True, "decode, attention auto")]))
    assert "rewrote layers.0.attn: decode, attention auto; kernel chosen at the first call" in report.summary()


def _two_layer_run(rank, world):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    args = ModelArgs(dtype=torch.float32, tp_size=1, max_seq_len=16, max_batch_size=2, n_layers=2, n_heads=4,
                     vocab_size=64, inter_dim=32, n_dense_layers=2)
    backend = DcpBackend(dcp_size=world, inner="aot_eager")
    model = torch.compile(build_model(args, rank=0, seed=3), backend=backend)
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :4], 0)
    for pos in (4, 5):
        model(tokens[:, pos:pos + 1], pos)
    return backend.report.summary()


@pytest.mark.slow
def test_report_names_the_kernel_each_layer_ran_on():
    """Two gloo ranks on CPU: each rewritten layer's line names the torch reference and why the
    others were not taken (CPU tensors), one line per layer."""
    for summary in run_ranks(_two_layer_run, 2, timeout=600):
        lines = [line for line in summary.splitlines() if line.strip().startswith("rewrote ")]
        assert lines, summary
        layers = {line.split(":")[0].split()[-1] for line in lines}
        assert len(layers) == 2, summary
        for line in lines:
            assert "; kernel torch (auto: fallback, no other kernel takes the call; gluon_seesaw" in line, line
            assert "per_head, flashinfer: needs CUDA tensors, the call's are on cpu)" in line, line
