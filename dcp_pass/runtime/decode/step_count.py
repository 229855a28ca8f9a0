"""The host's copy of a decode step's key count, for kernels that plan on the host.

An int-position graph (rewrites/positions.py) reads its key count from a device buffer
that the backend fills before each call, and when every attention op reads the same count
the ops take that buffer itself, marked ``kv_len=STEP_COUNT``. The backend also holds that
count as a host int. The Triton kernels read counts on the device, but FlashInfer's MLA
wrapper schedules its work on the host from them: without a host copy that is a
device-to-host sync per call, and in a replayed CUDA graph the op's Python never runs.

So the backend runs each call of such a graph inside :func:`step`:

* the ops of the call see the count (:func:`current_count`) and hand it to their kernel
  (``AttentionCall.host_lens``), which then needs no sync;
* a kernel whose launches read a host-made plan from fixed buffers registers, on a call
  that is not being captured (CUDA graphs warm a graph up before recording it), a
  *planner* for the graph (:func:`register`): a function of the count that plans into
  those buffers. :func:`step` runs the graph's planners before each call, so a replay finds
  the plan of its own step, as serving engines plan before they replay.

Pure Python: no kernel, no Triton.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Hashable, Iterator, Optional

__all__ = ["STEP_COUNT", "HostPlans", "step", "current_count", "register", "planned"]

# kv_len of an attention op whose device counts (kv_lens) are the step's key count buffer
STEP_COUNT = -1


class HostPlans:
    """The planners of one compiled graph: key (a kernel's plan shape) -> planner(count)."""

    def __init__(self) -> None:
        self._planners: Dict[Hashable, Callable[[int], None]] = {}

    def __len__(self) -> int:
        return len(self._planners)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._planners

    def add(self, key: Hashable, planner: Callable[[int], None]) -> None:
        self._planners.setdefault(key, planner)

    def plan(self, count: int) -> None:
        """Plan every registered kernel for a step whose key count is `count`."""
        for planner in self._planners.values():
            planner(count)


_STATE = threading.local()


@contextlib.contextmanager
def step(plans: HostPlans, count: int) -> Iterator[None]:
    """One call of a graph whose key count is `count` on the host: its planners run first."""
    count = int(count)
    plans.plan(count)
    saved = getattr(_STATE, "current", None)
    _STATE.current = (plans, count)
    try:
        yield
    finally:
        _STATE.current = saved


def current_count() -> Optional[int]:
    """The key count of the step being run (None outside :func:`step`)."""
    here = getattr(_STATE, "current", None)
    return None if here is None else here[1]


def register(key: Hashable, planner: Callable[[int], None]) -> bool:
    """Register `planner` for the graph being run; False outside :func:`step`."""
    here = getattr(_STATE, "current", None)
    if here is None:
        return False
    here[0].add(key, planner)
    return True


def planned(key: Hashable) -> bool:
    """Whether the graph being run has a planner for `key` (so it planned this step)."""
    here = getattr(_STATE, "current", None)
    return here is not None and key in here[0]
