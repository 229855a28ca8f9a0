"""End to end: greedy speculative decoding with a DCP-compiled target equals plain greedy.

Two gloo ranks, TP 2 + DCP 2: the target (the example DeepSeek-style MLA model, all dense,
unmodified) is compiled with ``backend="dcp"``, so its MLA cache is striped and its
verification calls (k + 1 query tokens at a static shape) run shard-local attention
with global causality plus the merge. The draft is replicated (TP 1) and compiled
without DCP. Two drafts: one with the target's weights (every proposal accepted) and a
"flaky" one that is deliberately wrong at every third position (partial acceptance,
rejected rows are later overwritten in the striped cache).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from dcp_pass.testing import run_ranks

pytestmark = pytest.mark.slow

K = 3
NEW = 12
PROMPTS = [[3, 5, 7, 11, 2], [9, 1]]


class FlakyDraft(nn.Module):
    """Wraps a draft; its greedy choice is wrong whenever the next position % 3 == 0."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.max_seq_len = getattr(inner, "_orig_mod", inner).max_seq_len

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        logits = self.inner(tokens, start_pos)
        if (start_pos + tokens.shape[1]) % 3 == 0:
            logits = logits.clone()
            wrong = (logits.argmax(dim=-1) + 1) % logits.shape[-1]
            logits.scatter_(-1, wrong.unsqueeze(-1), 1.0e4)
        return logits


def _worker(rank, world):
    from dcp_pass.backend import last_report
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model
    from dcp_pass.models.generate import greedy_generate, speculative_greedy_generate

    torch._dynamo.config.cache_size_limit = 64
    # all-dense: each call shape is one graph (the MoE loop's graph breaks would recompile
    # a dozen frames per shape for draft and target alike)
    args = ModelArgs(tp_size=2, max_seq_len=64, max_batch_size=2, n_layers=2, n_dense_layers=2)
    want = greedy_generate(build_model(args, seed=1), PROMPTS, NEW)[0]  # eager TP-2 reference
    target = torch.compile(
        build_model(args, seed=1), backend="dcp", options={"dcp_size": 2, "tp_size": 2, "inner": "aot_eager"}
    )
    # the draft holds the whole model on every rank (replicated) and knows nothing of DCP
    draft = torch.compile(build_model(replace(args, tp_size=1), seed=1), backend="eager")
    runs = []
    for d in (draft, FlakyDraft(draft)):
        stats: dict = {}
        got = speculative_greedy_generate(target, d, PROMPTS, NEW, K, stats)
        runs.append((got, stats))
    rep = last_report()
    return want, runs, rep.layers_rewritten, rep.kv_bytes_full, rep.kv_bytes_local


def test_compiled_dcp_target_speculative_equals_greedy():
    for want, runs, rewritten, full, local in run_ranks(_worker, 2, timeout=400):
        assert len(want) == 2 and all(len(w) == NEW for w in want)
        (same, st_same), (flaky, st_flaky) = runs
        assert same == want and flaky == want
        assert st_same["accepted"] == st_same["proposed"] > 0  # all k drafts verified per call
        assert 0 < st_flaky["accepted"] < st_flaky["proposed"]  # some rejections
        assert rewritten > 0, "the dcp pass did not rewrite the target's MLA layers"
        # each rank holds half of the target KV (plus one spare row per shard)
        assert full > 0 and full <= 2 * local <= full * 1.1, (full, local)
