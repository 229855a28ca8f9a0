"""Two ranks on one GPU through gloo: the example model at DCP=2 on CUDA (skipped without one).

Where only one-GPU machines are lent, this is the run in which the striped CUDA kernels,
device key counts and the merge run inside a real model at dcp_size > 1. Both ranks use
cuda:0 (NCCL refuses two ranks on one device) and gloo moves the CUDA tensors through the
host, so nothing here is timed; CUDA graphs are off (gloo collectives cannot be captured).
torch's functional all_gather_into_tensor crashes on a gloo group given CUDA tensors (torch
2.11, a segfault in wait_tensor): the pass's own all-gathers go through all_to_all_single
there (runtime/decode/comm.py), and the example model's logits all-gather, which is the
model's, is swapped in this test for an all_reduce of zero-padded slots.

The example model at TP=2 (heads sharded: the query all-gather or the replicated query
projection, the packed all-to-all, the value projection before the merge): fp32 greedy
tokens equal the eager model's on the same GPU; bf16 teacher-forced within bf16 noise of
the fp32 eager model (the bf16 calls run the GPU kernels; fp32 runs the torch reference).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[11, 5, 42, 7, 19, 3], [9, 4], [23, 8, 1]]
STEPS = 8
DEVICE = "cuda"  # the ranks' device (the functions run on CPU too, for a quick check off the GPU)
# teacher forcing runs every request to the longest prompt + STEPS: the greedy run feeds that many
SPREAD = max(map(len, PROMPTS)) - min(map(len, PROMPTS))


def _gather_by_all_reduce(parts, tensor, group=None, async_op=False):
    """`dist.all_gather` as an all_reduce of zero-padded slots (gloo's CUDA all-gather crashes)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    slots = torch.zeros((len(parts),) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    slots[rank] = tensor
    dist.all_reduce(slots, group=group)
    for i, part in enumerate(parts):
        part.copy_(slots[i])


def _rank(rank: int, world: int, runs: list):
    import types

    import torch.distributed as dist

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models import deepseek_mla
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model
    from dcp_pass.models.generate import greedy_generate, teacher_forced

    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    names = {k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")}
    deepseek_mla.dist = types.SimpleNamespace(**dict(names, all_gather=_gather_by_all_reduce))
    torch.set_grad_enabled(False)
    results = []
    for options in runs:
        torch._dynamo.reset()
        fp32 = ModelArgs(n_layers=2, n_dense_layers=2, n_heads=8, max_seq_len=32)
        want, want_logits = greedy_generate(build_model(fp32, device=DEVICE), PROMPTS, STEPS + SPREAD)
        compiled = torch.compile(build_model(fp32, device=DEVICE), backend=DcpBackend(options))
        got, got_logits = greedy_generate(compiled, PROMPTS, STEPS + SPREAD)
        err32 = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got_logits, want_logits))
        torch._dynamo.reset()
        bf16 = ModelArgs(n_layers=2, n_dense_layers=2, n_heads=8, max_seq_len=32, dtype=torch.bfloat16)
        eager16 = teacher_forced(build_model(bf16, device=DEVICE), PROMPTS, want, STEPS)
        backend = DcpBackend(options)
        got16 = teacher_forced(torch.compile(build_model(bf16, device=DEVICE), backend=backend), PROMPTS, want, STEPS)
        report = backend.report

        def rel(xs):
            return max(((x - w).abs().max() / w.abs().max()).item() for x, w in zip(xs, want_logits))

        results.append(dict(options=options, tokens_equal=got == want, err32=err32, err16=rel(got16),
                            eager16=rel(eager16), layers=report.layers_rewritten, summary=report.summary()))
        torch._dynamo.reset()
    return results


RUNS = [
    {"dcp_size": 2, "cudagraphs": False, "replicate_q_proj": True},
    {"dcp_size": 2, "cudagraphs": False, "replicate_q_proj": False, "project_before_merge": False},
]


@pytest.mark.gpu_full
def test_example_model_two_ranks_one_gpu():
    from dcp_pass.testing import run_ranks

    for rank_results in run_ranks(_rank, 2, RUNS, backend="gloo", timeout=900):
        for r in rank_results:
            assert r["layers"] == 2, r["summary"]
            assert r["tokens_equal"] and r["err32"] < 1e-4, r
            assert r["err16"] < max(3e-2, 2 * r["eager16"]), r
