"""No compiled graph and no eager code ever touches a cache buffer's released storage.

* A graph compiled before a cache was striped (here: an MHA prefill that writes the
  latent caches but attends over the chunk's own per-head keys, as DeepSeek-V3.2 and
  vLLM's MLA prefill) is compiled again once the decode graph stripes the caches, and
  the new compile stripes its writes: several requests of equal and different lengths
  decode equal to eager (the old graph would write the released storage: SIGSEGV under
  inductor).
* Eager torch calls on a striped buffer raise DcpCacheError naming it; its metadata
  stays readable and the compiled model keeps working.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dcp_pass import env
from dcp_pass.state.guards import StripedCacheTensor
from dcp_pass.state.store import DcpCacheError
from dcp_pass.testing import run_ranks

DIM, HEADS, NOPE, ROPE, V, RANK, MAX_B, MAX_S = 32, 2, 8, 8, 8, 16, 2, 32


class PrefillMhaMLA(nn.Module):
    """MLA with an MHA prefill (writes the caches, attends over the chunk's own K/V) and an
    absorbed decode over the caches."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wq = nn.Parameter(torch.randn(HEADS * (NOPE + ROPE), DIM, generator=g) / DIM**0.5)
        self.wkv_a = nn.Parameter(torch.randn(RANK + ROPE, DIM, generator=g) / DIM**0.5)
        self.wkv_b = nn.Parameter(torch.randn(HEADS * (NOPE + V), RANK, generator=g) / RANK**0.5)
        self.wo = nn.Parameter(torch.randn(DIM, HEADS * V, generator=g) / (HEADS * V) ** 0.5)
        self.register_buffer("kv_cache", torch.zeros(MAX_B, MAX_S, RANK), persistent=False)
        self.register_buffer("pe_cache", torch.zeros(MAX_B, MAX_S, ROPE), persistent=False)
        self.scale = (NOPE + ROPE) ** -0.5

    def forward(self, x, start_pos: int, mask):
        bsz, seqlen, _ = x.shape
        end_pos = start_pos + seqlen
        q = (x @ self.wq.T).view(bsz, seqlen, HEADS, NOPE + ROPE)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        kv, k_pe = torch.split(x @ self.wkv_a.T, [RANK, ROPE], dim=-1)
        self.kv_cache[:bsz, start_pos:end_pos] = kv
        self.pe_cache[:bsz, start_pos:end_pos] = k_pe
        if mask is not None:
            kv = (kv @ self.wkv_b.T).view(bsz, seqlen, HEADS, NOPE + V)
            k_nope, v = torch.split(kv, [NOPE, V], dim=-1)
            k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, HEADS, -1)], dim=-1)
            scores = torch.einsum("bshd,bthd->bsht", q, k) * self.scale
            scores += mask.unsqueeze(1)
            o = torch.einsum("bsht,bthd->bshd", scores.softmax(dim=-1, dtype=torch.float32), v)
        else:
            wkv_b = self.wkv_b.view(HEADS, -1, RANK)
            q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :NOPE])
            scores = (torch.einsum("bshc,btc->bsht", q_nope, self.kv_cache[:bsz, :end_pos])
                      + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end_pos])) * self.scale
            o = torch.einsum("bsht,btc->bshc", scores.softmax(dim=-1, dtype=torch.float32),
                             self.kv_cache[:bsz, :end_pos])
            o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, -V:])
        return o.flatten(2) @ self.wo.T


def _request(model, xs, prompt):
    mask = torch.full((prompt, prompt), float("-inf")).triu_(1)
    outs = [model(xs[:, :prompt], 0, mask)]
    for p in range(prompt, xs.size(1)):
        outs.append(model(xs[:, p:p + 1], p, None))
    return outs


def _requests(rank, world, inner):
    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    prompts = [8, 8, 5, 8]  # the same length again, another length, then the first again
    inputs = [torch.randn(MAX_B, 12, DIM, generator=g) for _ in prompts]
    eager = PrefillMhaMLA()
    compiled = torch.compile(PrefillMhaMLA(), backend="dcp", options={"dcp_size": world, "tp_size": 1, "inner": inner})
    worst = 0.0
    for xs, prompt in zip(inputs, prompts):
        for got, want in zip(_request(compiled, xs, prompt), _request(eager, xs, prompt)):
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    model = compiled._orig_mod
    return worst, type(model.kv_cache) is StripedCacheTensor


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["aot_eager"] + (["inductor"] if env.full_tests() else []))
def test_prefill_graph_compiled_before_striping_is_compiled_again(inner):
    for worst, striped in run_ranks(_requests, 2, inner):
        assert striped
        assert worst < 1e-5, worst


@torch.no_grad()
def test_eager_calls_on_a_striped_buffer_raise_and_metadata_stays(fake_world):
    from dcp_pass.backend import DcpBackend

    model = PrefillMhaMLA()
    compiled = torch.compile(model, backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
    x = torch.randn(MAX_B, 1, DIM)
    compiled(x, 0, None)
    buffer = model.kv_cache
    assert type(buffer) is StripedCacheTensor
    assert buffer.shape == (MAX_B, MAX_S, RANK) and buffer.dtype == torch.float32 and buffer.dim() == 3
    for touch in (lambda t: t.sum(), lambda t: t[:, 0], lambda t: t.zero_(), lambda t: torch.cat([t, t]),
                  lambda t: t + 1, lambda t: t.clone()):
        with pytest.raises(DcpCacheError, match="kv_cache"):
            touch(buffer)
    compiled(x, 1, None)  # the compiled model keeps working
