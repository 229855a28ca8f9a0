"""Options that differ across ranks raise on every rank within seconds, not a hang.

Without the check, dcp_size=2 on one rank and 1 on the other (or a2a vs ag_rs) make
the ranks issue different collectives, which wait until the process-group timeout
(30 minutes for gloo by default).
"""
from __future__ import annotations

import time

import pytest
import torch

from dcp_pass.agreement import differences
from dcp_pass.testing import run_ranks


def test_differences_name_the_option_and_the_ranks():
    same = {"dcp_size": "2", "comm_backend": "'a2a'"}
    lines = differences([same, {"dcp_size": "1", "comm_backend": "'a2a'"}, same])
    assert lines == ["option 'dcp_size': 2 on rank(s) [0, 2]; 1 on rank(s) [1]"]
    assert differences([same, same]) == []


def _compile_with(rank, world, per_rank_options):
    import torch._dynamo

    from dcp_pass.agreement import DcpAgreementError
    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    torch.set_grad_enabled(False)
    out = []
    for options in per_rank_options:
        torch._dynamo.reset()
        model = build_model(ModelArgs(tp_size=1, n_layers=1, n_dense_layers=1, max_seq_len=16), rank=0, seed=1)
        backend = DcpBackend(dict(options[rank], tp_size=1, inner="eager"))
        start = time.monotonic()
        try:
            torch.compile(model, backend=backend)(torch.tensor([[1, 2, 3]]), 0)
            out.append(("ok", time.monotonic() - start))
        except Exception as e:  # noqa: BLE001 - Dynamo wraps backend errors (BackendCompilerFailed)
            cause = e if isinstance(e, DcpAgreementError) else e.__cause__ or e
            assert isinstance(cause, DcpAgreementError) or "DcpAgreementError" in str(e), repr(e)
            out.append((str(e), time.monotonic() - start))
    return out


MISMATCHES = [
    [dict(dcp_size=2), dict(dcp_size=1)],
    [dict(dcp_size=2, comm_backend="a2a"), dict(dcp_size=2, comm_backend="ag_rs")],
]


@pytest.mark.slow
def test_mismatched_options_raise_on_every_rank_within_seconds():
    cases = MISMATCHES + [[dict(dcp_size=2), dict(dcp_size=2)]]  # then a matching compile still works
    results = run_ranks(_compile_with, 2, cases, timeout=300)
    for rank in range(2):
        (dcp_msg, t0), (comm_msg, t1), (ok, _) = results[rank]
        assert "'dcp_size': 2 on rank(s) [0]; 1 on rank(s) [1]" in dcp_msg, dcp_msg
        assert "'comm_backend'" in comm_msg and "'ag_rs' on rank(s) [1]" in comm_msg, comm_msg
        assert max(t0, t1) < 30, (t0, t1)
        assert ok == "ok"
