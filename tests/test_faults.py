"""A rank that fails makes its peers fail within seconds.

Two gloo ranks run the DCP output exchange (the functional all-to-all a compiled
graph issues once per MLA layer). Rank 1 fails right before it:

* it exits (``os._exit``) or raises out of its process: its sockets close and
  rank 0's collective fails at once, whatever the process-group timeout (60 s here);
* it stays alive but never joins the collective: rank 0 waits exactly the
  process-group timeout the user chose (2 s here), then fails.

These tests drive the processes themselves rather than through run_ranks, which
ends the surviving ranks as soon as one dies: here the survivor's own reaction is
what is checked.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time

import pytest

LONG_PG_TIMEOUT = 60.0
SHORT_PG_TIMEOUT = 2.0


def _peer(rank, mode, init_file, pg_timeout, out_q, release):
    import torch
    import torch.distributed as dist

    from dcp_pass.runtime.decode.comm import exchange_partials

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    o, lse = torch.randn(1, 4, 8), torch.randn(1, 4)
    exchange_partials(o, lse, "a2a", None, 2)  # both ranks healthy once
    if rank == 1:
        if mode == "exit":
            os._exit(3)
        if mode == "raise":
            raise RuntimeError("rank 1 fails before the next exchange")
        release.wait(60)  # "stuck": alive, never joins the collective
        os._exit(0)
    t0 = time.monotonic()
    try:
        exchange_partials(o, lse, "a2a", None, 2)
        out_q.put(("no error", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out_q.put((f"{type(e).__name__}: {e}", time.monotonic() - t0))


def _survivor_report(mode, pg_timeout):
    """(rank 0's error text, seconds its exchange took) while rank 1 fails as `mode` says."""
    ctx = mp.get_context("spawn")
    out_q, release = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [ctx.Process(target=_peer, args=(r, mode, init_file, pg_timeout, out_q, release))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            return out_q.get(timeout=45)
        except queue.Empty:
            pytest.fail(f"rank 0 reported nothing in 45 s (rank 1 mode {mode!r})")
        finally:
            release.set()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_peer_of_a_dead_rank_fails_within_seconds(mode):
    error, took = _survivor_report(mode, LONG_PG_TIMEOUT)
    assert error != "no error"
    assert "closed" in error.lower() or "connection" in error.lower(), error
    assert took < 5.0, f"rank 0 needed {took:.1f}s to notice rank 1 died ({mode}); pg timeout {LONG_PG_TIMEOUT}s"


def test_peer_of_a_stuck_rank_fails_at_the_process_group_timeout():
    error, took = _survivor_report("stuck", SHORT_PG_TIMEOUT)
    assert error != "no error"
    assert "timed out" in error.lower() or "timeout" in error.lower(), error
    assert SHORT_PG_TIMEOUT * 0.75 <= took < SHORT_PG_TIMEOUT + 5.0, (took, error)
