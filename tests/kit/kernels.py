"""What the attention-kernel tests share: random MLA operands, poisoned outputs, the float64
reference of an AttentionCall, and the comparison every check uses.

Used both in pytest and in the interpreter worker (a kernel test file run as a script
under TRITON_INTERPRET=1, tests/ first on sys.path), so nothing here imports triton at
module level.
"""
from __future__ import annotations

import os

import torch

from dcp_pass.runtime.decode.call import AttentionCall

LOG2E = 1.4426950408889634
TOL = {torch.float32: 2e-5, torch.float16: 1e-2}


def gluon_kernel(name: str):
    """The kernel module `name` of dcp_pass.runtime.decode.kernels; skips the test where this
    Triton has no Gluon."""
    import importlib

    import pytest

    module = importlib.import_module(f"dcp_pass.runtime.decode.kernels.{name}")
    if not module.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    return module


def gen() -> torch.Generator:
    """A generator with a fresh random seed (every check draws new data)."""
    g = torch.Generator()
    g.manual_seed(int.from_bytes(os.urandom(4), "little"))
    return g


def make_inputs(B, S, H, Dl, Dr, T, dtype, device="cpu", fused=False, v_dim=None, gen=None):
    """Random MLA operands (q_lat, q_rope, kv, pe, v_dim). fused: kv has Dl + Dr columns and
    q_lat carries both parts."""
    g = gen
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)  # noqa: E731
    if fused:
        q_lat, kv = rnd(B, S, H, Dl + Dr), rnd(B, T, Dl + Dr)
        return q_lat, None, kv, None, (v_dim or Dl)
    return rnd(B, S, H, Dl), rnd(B, S, H, Dr), rnd(B, T, Dl), rnd(B, T, Dr), (v_dim or Dl)


def poisoned(B, S, H, v_dim, dtype, device):
    """Output buffers full of NaN: a row the kernel does not write stays NaN."""
    out = torch.full((B, S, H, v_dim), float("nan"), dtype=dtype, device=device)
    lse = torch.full((B, S, H), float("nan"), dtype=torch.float32, device=device)
    return out, lse


def global_counts(local: torch.Tensor, c: int, r: int) -> torch.Tensor:
    """Global key counts whose rank-r share (of c) is `local`: ((L - 1) c + r + 1, or 0)."""
    local = torch.as_tensor(local).long()
    return torch.where(local > 0, (local - 1) * c + r + 1, torch.zeros_like(local))


def ref64(call: AttentionCall):
    """float64 reference of a call: (out, lse_e) in float64."""
    from dcp_pass.runtime.decode.kernels.reference import reference_f64

    return reference_f64(call)


def ref32(call: AttentionCall):
    """fp32 reference of a call (what GPU checks compare bf16 kernels with): (out, lse_e)."""
    from dcp_pass.runtime.decode.kernels.reference import attention_impl

    return attention_impl(call.replace(lse_base="e"), torch.float32)


def rel_err(a, b):
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / max(den, 1e-30)


def check_close(out, lse, ref_out, ref_lse, tol, lse_base="e", lse_rel=None):
    """Outputs within `tol` (relative), the same empty rows (-inf LSE, output 0), the LSE within
    an absolute bound, or, with `lse_rel`, within lse_rel of its own size (at least 1): for kernels
    whose sums keep a fixed relative precision (fp8 tensor cores), where logits in the thousands
    move the LSE by units."""
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    assert not torch.isnan(lse).any(), "NaN LSE"
    if lse_base == "2":
        ref_lse = ref_lse * LOG2E
    err = rel_err(out, ref_out)
    assert err < tol, f"output rel err {err:.3e} >= {tol}"
    neg = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), neg), "empty rows differ (-inf LSE pattern)"
    if (~neg).any():
        diff = (lse.double()[~neg] - ref_lse[~neg]).abs()
        if lse_rel is None:
            assert diff.max().item() < max(tol, 1e-4) * 10, f"lse abs err {diff.max().item():.3e}"
        else:
            bound = lse_rel * ref_lse[~neg].abs().clamp(min=1.0)
            assert (diff <= bound).all(), f"lse err {diff.max().item():.3e} beyond {lse_rel} of its size"
    if neg.any():
        assert (out.double()[neg] == 0).all(), "empty rows must have output 0"


def merge(outs, lses):
    """The project's exact LSE merge over the first dim (base e), in float64."""
    from dcp_pass.runtime.decode.merge import merge_partials

    return merge_partials(outs, lses, "e", torch.float64, True)


def interpreter_tests(test_file: str, root: str, names: list):
    """The pytest side of a kernel test file's interpreter checks: a module fixture that runs
    the file once as an interpreter worker (dcp_pass.testing.interpreter) and one test per
    check name. Assign both in the test file: ``cpu_results, test_cpu_interpreter = ...``."""
    import pytest

    from dcp_pass.testing import interpreter

    @pytest.fixture(scope="module")
    def cpu_results():
        return interpreter.run_worker(test_file, root)

    @pytest.mark.parametrize("name", names)
    def test_cpu_interpreter(cpu_results, name):
        res = cpu_results[name]
        assert res["ok"], res["msg"]

    return cpu_results, test_cpu_interpreter


def fp8_call(B, S, H, Dl, Dr, T, dtype, device="cpu", gen=None, spread=4.0, **call_kwargs) -> AttentionCall:
    """An MLA call over an fp8 latent cache (its per-block scales in ``kv_scale``), quantised from
    random values whose rows span `spread` decades of magnitude (so blocks get different scales)."""
    from dcp_pass.runtime.decode.kv_format import quantize

    g = gen
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    magnitude = 10 ** (spread * (torch.rand(B, T, 1, generator=g) - 0.5))
    kv8, scales = quantize(rnd(B, T, Dl) * magnitude)
    q_lat, q_rope, pe = rnd(B, S, H, Dl), rnd(B, S, H, Dr), rnd(B, T, Dr)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    call_kwargs.setdefault("scale", 0.5 / (Dl + Dr) ** 0.5)
    return AttentionCall(to(q_lat), to(q_rope), kv8.to(device), to(pe), Dl, kv_scale=scales.to(device), **call_kwargs)


def packed_fp8_call(B, S, H, T, device="cpu", lens=None, separate=False, gen=None, dtype=torch.bfloat16) -> AttentionCall:
    """q [B, S, H, 576] split into its parts over an fp8 cache as the fp8 Gluon kernels read it:
    FlashMLA's packed 656-byte rows (or a 528-byte latent row and a rope buffer) through their
    views, DeepSeek-V3's scale."""
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, pack, views

    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)  # noqa: E731
    q = rnd(B, S, H, 576)
    kv = rnd(B, T, 576)
    if separate:
        latent, scales, _ = views(pack(kv[..., :512], Fp8Layout(512, 0, dtype)), Fp8Layout(512, 0, dtype))
        rope = kv[..., 512:].contiguous()
    else:
        latent, scales, rope = views(pack(kv, Fp8Layout(512, 64, dtype)), Fp8Layout(512, 64, dtype))
    return AttentionCall(q[..., :512], q[..., 512:], latent, rope, 512, 192 ** -0.5, kv_lens=lens, kv_scale=scales)


def decode_mask_rows(B: int, T: int, device) -> list:
    """A decode step's additive mask row per request, [B, 1, 1, T] (B >= 3): request 0 sees its
    first 2000 keys, request 1 every key with every 7th at -3, request 2 none (its output must
    be 0 and its LSE -inf); then the same values as every other column of a wider row (key
    stride 2: a kernel copying the row with its tiles must follow the stride)."""
    mask = torch.zeros(B, 1, 1, T, device=device)
    mask[0, ..., 2000:] = float("-inf")
    mask[1, ..., ::7] = -3.0
    mask[2] = float("-inf")
    wide = torch.full((B, 1, 1, 2 * T), 7.0, device=device)
    wide[..., ::2] = mask
    return [mask, wide[..., ::2]]


def last_positions(glens: torch.Tensor, S: int) -> torch.Tensor:
    """The query positions of S tokens that end each request's global count (a verify or
    prefill chunk's rows: token s of request b at glens[b] - S + s), [B, S]."""
    return glens.view(-1, 1) - S + torch.arange(S, device=glens.device).view(1, S)


def poison_fp8_rows(call: AttentionCall, local) -> None:
    """An fp8 call's cache rows past each request's visible keys (`local`, per request) made NaN
    in place: latent bytes e4m3 0x7f, scales and rope NaN (a kernel must not read them)."""
    kv, ks, pe = call.kv.view(torch.uint8), call.kv_scale, call.pe
    for b, n in enumerate(torch.as_tensor(local).tolist()):
        kv[b, n:] = 0x7F
        ks[b, n:] = float("nan")
        pe[b, n:] = float("nan")


# a CallShape change each fp8 Gluon kernel refuses, and words of its reason (their shared
# checks, kernels.gluon.common.fp8_gluon_reason)
FP8_GLUON_REFUSALS = {
    "reads fp8_e4m3": dict(kv_quant="", dtype=torch.bfloat16),
    "Hopper": dict(capability=8),
    "page pools": dict(paged=True),
    "bfloat16 queries": dict(query_dtype=torch.float16),
    "512 latent": dict(d_main=256),
    "row strides of 8k": dict(gluon_aligned=False),
    "the per-head kernel": dict(per_head=True),
}
