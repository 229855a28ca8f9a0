"""Static-shape decode (positions as a device tensor, whole-cache reads + mask).

This is the form CUDA-graph decode needs: every step has the same shapes, so one
compiled decode graph serves the whole run. The pass must keep it that way: writes
through `cache[:b, positions] = v` become a static-shape striped write, reads of the
whole cache become reads of the whole shard, and the mask is striped like the keys.
"""
import torch

from dcp_pass.testing import run_ranks
from kit.graphs import StaticPosMLA, _inputs


def _run(rank, world, configs):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch.set_grad_enabled(False)
    out = []
    for tp_size, inner in configs:
        torch._dynamo.reset()
        reference, model = StaticPosMLA(), StaticPosMLA()
        backend = DcpBackend(dcp_size=world, tp_size=tp_size, inner=inner)
        compiled = torch.compile(model, backend=backend)
        g = torch.Generator().manual_seed(11)
        steps = [list(range(0, 5))] + [[p] for p in range(5, 16)]  # prefill, then decode to capacity
        worst = 0.0
        for positions in steps:
            args = _inputs(positions, g)
            got, want = compiled(*args), reference(*args)
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        out.append((worst, len(backend.graphs), backend.report.summary()))
    return out


# head-replicated and head-sharded exchanges, one group for the three
CONFIGS = [(1, "aot_eager"), (2, "aot_eager"), (2, "inductor")]


def test_tensor_positions_one_decode_graph_and_exact():
    for rank_results in run_ranks(_run, 2, CONFIGS, timeout=300):
        for config, (worst, graphs, summary) in zip(CONFIGS, rank_results):
            assert worst < 1e-5, (config, worst, summary)
            assert "rewrote" in summary, (config, summary)
            assert graphs == 2, (config, summary)  # prefill + ONE decode graph for every later step


PROMPT = [[5, 7, 9, 11, 2], [1, 3, 3, 8, 6]]


def _decode(model, steps, tensor_positions):
    tokens = torch.tensor(PROMPT)
    logits, prev = [], 0
    for step in range(steps):
        start = torch.tensor(prev) if tensor_positions else prev
        out = model(tokens[:, prev:], start)
        logits.append(out.float())
        prev = tokens.shape[1]
        tokens = torch.cat([tokens, out.argmax(-1, keepdim=True)], 1)
    return tokens, torch.stack(logits)


def test_example_model_tensor_positions_equal_int_positions():
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    torch.set_grad_enabled(False)
    a = build_model(ModelArgs(max_seq_len=32), seed=2)
    b = build_model(ModelArgs(max_seq_len=32, positions="tensor"), seed=2)
    ta, la = _decode(a, 8, False)
    tb, lb = _decode(b, 8, True)
    assert torch.equal(ta, tb)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def _example_dcp(rank, world):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    torch.set_grad_enabled(False)
    model = build_model(ModelArgs(max_seq_len=32, positions="tensor", tp_size=world), rank=rank, seed=2)
    backend = DcpBackend(dcp_size=world, inner="aot_eager")
    tokens, logits = _decode(torch.compile(model, backend=backend), 10, True)
    torch._dynamo.reset()
    captured = []
    plain = build_model(ModelArgs(max_seq_len=32, positions="tensor", tp_size=world), rank=rank, seed=2)
    _decode(torch.compile(plain, backend=lambda gm, example: captured.append(gm) or gm.forward), 10, True)
    return tokens, logits, (len(backend.graphs), len(captured)), backend.report.summary()


def test_example_model_tensor_positions_under_dcp():
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    torch.set_grad_enabled(False)
    want_tokens, want_logits = _decode(build_model(ModelArgs(max_seq_len=32, positions="tensor"), seed=2), 10, True)
    for tokens, logits, graphs, summary in run_ranks(_example_dcp, 2, timeout=300):
        assert torch.equal(tokens, want_tokens), summary
        assert ((logits - want_logits).abs().max() / want_logits.abs().max()).item() < 1e-4
        assert "rewrote" in summary
        # exactly the graphs plain Dynamo captures: DCP adds no recompile as the context grows
        assert graphs[0] == graphs[1], (graphs, summary)
