"""Option fast_path: at dcp_size=1 the pass still puts MLA attention on its attention op
(no process group, no exchange), exact; without it dcp_size=1 leaves every graph unchanged."""
from __future__ import annotations

import pytest
import torch

from dcp_pass.backend import DcpBackend
from dcp_pass.models.deepseek_mla import ModelArgs, build_model
from dcp_pass.models.generate import greedy_generate

PROMPTS = [[5, 7, 9, 2], [1, 2]]
ARGS = ModelArgs(max_seq_len=32, tp_size=1, n_layers=2, n_dense_layers=2)


def _targets(gm) -> set:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@torch.no_grad()
def test_fast_path_at_dcp1_is_exact_and_exchanges_nothing(inner):
    torch._dynamo.reset()
    want_tokens, want_logits = greedy_generate(build_model(ARGS, seed=2), PROMPTS, 6)
    backend = DcpBackend(dcp_size=1, tp_size=1, inner=inner, fast_path=True)
    tokens, logits = greedy_generate(torch.compile(build_model(ARGS, seed=2), backend=backend), PROMPTS, 6)
    assert tokens == want_tokens
    rel = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(logits, want_logits))
    assert rel < 1e-5, rel
    assert backend.report.layers_rewritten == 2
    for gm in backend.graphs:
        targets = _targets(gm)
        assert "dcp.mla_local_attention.default" in targets
        assert not any("exchange" in t or "_c10d" in t for t in targets), targets
    torch._dynamo.reset()


@torch.no_grad()
def test_dcp1_without_fast_path_changes_nothing():
    torch._dynamo.reset()
    backend = DcpBackend(dcp_size=1, tp_size=1, inner="eager")
    greedy_generate(torch.compile(build_model(ARGS, seed=2), backend=backend), PROMPTS, 2)
    assert backend.report.layers_rewritten == 0
    assert all(g.unchanged_reason == "dcp_size=1" for g in backend.report.graphs)
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["mqa_matmul", "paged", "window"])
@torch.no_grad()
def test_fast_path_with_device_positions_on_each_cache_layout(form):
    """The position moves to the device (the CUDA default) on a 4-D cache, a pool, a window."""
    from dcp_pass.models.mla_forms import FormArgs, build_forms_model

    torch._dynamo.reset()
    args = FormArgs(form=form, n_layers=1)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    backend = DcpBackend(dcp_size=1, tp_size=1, inner="aot_eager", fast_path=True, static_positions=True)
    models = (build_forms_model(args, seed=3), torch.compile(build_forms_model(args, seed=3), backend=backend))
    outs = [[m(tokens[:, :6], 0)] + [m(tokens[:, p:p + 1], p) for p in range(6, 12)] for m in models]
    for want, got in zip(*outs):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    notes = [n for g in backend.report.graphs for n in g.notes]
    assert any("moved to the device" in n for n in notes) or form == "window", notes
    torch._dynamo.reset()
