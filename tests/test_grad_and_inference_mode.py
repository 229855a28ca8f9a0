"""Grad mode, no_grad, inference_mode and `@torch.inference_mode()` forwards under DCP.

* A model whose parameters require grad works under torch.no_grad()
  and torch.inference_mode(); under grad mode the compile refuses it with a
  DcpRewriteError saying to call under torch.no_grad() (the exchange of partial results
  has no backward: a backward would silently drop the other ranks' gradient share),
  instead of torch's "no autograd formula" for dcp.mla_local_attention.
* A forward decorated with `@torch.inference_mode()` that Dynamo
  captures as ONE graph (all layers dense) failed in AOT autograd with "Cannot set
  version_counter for inference tensor" (pytorch#180823), plain inductor too. The dcp
  backend compiles such a graph without its inference-mode nodes under no_grad and runs
  it inside inference_mode: equal to eager at DCP 1 and 2, aot_eager and inductor.
* The same forward tensor-parallel over 2 ranks (the model's own all_reduce and
  all_gather in the graph), greedy decode equal to eager at DCP 1 and 2, also with the
  step position moved to the device (the CUDA default), which puts the position's
  arithmetic ahead of the inference-mode block. A compile that hands AOT the block's
  enter node fails (pytorch#180823) and leaves the thread's dispatch keys broken ("Hit
  PythonDispatcher dispatch key but PythonDispatcherTLS was not set" at the next op).
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass import env
from dcp_pass.testing import run_ranks

CALLS = [(0, 3), (3, 1), (4, 1), (5, 1)]  # prefill, then decode steps (a symbolic start)


def _args():
    from dcp_pass.models.deepseek_mla import ModelArgs

    # all layers dense: the whole forward is one graph
    return ModelArgs(max_seq_len=16, n_layers=2, n_dense_layers=2, tp_size=1)


def _inference_transformer():
    from dcp_pass.models.deepseek_mla import Transformer

    class InferenceTransformer(Transformer):
        @torch.inference_mode()
        def forward(self, tokens, start_pos=0, *, all_logits=False):
            return super().forward(tokens, start_pos, all_logits=all_logits)

    return InferenceTransformer


def _build(cls=None, requires_grad=False):
    from dcp_pass.models.deepseek_mla import Transformer, _build as build

    model = build(cls or Transformer, _args(), 0, 0)
    return model.requires_grad_(requires_grad)


def _drive(model, ctx):
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    with ctx():
        return [model(tokens[:, s:s + n], s) for s, n in CALLS]


def _compare(got, want):
    return max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))


def _rank_fn(rank, world, configs):
    import contextlib

    import torch._dynamo

    from dcp_pass.backend import DcpBackend

    contexts = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    out = []
    for cfg in configs:
        torch._dynamo.reset()
        cls = _inference_transformer() if cfg["decorated"] else None
        with torch.no_grad():
            want = _drive(_build(cls), contexts["no_grad"])
        model = _build(cls, requires_grad=cfg["requires_grad"])
        backend = DcpBackend(dcp_size=cfg["dcp"], tp_size=1, inner=cfg["inner"])
        try:
            got = _drive(torch.compile(model, backend=backend), contexts[cfg["ctx"]])
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        out.append({
            "error": None,
            "err": _compare(got, want),
            "inference_outputs": [g.is_inference() for g in got],
            "requires_grad_outputs": [g.requires_grad for g in got],
            "rewritten": backend.report.layers_rewritten,
            "complex_notes": sum("complex product" in n for g in backend.report.graphs for n in g.notes),
            "params_inference": any(p.is_inference() for p in model.parameters()),
            "buffers_inference": any(b.is_inference() for b in model.buffers()),
        })
    return out


GRAD_CONFIGS = [
    dict(decorated=False, requires_grad=True, ctx="no_grad", dcp=2, inner="aot_eager"),
    dict(decorated=False, requires_grad=True, ctx="inference_mode", dcp=2, inner="aot_eager"),
    dict(decorated=False, requires_grad=True, ctx="grad", dcp=2, inner="aot_eager"),
    dict(decorated=False, requires_grad=True, ctx="grad", dcp=2, inner="inductor"),
]


@pytest.mark.slow
def test_requires_grad_params_no_grad_inference_mode_and_grad_mode():
    results = run_ranks(_rank_fn, 2, GRAD_CONFIGS, timeout=600)
    for rank_results in results:
        for cfg, r in zip(GRAD_CONFIGS, rank_results):
            if cfg["ctx"] == "grad":
                assert r["error"] is not None, (cfg, r)
                assert "DcpRewriteError" in r["error"] and "torch.no_grad()" in r["error"], (cfg, r["error"])
                assert "requires_grad_(False)" in r["error"] and "wq.weight" in r["error"], r["error"]
            else:
                assert r["error"] is None, (cfg, r["error"])
                assert r["rewritten"] >= 2 and r["err"] < 1e-5, (cfg, r)
                assert not any(r["requires_grad_outputs"]), (cfg, r)
                assert all(r["inference_outputs"]) == (cfg["ctx"] == "inference_mode"), (cfg, r)


# DCP 1 under inductor runs under DCP_TEST_FULL=1: the AOT step that failed is DCP 1's
# aot_eager run, the compiled graph run inside inference_mode is DCP 2's inductor run (a
# minute of C++ builds on two cores with a cold cache)
DECORATED_CONFIGS = [
    dict(decorated=True, requires_grad=False, ctx="grad", dcp=1, inner="aot_eager"),
    dict(decorated=True, requires_grad=False, ctx="grad", dcp=2, inner="aot_eager"),
    dict(decorated=True, requires_grad=False, ctx="grad", dcp=2, inner="inductor"),
    # parameters that require grad, called in grad mode: the decorator alone turns grad off
    dict(decorated=True, requires_grad=True, ctx="grad", dcp=2, inner="aot_eager"),
] + ([dict(decorated=True, requires_grad=False, ctx="grad", dcp=1, inner="inductor"),
      dict(decorated=True, requires_grad=False, ctx="grad", dcp=2, inner="eager")]
     if env.full_tests() else [])


@pytest.mark.slow
def test_inference_mode_decorated_single_graph_forward():
    results = run_ranks(_rank_fn, 2, DECORATED_CONFIGS, timeout=900)
    for rank_results in results:
        for cfg, r in zip(DECORATED_CONFIGS, rank_results):
            assert r["error"] is None, (cfg, r["error"])
            assert r["err"] < 1e-5, (cfg, r)
            assert r["rewritten"] >= (2 if cfg["dcp"] == 2 else 0), (cfg, r)
            # the rotary's real arithmetic stays inside the inference-mode block (inductor only)
            assert (r["complex_notes"] > 0) == (cfg["dcp"] == 2 and cfg["inner"] == "inductor"), (cfg, r)
            # outputs are inference tensors as in eager; the model's own tensors are not
            assert all(r["inference_outputs"]) and not any(r["requires_grad_outputs"]), (cfg, r)
            assert not r["params_inference"] and not r["buffers_inference"], (cfg, r)


TP_CONFIGS = [
    dict(dcp=1, inner="aot_eager", static_positions=None, device_position=False),
    dict(dcp=2, inner="aot_eager", static_positions=True, device_position=True),
    dict(dcp=2, inner="inductor", static_positions=True, device_position=True),
] + ([  # the rest of the matrix (DCP_TEST_FULL=1): minutes of inductor compiles on two cores
    dict(dcp=1, inner="inductor", static_positions=None, device_position=False),
    dict(dcp=2, inner="aot_eager", static_positions=None, device_position=False),
] if env.full_tests() else [])
# CUDA defaults: CUDA graphs on, and at DCP 2 the step position on the device
TP_CONFIGS_CUDA = [
    dict(dcp=1, inner="inductor", static_positions=None, device_position=False),
    dict(dcp=2, inner="inductor", static_positions=None, device_position=True),
]
PROMPT, NEW_TOKENS = [[5, 17, 2], [9, 1, 30]], 4


def _greedy(model, prompt, steps, device):
    """Prefill, then `steps` greedy decode steps; the logits of every call and the tokens."""
    tokens = torch.tensor(prompt, device=device)
    logits = [model(tokens, 0)]
    out, pos = [], tokens.size(1)
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits.append(model(nxt, pos))
        pos += 1
    return logits, torch.cat(out, dim=1).tolist()


def _tp_rank_fn(rank, world, configs, device_type):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs, _build as build

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    args = ModelArgs(max_seq_len=16, n_layers=1, n_dense_layers=1, tp_size=2)
    cls = _inference_transformer()
    want, want_tokens = _greedy(build(cls, args, rank, 0, device), PROMPT, NEW_TOKENS, device)
    out = []
    for cfg in configs:
        torch._dynamo.reset()
        counters.clear()
        backend = DcpBackend(dcp_size=cfg["dcp"], tp_size=2, inner=cfg["inner"],
                             static_positions=cfg["static_positions"])
        try:  # the build too: a broken thread fails at its first op
            model = build(cls, args, rank, 0, device)
            got, tokens = _greedy(torch.compile(model, backend=backend), PROMPT, NEW_TOKENS, device)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        out.append({
            "error": None,
            "rel": max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)),
            "tokens_equal": tokens == want_tokens,
            "inference_outputs": all(g.is_inference() for g in got),
            "rewritten": backend.report.layers_rewritten,
            "device_position": any("moved to the device" in n for g in backend.report.graphs for n in g.notes),
            "model_inference": any(t.is_inference() for t in [*model.parameters(), *model.buffers()]),
            "dispatcher_key_left": torch._C._dispatch_tls_is_dispatch_key_included(
                torch._C.DispatchKey.PythonDispatcher),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        })
    return out


def _check_tp(configs, results):
    for rank_results in results:
        for cfg, r in zip(configs, rank_results):
            assert r["error"] is None, (cfg, r["error"])
            assert r["rel"] < 1e-5 and r["tokens_equal"], (cfg, r)
            assert r["rewritten"] >= (1 if cfg["dcp"] == 2 else 0), (cfg, r)
            assert r["device_position"] == cfg["device_position"], (cfg, r)
            assert r["inference_outputs"] and not r["model_inference"], (cfg, r)
            assert not r["dispatcher_key_left"], (cfg, r)
            # the cache writes are mutated inputs: CUDA graphs need them marked static
            assert r["cudagraph_skips"] == 0, (cfg, r)


@pytest.mark.slow
def test_inference_mode_decorated_tensor_parallel_forward():
    _check_tp(TP_CONFIGS, run_ranks(_tp_rank_fn, 2, TP_CONFIGS, "cpu", timeout=900))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.gpu_full
def test_inference_mode_decorated_tensor_parallel_forward_cuda():
    _check_tp(TP_CONFIGS_CUDA, run_ranks(_tp_rank_fn, 2, TP_CONFIGS_CUDA, "cuda", backend="nccl", timeout=900))


def _block_graph(outside_output=False, second_block=False):
    """pos - 1 ahead of an inference-mode block that slices a buffer (as the device step
    position's arithmetic lands ahead of a decorated forward's block)."""
    import torch.fx as fx

    enter_fn = torch.autograd.grad_mode._enter_inference_mode
    exit_fn = torch.autograd.grad_mode._exit_inference_mode
    g = fx.Graph()
    x, buf, pos = g.placeholder("x"), g.placeholder("buf"), g.placeholder("pos")
    start = g.call_function(torch.sub, (pos, 1))
    enter = g.call_function(enter_fn, (True,))
    rows = g.call_function(torch.index_select, (buf, 0, start))
    y = g.call_function(torch.add, (g.call_method("view", (buf, -1)), g.call_method("sum", (rows,))))
    y = g.call_function(torch.mul, (y, g.call_method("sum", (x,))))
    g.call_function(exit_fn, (enter,))
    if second_block:
        again = g.call_function(enter_fn, (True,))
        g.call_function(exit_fn, (again,))
    g.output((y, start) if outside_output else (y,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_inference_mode_block_with_work_ahead_of_it():
    from dcp_pass.backend import compile_inner, inference_mode_block
    from dcp_pass.options import DcpOptions

    assert inference_mode_block(_block_graph()) is not None
    assert inference_mode_block(_block_graph(outside_output=True)) is None  # pos - 1 leaves the graph
    assert inference_mode_block(_block_graph(second_block=True)) is None
    x, buf, pos = torch.randn(3), torch.randn(4, 2), torch.tensor([2])
    want = _block_graph()(x, buf, pos)[0]
    for inner in ("aot_eager", "inductor"):
        got = compile_inner(_block_graph(), [x, buf, pos], DcpOptions.from_mapping({"inner": inner}), None)(x, buf, pos)
        assert got[0].is_inference(), inner
        torch.testing.assert_close(got[0], want, msg=lambda m: f"{inner}: {m}")
        assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
