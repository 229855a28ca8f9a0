"""The pass's cache write (`write_owned_tokens_`) against brute force, eager and traced.

Traced with a symbolic start it takes the fixed-window form; both forms must store
exactly the owned tokens at row p // c and leave every other row untouched.
"""

import pytest
import torch

from dcp_pass import env
from dcp_pass.runtime.decode.layout import write_owned_tokens_


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



def _traced_write(c, r, capacity, f0, shard, values):
    """The write as the inner compiler sees it: traced with a SymInt start (aot/inductor
    trace the rewritten graph this way; Dynamo's own inlining sees an int)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def write(shard, start):  # values are static in the pass's graphs: a constant here
        write_owned_tokens_(shard, values, start, c, r, capacity, f0)
        return shard

    traced = make_fx(write, tracing_mode="symbolic", _allow_non_fake_inputs=True)(shard, 3)
    start = traced.graph.find_nodes(op="placeholder")[1]
    assert isinstance(start.meta["val"], torch.SymInt), "start must stay symbolic"
    return traced


# CI: 1..4 (3 is not a power of two) and 8, the widest stripe; 5..7 under DCP_TEST_FULL=1
# (each c traces c * 17 writes: 5..7 took 32 of this file's 80 s on two cores)
WINDOW_CS = range(1, 9) if env.full_tests() else [1, 2, 3, 4, 8]


@pytest.mark.parametrize("c", WINDOW_CS)
def test_symbolic_window_brute_force(c):
    """Every (seq, start, rank) for c in 1..8, seq 1..17: the fixed window must cover
    every owned row, (start + seq - 1) // c included, and touch nothing else."""
    capacity, width, f0 = 40, 3, 1
    g = torch.Generator().manual_seed(c)
    rows = -(-capacity // c) + 1
    for r in range(c):
        for seq in range(1, 18):
            values = torch.randn(2, seq, 2, generator=g)
            shard = torch.full((2, rows, width), float("nan"))
            traced = _traced_write(c, r, capacity, f0, shard.clone(), values)
            for start in range(0, capacity - seq + 1):
                want = _expected(shard, values, start, c, r, f0)
                got = traced(shard.clone(), start)
                torch.testing.assert_close(got, want, equal_nan=True,
                                           msg=lambda m: f"c={c} r={r} seq={seq} start={start}: {m}")
