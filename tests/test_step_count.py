"""The host's copy of a decode step's key count (runtime/decode/step_count.py).

An int-position decode graph reads its key count from a device buffer the backend fills;
the backend runs each call inside `step_count.step`, so the attention ops see the same
count on the host (for FlashInfer's host-side plan) and a kernel's planner re-plans before
every call. Checked here: the planners' bookkeeping, and on a compiled reference-style
model that every decode-step op sees exactly the count its device buffer holds.
"""
from __future__ import annotations

import torch

from dcp_pass.runtime.decode import step_count


def test_step_runs_the_graphs_planners_first_and_nests():
    plans, other = step_count.HostPlans(), step_count.HostPlans()
    calls = []
    assert step_count.current_count() is None
    assert step_count.register("k", calls.append) is False  # outside a step: nowhere to register
    with step_count.step(plans, 7):
        assert step_count.current_count() == 7 and not step_count.planned("k")
        assert step_count.register("k", lambda n: calls.append(("k", n)))
        assert step_count.register("k", lambda n: calls.append(("dup", n)))  # the first planner of a key stays
        assert step_count.planned("k") and len(plans) == 1
        with step_count.step(other, 3):  # another graph called inside (its own planners)
            assert step_count.current_count() == 3 and not step_count.planned("k")
        assert step_count.current_count() == 7
    assert step_count.current_count() is None
    with step_count.step(plans, 9):
        pass
    assert calls == [("k", 9)]  # planned before the call, with the new step's count


def _drive(model, tokens, prompt, steps):
    out = [model(tokens[:, :prompt], 0)]
    out += [model(tokens[:, p:p + 1], p) for p in range(prompt, prompt + steps)]
    return torch.stack([o.float() for o in out])


def test_decode_ops_see_the_step_count(monkeypatch):
    """A reference-style model on one rank (fast_path): each decode step's attention ops are
    told the host count, equal to what their device counts hold (prompt 5 + step + 1), and
    the logits equal the model's."""
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model
    from dcp_pass.runtime.decode import ops

    torch.set_grad_enabled(False)
    args = ModelArgs(tp_size=1, max_seq_len=48, max_batch_size=2, n_layers=2, n_dense_layers=2)
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    want = _drive(build_model(args, rank=0, seed=3), tokens, 5, 9)
    seen = []
    real = ops._local_attention

    def spy(*a):
        kv_lens, host_lens = a[6], a[-1]
        seen.append((None if kv_lens is None else int(kv_lens.reshape(-1)[0]), host_lens))
        return real(*a)

    monkeypatch.setattr(ops, "_local_attention", spy)
    torch._dynamo.reset()
    backend = DcpBackend(dcp_size=1, fast_path=True, inner="aot_eager", static_positions=True)
    got = _drive(torch.compile(build_model(args, rank=0, seed=3), backend=backend), tokens, 5, 9)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    decode = [(k, h) for k, h in seen if k is not None]
    assert len(decode) >= 2 * 8, seen  # 2 layers x the steps the static graph ran
    assert all(k == h for k, h in decode), decode
    assert sorted({h for _, h in decode})[-1] == 5 + 9
    assert step_count.current_count() is None
