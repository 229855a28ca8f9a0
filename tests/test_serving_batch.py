"""A ragged batch written the way serving code writes it (kit/serving.py): per-row prefill
`cache[row:row + 1, :s] = v` and per-request decode positions `cache[arange(B), pos] = v`
over the whole cache under a per-request mask, rewritten and exact on real gloo ranks.

Prompts are ragged, one shorter than c (some ranks hold none of its rows after its
prefill); greedy fp32 tokens must equal the model without DCP over 9 decode steps, every
graph of every rank rewritten, every rank compiling as many graphs as plain Dynamo does.
"""
from __future__ import annotations

import pytest

from dcp_pass.testing import run_ranks

PROMPTS = [[5, 7, 9, 11, 2, 3], [1], [3, 4], [8, 8, 1, 4, 6]]
STEPS = 9
PLAIN_GRAPHS = 4


def _rank(rank, world, fused, inner):
    import torch
    import torch._dynamo
    from kit.serving import ServingMLA, serve

    from dcp_pass.backend import DcpBackend
    from dcp_pass.state import store

    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    want_tokens, want_logits = serve(ServingMLA(layers=1, fused=fused), PROMPTS, STEPS)
    model = ServingMLA(layers=1, fused=fused)
    backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner)
    got_tokens, got_logits = serve(torch.compile(model, backend=backend), PROMPTS, STEPS)
    report = backend.report
    return {
        "rel": max(((g - w).abs().amax() / w.abs().amax()).item() for g, w in zip(got_logits, want_logits)),
        "tokens_equal": got_tokens == want_tokens,
        "graphs": len(report.graphs),
        "all_rewritten": all(g.rewritten == 1 for g in report.graphs),
        "kv": (report.kv_bytes_full, report.kv_bytes_local),
        "released": all(store.is_released(b) for a in model.attn for b in a.buffers()),
        "summary": report.summary(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world, fused, inner", [(2, False, "aot_eager"), (4, True, "aot_eager")])
def test_per_row_prefill_and_per_request_decode_exact(world, fused, inner):
    results = run_ranks(_rank, world, fused, inner, timeout=600)
    # what plain Dynamo captures: prefill of 6 tokens, of 1, of any length, the decode step
    assert [r["graphs"] for r in results] == [PLAIN_GRAPHS] * world, [r["graphs"] for r in results]
    for r in results:
        assert r["tokens_equal"] and r["rel"] < 1e-5, (r["rel"], r["summary"])
        assert r["all_rewritten"] and r["released"], r["summary"]
        full, local = r["kv"]
        assert 0 < local * world <= full * 1.2, r["summary"]
