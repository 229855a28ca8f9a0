"""Reference-style models (int `start_pos`, slice writes and reads) decode with one
static-shape graph: the step position becomes device data (rewrites/positions.py).

Without it every decode step passes a new int to the compiled graph, and inductor's
CUDA graphs, which key recordings on int inputs, re-record at every step. Here a
64-step decode must run on one compiled decode graph that takes no int input, with
logits equal to the model without DCP.
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass import env
from dcp_pass.testing import run_ranks

PROMPT, STEPS, BATCH = 5, 66, 2


def _model(tp, rank, dense):
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    args = ModelArgs(tp_size=tp, max_seq_len=96, max_batch_size=BATCH, n_layers=2,
                     n_dense_layers=2 if dense else 1)
    return build_model(args, rank=rank, seed=3)


def _tokens():
    return torch.randint(0, 128, (BATCH, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))


def _drive(model):
    tokens = _tokens()
    out = [model(tokens[:, :PROMPT], 0)]
    out += [model(tokens[:, p:p + 1], p) for p in range(PROMPT, PROMPT + STEPS)]
    return torch.stack([o.float() for o in out])


def _rank_fn(rank, world, configs):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch.set_grad_enabled(False)
    out = []
    for cfg in configs:
        torch._dynamo.reset()
        backend = DcpBackend(dcp_size=world, inner=cfg["inner"], static_positions=True)
        logits = _drive(torch.compile(_model(world, rank, cfg["dense"]), backend=backend))
        moved = [g for g in backend.report.graphs if "moved to the device" in " ".join(g.notes)]
        symbolic_inputs = [
            [n.name for n in gm.graph.find_nodes(op="placeholder")
             if isinstance(n.meta.get("example_value"), torch.SymInt)] for gm in backend.graphs]
        out.append(dict(logits=logits, graphs=len(backend.graphs), moved=len(moved),
                        symbolic_inputs=symbolic_inputs, summary=backend.report.summary()))
    return out


# What is checked of the graphs (how many, the position moved, no int input) is the pass's
# output, the same under either inner compiler; inductor running a moved position is
# test_grad_and_inference_mode's (tensor-parallel, static_positions) in CI, and here under
# DCP_TEST_FULL=1 (a minute of C++ builds on two cores).
CONFIGS = [dict(inner="aot_eager", dense=True), dict(inner="aot_eager", dense=False)] + (
    [dict(inner="inductor", dense=True)] if env.full_tests() else [])


@pytest.mark.slow
def test_int_position_decode_is_one_static_graph_and_exact():
    results = run_ranks(_rank_fn, 2, CONFIGS, timeout=900)
    for index, cfg in enumerate(CONFIGS):
        with torch.no_grad():
            want = _drive(_model(1, 0, cfg["dense"]))
        for rank in range(2):
            r = results[rank][index]
            err = ((r["logits"] - want).abs().amax() / want.abs().amax()).item()
            assert err < 1e-4, (cfg, rank, err)
            if cfg["dense"]:
                # prefill (start 0), then ONE graph for all 66 decode steps (the start
                # changed, so Dynamo made it symbolic at once), with no int input
                assert r["graphs"] == 2, r["summary"]
                assert r["moved"] == 1, r["summary"]
                assert r["symbolic_inputs"][-1] == [], r["symbolic_inputs"]
            else:
                # the MoE model breaks into several graphs; every symbolic one with the
                # position as its only int input is moved
                assert r["moved"] >= 1, r["summary"]
