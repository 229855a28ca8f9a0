"""`backend="dcp"`: one DcpBackend per torch.compile call, freed with its compiled model.

Compiles without options, or with one options dict, still get a backend (and a report)
each; a dead compiled model frees its backend and its tensors.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch._dynamo

import dcp_pass
from dcp_pass.backend import last_backend, last_report
from dcp_pass.testing import run_ranks


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


class _Other(_Small):
    # another code object: Dynamo would otherwise serve a second _Small instance from the
    # first one's cache entry (same code, guards pass, equal backend) without compiling
    def forward(self, x):
        return self.lin(x).sigmoid()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiles_without_options_get_a_backend_each():
    a = torch.compile(_Small(), backend="dcp")
    b = torch.compile(_Other(), backend="dcp")
    a(torch.randn(2, 4))
    backend_a = last_backend()
    b(torch.randn(2, 4))
    backend_b = last_backend()
    assert backend_a is not None and backend_b is not None
    assert backend_a is not backend_b
    # each report has its own model's graph only
    assert len(backend_a.report.graphs) == 1 and len(backend_b.report.graphs) == 1
    assert last_report() is backend_b.report


def test_equal_options_dicts_and_recompiles():
    options = {"inner": "eager"}
    a = torch.compile(_Small(), backend="dcp", options=options)
    b = torch.compile(_Other(), backend="dcp", options=options)  # same dict object, another compile
    a(torch.randn(2, 4))
    backend_a = last_backend()
    a(torch.randn(3, 4, 4))  # another rank of input: a recompile of the same compiled model
    assert last_backend() is backend_a and len(backend_a.report.graphs) == 2
    b(torch.randn(2, 4))
    assert last_backend() is not backend_a
    assert len(last_backend().report.graphs) == 1


def _model_refs(model):
    return [weakref.ref(t) for t in list(model.parameters()) + list(model.buffers())]


def test_dead_compiled_model_frees_its_backend_and_tensors():
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    model = build_model(ModelArgs(max_seq_len=16, n_layers=2), seed=0)
    refs = _model_refs(model)
    compiled = torch.compile(model, backend="dcp", options={"inner": "aot_eager"})
    with torch.no_grad():
        compiled(torch.zeros(2, 3, dtype=torch.long), 0)
        compiled(torch.zeros(2, 1, dtype=torch.long), 3)
    backend_ref = weakref.ref(last_backend())
    report = last_report()
    del compiled, model
    torch._dynamo.reset()
    gc.collect()
    assert backend_ref() is None, "the dcp backend outlived its compiled model"
    assert last_backend() is None
    assert sum(r() is not None for r in refs) == 0, "a parameter or buffer outlived its model"
    assert last_report() is report and len(report.graphs) >= 2  # the report (plain data) stays readable


def _decode_once():
    """Build, compile with DCP=2, decode; returns weak references only.

    In its own frame: code that reads `frame.f_locals` up the stack during compilation
    snapshots the caller's locals into a dict that lives as long as that frame does
    (Python 3.11), which would keep `compiled` alive past a `del` in the same frame.
    """
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model
    from dcp_pass.models.generate import greedy_generate

    model = build_model(ModelArgs(max_seq_len=24, tp_size=2), seed=0)
    refs = _model_refs(model)
    compiled = torch.compile(model, backend="dcp", options={"dcp_size": 2, "tp_size": 2, "inner": "aot_eager"})
    greedy_generate(compiled, [[1, 2, 3], [4]], 4)
    return refs, weakref.ref(last_backend()), last_report().layers_rewritten


def _dcp2_rank(rank, world):
    torch.set_grad_enabled(False)
    refs, backend_ref, rewritten = _decode_once()
    torch._dynamo.reset()
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    return {"rewritten": rewritten, "backend_alive": backend_ref() is not None, "tensors_alive": len(alive),
            "n": len(refs), "report_kept": dcp_pass.last_report() is not None}


@pytest.mark.slow
def test_dead_dcp2_model_frees_backend_and_tensors():
    for result in run_ranks(_dcp2_rank, 2, timeout=400):
        assert result["rewritten"] >= 3, result
        assert not result["backend_alive"], result
        assert result["tensors_alive"] == 0, result
        assert result["report_kept"], result
