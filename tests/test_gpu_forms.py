"""The ways of writing MLA (dcp_pass.models.mla_forms) on a GPU (skipped without one).

* every form at dcp_size=1 with option fast_path: the fp32 model equals eager; in bf16 the
  attention goes to the pass's kernels, teacher-forced against the fp32 eager model within
  bf16 noise (and under inductor with CUDA graphs for two forms);
* flex_attention, which plain inductor compiles on CUDA: the pass's rewrite against plain
  torch.compile of the same model;
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_full,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 8


def _teacher_forced(model, tokens: torch.Tensor, prompt: int):
    # copies: a CUDA-graph replay reuses its output memory
    outs = [model(tokens[:, :prompt], 0).float().clone()]
    for p in range(prompt, tokens.shape[1]):
        outs.append(model(tokens[:, p:p + 1], p).float().clone())
    return torch.stack(outs)


def _run(form: str, dtype: torch.dtype, options: dict, device="cuda"):
    """(max relative logit error of the compiled model against the fp32 eager model, whether
    greedy tokens agree, and the same error of the eager model in `dtype`)."""
    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.mla_forms import FormArgs, build_forms_model

    torch._dynamo.reset()
    args = FormArgs(form=form, n_layers=2, dtype=dtype)
    tokens = torch.randint(0, args.vocab_size, (3, 6 + STEPS), generator=torch.Generator().manual_seed(5)).to(device)
    want = _teacher_forced(build_forms_model(FormArgs(form=form, n_layers=2), seed=3, device=device), tokens, 6)
    eager = _teacher_forced(build_forms_model(args, seed=3, device=device), tokens, 6)
    model = torch.compile(build_forms_model(args, seed=3, device=device), backend=DcpBackend(options))
    got = _teacher_forced(model, tokens, 6)
    torch._dynamo.reset()

    def rel(x):
        return ((x - want).abs().max() / want.abs().max()).item()

    return rel(got), bool(torch.equal(got.argmax(-1), want.argmax(-1))), rel(eager)


def _forms():
    from dcp_pass.models.mla_forms import FORMS

    return FORMS


@torch.no_grad()
@pytest.mark.parametrize("form", _forms())
def test_gpu_form_fast_path(form):
    """fp32 (the torch reference inside the op) exact; bf16 through the GPU kernels."""
    options = {"dcp_size": 1, "tp_size": 1, "fast_path": True, "inner": "aot_eager"}
    rel32, same32, _ = _run(form, torch.float32, options)
    assert rel32 < 1e-5 and same32, (form, rel32)
    rel16, _, eager16 = _run(form, torch.bfloat16, options)
    assert rel16 < max(3e-2, 2 * eager16), (form, rel16, eager16)  # within bf16 noise of the fp32 model


@torch.no_grad()
@pytest.mark.parametrize("form", ["sdpa", "paged"])
def test_gpu_form_fast_path_inductor_cudagraphs(form):
    rel16, _, eager16 = _run(form, torch.bfloat16, {"dcp_size": 1, "tp_size": 1, "fast_path": True, "cudagraphs": True})
    assert rel16 < max(3e-2, 2 * eager16), (form, rel16, eager16)


@torch.no_grad()
def test_gpu_flex_against_plain_inductor():
    from dcp_pass.models.mla_forms import FormArgs, build_forms_model

    torch._dynamo.reset()
    args = FormArgs(form="flex", n_layers=2, dtype=torch.float32)
    tokens = torch.randint(0, args.vocab_size, (3, 6 + STEPS), generator=torch.Generator().manual_seed(5)).cuda()
    plain = _teacher_forced(torch.compile(build_forms_model(args, seed=3, device="cuda")), tokens, 6)
    torch._dynamo.reset()
    from dcp_pass.backend import DcpBackend

    model = torch.compile(build_forms_model(args, seed=3, device="cuda"),
                          backend=DcpBackend({"dcp_size": 1, "tp_size": 1, "fast_path": True}))
    ours = _teacher_forced(model, tokens, 6)
    rel = ((ours - plain).abs().max() / plain.abs().max()).item()
    assert rel < 1e-4, rel
