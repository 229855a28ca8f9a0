"""Start `world_size` real processes with a torch.distributed group and collect results.

Ranks are spawned, or on a machine without CUDA forked from one server that imported torch
once (`_context`); either way each rank is a fresh process with its own group.

Used by tests (gloo on CPU), the demo and the GPU benchmarks (nccl). Every rank runs
`fn(rank, world_size, *args)`; its return value (picklable) comes back in rank order.
A failure on any rank is re-raised in the parent with that rank's traceback, and the
other ranks are terminated instead of hanging in a collective. A rank that dies
without a word (``os._exit``, a signal, a segfault) is noticed from its exit code
while the parent waits, not at the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from dcp_pass import env as dcp_env


class Checks:
    """Collects failed checks inside a rank instead of raising: a rank that raised
    mid-way would leave its peers waiting in the next collective until the timeout.
    ``check(ok, *msg)`` records ``repr(msg)`` in ``check.fails`` when ``ok`` is false."""

    def __init__(self):
        self.fails = []

    def __call__(self, ok, *msg):
        if not bool(ok):
            self.fails.append(repr(msg))


def _to_bytes(value: Any) -> bytes:
    # Tensors put on a multiprocessing queue travel as shared-memory handles that die
    # with the sending process; serialize them so results outlive the rank.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _context(backend: str):
    """How ranks start. On a machine without CUDA, gloo ranks fork from one server process
    that imported torch and Dynamo once ("forkserver" with them preloaded) instead of each
    spawned rank importing them again: ~3 s a rank on CI's two cores, against ~0.1 s, over
    dozens of groups per test run. What a spawned rank took from its parent at start (the
    environment, the import path) is handed to every rank explicitly (_rank_main), since
    the server's copies date from its own start. Where CUDA is present (or for NCCL) ranks
    are spawned as before: a process that forked after its parent touched the CUDA driver
    cannot use the device. DCP_TEST_START=spawn spawns everywhere."""
    if backend != "gloo" or dcp_env.ranks_start() == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])  # at the server's start
    return ctx


def _rank_main(payload, rank, world_size, backend, init_file, threads, env, out_q):
    try:
        environ, path = env
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        sys.path[:] = path
        # unpickled only now: fn and args may live in modules on the parent's path
        fn, args = pickle.loads(payload)
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # The result goes out before the group is torn down: tearing down NCCL
        # communicators that captured CUDA graphs still reference can block for minutes
        # (seen on 2 x H200 with mode="reduce-overhead"); the parent ends such a rank.
        out_q.put((rank, True, _to_bytes(result)))
        try:
            dist.barrier()
        except Exception:  # a peer already failed; its error is what matters
            pass
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        out_q.put((rank, False, traceback.format_exc()))


_POLL_S = 0.2  # how often the parent looks at its children's exit codes while waiting
_GRACE_S = 2.0  # after a first failure, how long to wait for the other ranks' reports


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _failure_report(procs, errors: dict[int, str], results: dict[int, Any]) -> str:
    """Every failed rank: first those that died without reporting (most likely the cause,
    their peers then fail in a collective), then tracebacks in the order they came."""
    silent = [
        f"rank {r} {_exit_text(p.exitcode)} before returning a result (no traceback: os._exit, a signal or a crash)"
        for r, p in enumerate(procs)
        if r not in errors and r not in results and p.exitcode is not None
    ]
    raised = [f"rank {r} failed:\n{tb}" for r, tb in errors.items()]
    return "\n".join(silent + raised)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 600.0,
    threads_per_rank: int = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return results by rank.

    Raises RuntimeError as soon as a rank raises or dies (its traceback or exit code;
    the other ranks' reports that arrive within a short grace are added), and
    TimeoutError when the ranks are all alive but have not finished within `timeout`
    seconds in all."""
    ctx = _context(backend)
    out_q = ctx.Queue()
    payload = pickle.dumps((fn, args))
    environ = dict(os.environ, **(env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(payload, r, world_size, backend, init_file, threads_per_rank, (environ, list(sys.path)), out_q),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}

        def receive(wait: float) -> bool:
            try:
                rank, ok, payload = out_q.get(timeout=wait)
            except queue.Empty:
                return False
            if ok:
                results[rank] = _from_bytes(payload)
            else:
                errors[rank] = payload
            return True

        def silent_deaths() -> list[int]:
            return [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results and r not in errors]

        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size and not errors:
                if receive(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
                    continue
                if silent_deaths():
                    # A rank's last report may still be in the pipe when its exit code
                    # shows: drain before calling it silent.
                    while receive(0.5):
                        pass
                    if silent_deaths():
                        break
                elif time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout}s"
                    )
            if len(results) < world_size:
                # Something failed: give the other ranks a moment to report too (a peer's
                # collective fails once the failed rank is gone), so that the message has
                # the root cause whichever report came first.
                grace_end = time.monotonic() + _GRACE_S
                while time.monotonic() < grace_end and any(
                    r not in results and r not in errors and procs[r].exitcode is None for r in range(world_size)
                ):
                    receive(_POLL_S)
                while receive(0.05):
                    pass
                raise RuntimeError(_failure_report(procs, errors, results))
        finally:
            for p in procs:
                p.join(timeout=5 if len(results) == world_size else 0.5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [results[r] for r in range(world_size)]
