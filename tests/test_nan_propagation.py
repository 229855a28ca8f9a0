"""NaN in must mean NaN out, as without DCP.

A NaN that reaches one cache row makes every later attention row NaN in the model
without DCP. Under DCP that row lives on one rank only: its partial LSE is NaN, and
a merge that took a non-finite LSE for an empty shard would silently drop it and
return finite, wrong logits. Emptiness is a key count (LSE -inf), never a value.
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass.testing import run_ranks

NAN_TOKEN = 7
PROMPT_LEN, STEPS = 6, 4


def _model(tp, rank):
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    return build_model(ModelArgs(tp_size=tp, max_seq_len=24, max_batch_size=2, n_layers=2), rank=rank, seed=5)


@torch.no_grad()
def _poison(model, poison):
    if poison == "wkv_a":
        model.layers[0].attn.wkv_a.weight[3, 5] = float("nan")
    else:  # a NaN embedding row: the cache rows of that token's position are NaN
        emb = model.embed
        if emb.vocab_start <= NAN_TOKEN < emb.vocab_end:
            emb.weight[NAN_TOKEN - emb.vocab_start, 0] = float("nan")
    return model


def _prompt(nan_position):
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    if nan_position is not None:
        tokens[0, nan_position] = NAN_TOKEN  # row 0 only: row 1 stays finite
    return tokens


def _drive(model, nan_position):
    tokens = _prompt(nan_position)
    out = [model(tokens[:, :PROMPT_LEN], 0, all_logits=True)]
    out += [model(tokens[:, p:p + 1], p, all_logits=True) for p in range(PROMPT_LEN, PROMPT_LEN + STEPS)]
    return torch.cat(out, dim=1).float()


def _rank_fn(rank, world, cases):
    """One compiled model serves every case (the poison is data: weights are graph inputs,
    no case recompiles what another compiled): clean weights restored, then poisoned, then
    the pass's copies of other ranks' weight shards gathered again (refresh_weights, as after
    any update in place). Each case's prefill rewrites every cache row the case reads, as a
    new request does."""
    import dcp_pass
    from dcp_pass.backend import DcpBackend

    torch.set_grad_enabled(False)
    model = _model(world, rank)
    clean = [p.clone() for p in model.parameters()]
    compiled = torch.compile(model, backend=DcpBackend(dcp_size=world, inner="aot_eager"))
    results = []
    for poison, nan_position in cases:
        for p, c in zip(model.parameters(), clean):
            p.copy_(c)
        _poison(model, poison)
        dcp_pass.refresh_weights(model)
        results.append(_drive(compiled, nan_position))
    return results


# NaN cache row owned by rank 0 (position 2) and by rank 1 (position 3); NaN weight
CASES = [("token", 2), ("token", 3), ("wkv_a", None)]


@pytest.mark.slow
def test_nan_in_cache_row_or_weight_gives_nan_out_on_every_rank():
    results = run_ranks(_rank_fn, 2, CASES, timeout=600)
    for index, (poison, nan_position) in enumerate(CASES):
        with torch.no_grad():
            want = _drive(_poison(_model(1, 0), poison), nan_position)
        assert want.isnan().any(), "the test must poison the model without DCP"
        for rank in range(2):
            got = results[rank][index]
            assert torch.equal(got.isnan(), want.isnan()), (
                f"{poison} at {nan_position}, rank {rank}: NaN pattern differs "
                f"({int(got.isnan().sum())} NaN vs {int(want.isnan().sum())} without DCP)")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
