"""Every rank compiles the same graphs, and chunked multi-token calls stay exact.

Calls at a varying start with several tokens (chunked prefill, k+1-token
verification) take the symbolic-start write and a symbolic key count through the
inner compiler. Two failure modes are pinned here:
* a guard that depends on the rank (e.g. on the rank's own key count) makes one rank
  recompile where another does not, and the compile-time collectives of the next
  compile then pair with the wrong peer (gloo aborts, or both ranks hang);
* a write window too short for c >= 3 silently drops tokens.
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass import env
from dcp_pass.testing import run_ranks

# (start, tokens) per call: 1-token prefill, 2-token chunks at varying starts, a
# 3-token chunk, then decode steps (the dense and MoE blocks are one frame whose
# shapes vary per call: the recompile limit is raised as a chunked-prefill user would)
CALLS = [(0, 1), (1, 2), (3, 2), (5, 2), (7, 3)] + [(p, 1) for p in range(10, 20)]
BATCH, MAX_SEQ = 3, 40


def _model(dtype, tp, rank, dense=False):
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    # sizes divisible by TP 1..4; dense: no MoE, the whole forward is one graph
    args = ModelArgs(dtype=dtype, tp_size=tp, max_seq_len=MAX_SEQ, max_batch_size=BATCH, n_layers=2, n_heads=12,
                     vocab_size=132, inter_dim=96, n_routed_experts=12, moe_inter_dim=24,
                     n_dense_layers=2 if dense else 1)
    return build_model(args, rank=rank, seed=7)


def _tokens():
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 132, (BATCH, MAX_SEQ), generator=g)


def _drive(model):
    tokens = _tokens()
    return [model(tokens[:, s:s + n], s, all_logits=True).float() for s, n in CALLS]


def _rank_fn(rank, world, configs):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    torch.set_grad_enabled(False)
    torch._dynamo.config.recompile_limit = 64
    out = []
    for cfg in configs:
        torch._dynamo.reset()
        tp = cfg["tp"]
        model = _model(cfg["dtype"], tp, rank if tp > 1 else 0, cfg.get("dense", False))
        backend = DcpBackend(dcp_size=world, tp_size=tp, inner=cfg["inner"])
        compiled = torch.compile(model, backend=backend)
        logits = _drive(compiled)
        out.append({"graphs": len(backend.report.graphs), "logits": torch.cat([x.flatten() for x in logits]),
                    "summary": backend.report.summary()})
    return out


def _reference(dtype, dense):
    with torch.no_grad():
        return torch.cat([x.flatten() for x in _drive(_model(dtype, 1, 0, dense))])


def _check(results, configs):
    for index, cfg in enumerate(configs):
        graphs = [r[index]["graphs"] for r in results]
        assert len(set(graphs)) == 1, f"{cfg}: ranks compiled {graphs} graphs"
        want = _reference(cfg["dtype"], cfg.get("dense", False))
        for rank, r in enumerate(results):
            got = r[index]["logits"]
            err = ((got - want).abs().amax() / want.abs().amax()).item()
            assert err < 1e-4, f"{cfg} rank {rank}: relative logit error {err}\n{r[index]['summary']}"


# dense: the whole forward is one graph, as in the reported repro (tp=1: gloo aborted
# with "Received data size doesn't match" once one rank recompiled alone). Inductor is left
# to C3 (80 of this test's 145 s on two cores): the symbolic-start write and the key count
# reach it through the same rewrite at any c.
C2 = [dict(dtype=torch.float32, tp=2, inner="aot_eager"),
      dict(dtype=torch.float32, tp=1, inner="aot_eager", dense=True)]


@pytest.mark.slow
def test_c2_same_graphs_on_every_rank_and_exact():
    _check(run_ranks(_rank_fn, 2, C2, timeout=600), C2)


# inductor at c=3 under DCP_TEST_FULL=1 only (three ranks compiling C++ on CI's two cores
# take minutes); CI runs inductor under DCP at c=2 (pass_numerics, forms_e2e)
C3 = [dict(dtype=torch.float32, tp=3, inner="aot_eager", dense=True)] + (
    [dict(dtype=torch.float32, tp=3, inner="inductor", dense=True)] if env.full_tests() else [])


@pytest.mark.slow
def test_c3_chunked_calls_exact_aot_eager_and_inductor():
    _check(run_ranks(_rank_fn, 3, C3, timeout=900), C3)


# c=4 under DCP_TEST_FULL=1 only: what it adds to c=3 is a wider stripe through the same
# write window, whose arithmetic test_striped_write checks against brute force (c = 1..4
# and 8 in CI); CI decodes at c=4 in test_pass_numerics, test_project_merge and
# test_forms_e2e (multi-token calls there through the paged pool). Inductor at c=4 is
# left to c=3 as well: four ranks compiling C++ on CI's two cores take minutes. The
# several-graph (MoE) forward and tp=1 are C2's.
C4 = [dict(dtype=torch.float32, tp=4, inner="aot_eager", dense=True)]


@pytest.mark.slow
@pytest.mark.skipif(not env.full_tests(), reason="DCP_TEST_FULL=1")
def test_c4_chunked_calls_exact():
    _check(run_ranks(_rank_fn, 4, C4, timeout=900), C4)
