"""Float64 references, inputs and comparisons shared by the attention-kernel tests.

Used both in pytest and in the interpreter worker (a kernel test file run as a script
under TRITON_INTERPRET=1), so nothing here imports triton at module level.
"""
from __future__ import annotations

import os

import torch


LOG2E = 1.4426950408889634


def _mod():
    from dcp_pass.runtime.decode.kernels import mla_attention as m

    return m


def ref64(q_lat, q_rope, kv, pe, v_dim, scale, mask=None, kv_lens=None, causal=None):
    """float64 reference: (out, lse_e) in float64."""
    m = _mod()
    d = lambda t: None if t is None else t.double()  # noqa: E731
    return m._reference_impl(d(q_lat), d(q_rope), d(kv), d(pe), v_dim, scale, None if mask is None else mask.double(),
                             kv_lens, causal, torch.float64)


def rel_err(a, b):
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / max(den, 1e-30)


def check_close(out, lse, ref_out, ref_lse, tol, lse_base="e"):
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    assert not torch.isnan(lse).any(), "NaN LSE"
    if lse_base == "2":
        ref_lse = ref_lse * LOG2E
    err = rel_err(out, ref_out)
    assert err < tol, f"output rel err {err:.3e} >= {tol}"
    neg = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), neg), "empty rows differ (-inf LSE pattern)"
    if (~neg).any():
        lerr = (lse.double()[~neg] - ref_lse[~neg]).abs().max().item()
        assert lerr < max(tol, 1e-4) * 10, f"lse abs err {lerr:.3e}"
    if neg.any():
        assert (out.double()[neg] == 0).all(), "empty rows must have output 0"


def poisoned(B, S, H, v_dim, dtype, device):
    out = torch.full((B, S, H, v_dim), float("nan"), dtype=dtype, device=device)
    lse = torch.full((B, S, H), float("nan"), dtype=torch.float32, device=device)
    return out, lse


def make_inputs(B, S, H, Dl, Dr, T, dtype, device="cpu", fused=False, v_dim=None, gen=None):
    """Random MLA operands. fused: kv has Dl + Dr columns and q_lat carries both parts."""
    g = gen
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)  # noqa: E731
    if fused:
        q_lat, kv = rnd(B, S, H, Dl + Dr), rnd(B, T, Dl + Dr)
        return q_lat, None, kv, None, (v_dim or Dl)
    return rnd(B, S, H, Dl), rnd(B, S, H, Dr), rnd(B, T, Dl), rnd(B, T, Dr), (v_dim or Dl)


def local_merge(outs, lses):
    """Exact LSE merge over the first dim (base e), float64."""
    lses = lses.double()
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lses - safe)
    w = torch.where(torch.isneginf(lses), torch.zeros_like(w), w)
    return (w.unsqueeze(-1) * outs.double()).sum(0), lse


def merge(outs, lses):
    """Use the project's merge_partials when it exists, else the local one."""
    try:
        from dcp_pass.runtime.decode.merge import merge_partials
    except Exception:
        return local_merge(outs, lses)
    o, lse = merge_partials(outs, lses, "e", torch.float64, True)
    return o, lse


TOL = {torch.float32: 2e-5, torch.float16: 1e-2}


def _gen():
    """A generator with a fresh random seed (every check draws new data)."""
    g = torch.Generator()
    g.manual_seed(int.from_bytes(os.urandom(4), "little"))
    return g
