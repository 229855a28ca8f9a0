"""The pass's cache write (`write_owned_tokens_`) against brute force, eager and traced.

Traced with a symbolic start it takes the fixed-window form; both forms must store
exactly the owned tokens at row p // c and leave every other row untouched.
"""

import pytest
import torch

from dcp_pass.runtime.layout import write_owned_tokens_


def _expected(shard, values, start, c, r, f0):
    out = shard.clone()
    for j in range(values.shape[1]):
        p = start + j
        if p % c == r:
            out[: values.shape[0], p // c, f0 : f0 + values.shape[2]] = values[:, j]
    return out


@pytest.mark.parametrize("c, seq", [(2, 1), (2, 3), (3, 1), (3, 5), (4, 2), (4, 9)])
def test_eager_and_symbolic_start_match_brute_force(c, seq):
    capacity, width, f0 = 24, 7, 2
    g = torch.Generator().manual_seed(c * 100 + seq)
    for r in range(c):
        torch._dynamo.reset()

        def write(shard, values, start, r=r):
            write_owned_tokens_(shard, values, start, c, r, capacity, f0)

        compiled = torch.compile(write, backend="aot_eager", dynamic=True, fullgraph=True)
        for start in range(0, capacity - seq + 1, 2):
            _check_one(compiled, c, r, seq, start, capacity, width, f0, g)


def _check_one(compiled, c, r, seq, start, capacity, width, f0, g):
    rows = -(-capacity // c) + 1  # one spare row, as the pass allocates
    shard = torch.full((3, rows, width), float("nan"))
    values = torch.randn(2, seq, 4, generator=g)
    want = _expected(shard, values, start, c, r, f0)
    eager = shard.clone()
    write_owned_tokens_(eager, values, start, c, r, capacity, f0)
    traced = shard.clone()
    compiled(traced, values, start)
    torch.testing.assert_close(eager, want, equal_nan=True)
    torch.testing.assert_close(traced, want, equal_nan=True)


def test_write_past_capacity_raises():
    shard = torch.zeros(1, 9, 4)
    with pytest.raises(RuntimeError, match="past the cache capacity"):
        write_owned_tokens_(shard, torch.ones(1, 3, 4), 15, 2, 0, 16)
