"""Batch-axis reorders of a striped cache run on the rank's own rows (beam search).

The batch axis is not striped, so `index_select(0, rows)` (transformers' `reorder_cache`)
and `index_copy_(0, rows, other)` between caches striped the same way mean the same thing
on each rank's shard as on the full cache; anything else stays refused. No process group:
the shards are made and installed as the pass does for rank 1 of 2.
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass.state import shards, store


def _striped(seed: int):
    full = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(seed))
    buffer = full.clone()
    entry = shards.shard_for(buffer, 2, 1, f"kv_{seed}", shards.FLAT)
    shards.install(buffer, entry)
    return full, buffer, entry


def _owned(full):
    return full[:, 1::2]  # rank 1 of 2: positions p % 2 == 1


def test_index_select_reorders_each_rank_rows_in_place():
    full, buffer, entry = _striped(0)
    rows = torch.tensor([2, 0, 0])
    assert buffer.index_select(0, rows) is buffer
    assert torch.equal(entry.local[:, :4], _owned(full.index_select(0, rows)))
    assert torch.index_select(buffer, 0, torch.tensor([1, 2, 0])) is buffer  # the function form too
    assert torch.equal(entry.local[:, :4], _owned(full.index_select(0, rows)[[1, 2, 0]]))


def test_index_copy_from_a_cache_striped_the_same_way():
    full, buffer, entry = _striped(1)
    other_full, other, _ = _striped(2)
    buffer.index_copy_(0, torch.tensor([2, 0, 1]), other.index_select(0, torch.tensor([1, 1, 0])))
    want = full.clone()
    want[[2, 0, 1]] = other_full[[1, 1, 0]]
    assert torch.equal(entry.local[:, :4], _owned(want))


@pytest.mark.parametrize("call", [
    lambda b: b.index_select(1, torch.tensor([0, 1, 2])),  # the striped axis
    lambda b: b.index_select(0, torch.tensor([0, 1])),  # a batch of another size
    lambda b: b.index_copy_(0, torch.tensor([0]), torch.zeros(1, 8, 4)),  # from a full-size tensor
    lambda b: b[torch.tensor([0, 1, 2])],
])
def test_other_reorders_stay_refused(call):
    _, buffer, _ = _striped(3)
    with pytest.raises(store.DcpCacheError, match="kv_3"):
        call(buffer)
