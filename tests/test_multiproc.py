"""dcp_pass.testing.run_ranks reports dead or failing ranks promptly.

Every test gives run_ranks a generous timeout and asserts that it returned in a
small fraction of it: a harness that only waits on its result queue would sit out
the whole timeout once every child is gone.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dcp_pass.testing import run_ranks

TIMEOUT = 60.0  # what a broken harness would wait
PROMPT = 20.0  # generous bound for spawning 2 ranks on a loaded 2-core machine


def _all_exit(rank, world):
    dist.barrier()  # both ranks are past the group's setup, which fails if a peer is gone
    time.sleep(0.5)
    os._exit(3)  # no result and no traceback: only the exit code tells


def _one_exits_peer_in_collective(rank, world):
    if rank == 1:
        os._exit(5)
    x = torch.ones(4)
    dist.all_reduce(x)
    return x


def _one_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one refuses: bad shard 42")
    x = torch.ones(4)
    dist.all_reduce(x)  # fails once rank 1 is gone
    return x


def _one_killed(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(4)
    dist.all_reduce(x)
    return x


def _ok(rank, world):
    return rank * 10


def _timed(fn, *args, **kw):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_ranks(fn, 2, *args, timeout=TIMEOUT, **kw)
    return time.monotonic() - t0, str(info.value)


def test_every_rank_exiting_raises_promptly_with_exit_codes():
    elapsed, msg = _timed(_all_exit)
    assert elapsed < PROMPT, f"run_ranks took {elapsed:.1f}s to notice dead ranks"
    assert "rank 0" in msg and "rank 1" in msg and "code 3" in msg, msg


def test_dead_rank_is_named_with_its_exit_code():
    elapsed, msg = _timed(_one_exits_peer_in_collective)
    assert elapsed < PROMPT, elapsed
    # the root cause (rank 1 died with code 5) is reported, not only rank 0's
    # "connection closed" from the collective it was in
    assert "rank 1" in msg and "code 5" in msg, msg


def test_raising_rank_traceback_reaches_the_caller_promptly():
    elapsed, msg = _timed(_one_raises)
    assert elapsed < PROMPT, elapsed
    assert "rank 1" in msg and "ValueError: rank one refuses: bad shard 42" in msg, msg
    assert "Traceback" in msg and "_one_raises" in msg, msg


def test_killed_rank_is_named_with_its_signal():
    elapsed, msg = _timed(_one_killed)
    assert elapsed < PROMPT, elapsed
    assert "rank 1 killed by signal 9 (SIGKILL)" in msg, msg


def test_results_come_back_in_rank_order():
    assert run_ranks(_ok, 2, timeout=TIMEOUT) == [0, 10]


def _seen_from_rank(rank, world):
    import sys

    return os.environ.get("RUN_RANKS_PROBE"), os.environ.get("RUN_RANKS_GONE"), os.path.dirname(__file__) in sys.path


def test_ranks_see_the_parents_environment_and_path_as_of_each_call(monkeypatch):
    """Ranks may fork from a server started by an earlier group (multiproc._context): they
    must still see the parent's environment as it is at this call (a variable changed or
    removed since is changed or removed for them too) and its import path."""
    monkeypatch.setenv("RUN_RANKS_PROBE", "first")
    monkeypatch.setenv("RUN_RANKS_GONE", "here")
    assert run_ranks(_seen_from_rank, 2, timeout=TIMEOUT) == [("first", "here", True)] * 2
    monkeypatch.setenv("RUN_RANKS_PROBE", "second")
    monkeypatch.delenv("RUN_RANKS_GONE")
    assert run_ranks(_seen_from_rank, 2, timeout=TIMEOUT) == [("second", None, True)] * 2
    given = run_ranks(_seen_from_rank, 2, timeout=TIMEOUT, env={"RUN_RANKS_PROBE": "given"})
    assert given == [("given", None, True)] * 2
