"""fp64 models under DCP: exact to fp64 rounding, every comm path.

In the packed all-to-all an fp64 output carries its LSE as one fp64 column (converted,
exact), the shard-local attention returns an fp64 LSE for fp64 queries, and the merge
(a2a, ag_rs and head-replicated) runs in fp64.

The eager example model computes its attention softmax with `dtype=torch.float32`
(DeepSeek's reference code does), so an fp64 eager run rounds its attention
probabilities to fp32 (~1e-7 relative in the logits); the DCP op computes them in
fp64. The 1e-12 comparison is therefore against the same eager model with that one
softmax in fp64; the unmodified eager model is checked at fp32-rounding tolerance.
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass import env
from dcp_pass.runtime.decode.merge import merge_packed, merge_partials, pack_output_lse, unpack_output_lse
from dcp_pass.testing import run_ranks

PROMPTS = [[5, 7, 9, 11, 2], [1], [3, 4], [8, 8, 1]]
STEPS = 8
MAX_SEQ = 24
N_LAYERS = 2


def test_fp64_pack_round_trip_and_merge_is_fp64():
    g = torch.Generator().manual_seed(3)
    o = torch.randn(3, 5, 4, 7, generator=g, dtype=torch.float64)
    lse = torch.randn(3, 5, 4, generator=g, dtype=torch.float64) * 4
    lse[0, 0, 0] = float("-inf")
    packed = pack_output_lse(o, lse)
    assert packed.dtype == torch.float64 and packed.shape[-1] == 8
    o2, lse2 = unpack_output_lse(packed, 7)
    assert torch.equal(o2, o) and torch.equal(lse2, lse) and lse2.dtype == torch.float64
    # an fp32 LSE converts exactly into the fp64 column
    lse32 = lse.float()
    assert torch.equal(unpack_output_lse(pack_output_lse(o, lse32), 7)[1], lse32.double())
    # the merge runs in fp64: against a merge written out in fp64 by hand
    out, lse_m = merge_packed(packed, 7, "e", return_lse=True)
    assert out.dtype == torch.float64 and lse_m.dtype == torch.float64
    want_lse = torch.logsumexp(lse, dim=0)
    want = (torch.exp(lse - want_lse).unsqueeze(-1) * o).sum(0)
    torch.testing.assert_close(out, want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(lse_m, want_lse, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(merge_partials(o, lse), want, rtol=1e-14, atol=1e-14)


def _build(tp: int, rank: int):
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    # all-dense: one graph per call shape (the MoE loop's graph breaks only add compiles,
    # under inductor each a round of C++ builds)
    args = ModelArgs(dtype=torch.float64, tp_size=tp, max_seq_len=MAX_SEQ, n_layers=N_LAYERS, n_dense_layers=N_LAYERS)
    return build_model(args, rank=rank, seed=1)


def _forced_logits(model, tokens: list[list[int]]) -> torch.Tensor:
    """greedy_generate's call pattern fed `tokens` (prompt + generated); raw fp64 logits."""
    lens = [len(p) for p in PROMPTS]
    rows = [p + t for p, t in zip(PROMPTS, tokens)]
    x = torch.tensor([r + [0] * (max(map(len, rows)) - len(r)) for r in rows])
    out, prev = [], 0
    with torch.no_grad():
        for cur in range(min(lens), max(lens) + STEPS):
            out.append(model(x[:, prev:cur], prev).clone())
            prev = cur
    return torch.stack(out)


# inductor under DCP_TEST_FULL=1: its check is the fp32-rounding bound below, which the
# aot_eager runs meet a million times over (about 40 s of fp64 C++ builds on two cores)
CONFIGS = [
    dict(tp=2, comm=None, inner="aot_eager"),  # default comm: packed all-to-all
    dict(tp=1, comm=None, inner="aot_eager"),  # unsharded: head-replicated all-gather + merge
    dict(tp=2, comm="ag_rs", inner="aot_eager"),
] + ([dict(tp=2, comm=None, inner="inductor")] if env.full_tests() else [])


def _rank_fn(rank, world, tokens, configs):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch.set_grad_enabled(False)
    out = []
    for cfg in configs:
        torch._dynamo.reset()
        tp = cfg["tp"]
        model = _build(tp, rank if tp > 1 else 0)
        backend = DcpBackend(dcp_size=world, tp_size=tp, inner=cfg["inner"], comm_backend=cfg["comm"])
        logits = _forced_logits(torch.compile(model, backend=backend), tokens)
        out.append((logits, backend.report.layers_rewritten))
    return out


def _fp64_attention_softmax(monkeypatch):
    """The eager model with its attention softmax ([b, s, h, t] scores) in fp64."""
    original = torch.Tensor.softmax

    def softmax(self, dim, dtype=None):
        if self.dtype == torch.float64 and self.dim() == 4:
            dtype = torch.float64
        return original(self, dim, dtype=dtype)

    monkeypatch.setattr(torch.Tensor, "softmax", softmax)


@pytest.mark.slow
def test_fp64_model_c2_equals_eager_fp64(monkeypatch):
    from dcp_pass.models.generate import greedy_generate

    tokens, _ = greedy_generate(_build(1, 0), PROMPTS, STEPS)
    plain = _forced_logits(_build(1, 0), tokens)
    results = run_ranks(_rank_fn, 2, tokens, CONFIGS, timeout=900)
    _fp64_attention_softmax(monkeypatch)
    exact = _forced_logits(_build(1, 0), tokens)
    for index, cfg in enumerate(CONFIGS):
        for rank_results in results:
            got, rewritten = rank_results[index]
            assert rewritten >= N_LAYERS, (cfg, rewritten)
            assert got.dtype == torch.float64
            rel = ((got - exact).abs().amax() / exact.abs().amax()).item()
            # inductor fuses away the model's own fp32 round trips (the rotary's): plain
            # inductor without DCP is ~1e-7 from eager fp64 on this model
            assert rel < (1e-12 if cfg["inner"] == "aot_eager" else 1e-6), (cfg, rel)
            rel_plain = ((got - plain).abs().amax() / plain.abs().amax()).item()
            assert rel_plain < 1e-5, (cfg, rel_plain)
