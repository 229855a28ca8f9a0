"""Every rank must compile with the same dcp options: checked once, at the first compile.

Options that differ across ranks (dcp_size 2 on one rank and 1 on another, a2a on one
and ag_rs on another) make the ranks issue different collectives, which pair with the
wrong peer or wait for one that never comes: a hang until the process-group timeout
(30 minutes for gloo by default). So each backend's first compile publishes a
fingerprint of its options in the process group's store and reads every other rank's;
a difference raises on every rank within seconds, naming the option and the ranks.

The store, not a collective: a rank whose options say dcp_size=1 must still take part
(it cannot know that a peer says 2), and a store read times out by itself when a rank
never compiles, instead of blocking a collective that later collectives queue behind.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any, Mapping, Optional

from dcp_pass import env
from dcp_pass.options import DcpOptionError, DcpOptions

# The n-th dcp backend to compile in this process is matched with the n-th of every
# other rank (ranks run the same program, so they create backends in the same order).
_CHECKS = itertools.count()
_TIMEOUT_ENV = "DCP_AGREEMENT_TIMEOUT_S"


class DcpAgreementError(DcpOptionError):
    """Ranks compiled with different dcp options, or a rank never reached its compile."""


def fingerprint(opts: DcpOptions) -> dict[str, str]:
    """The options that every rank must share, as comparable strings."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if f.name == "group":
            value = None if value is None else _group_ranks(value)
        elif isinstance(value, Mapping):
            value = sorted((str(k), repr(v)) for k, v in value.items())
        out[f.name] = repr(value)
    return out


def _group_ranks(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def differences(prints: list[dict[str, str]]) -> list[str]:
    """One line per option that is not the same on every rank: value -> ranks."""
    lines = []
    for key in sorted(set().union(*prints)):
        by_value: dict[str, list[int]] = {}
        for rank, p in enumerate(prints):
            by_value.setdefault(p.get(key, "<missing>"), []).append(rank)
        if len(by_value) > 1:
            spread = "; ".join(f"{value} on rank(s) {ranks}" for value, ranks in by_value.items())
            lines.append(f"option {key!r}: {spread}")
    return lines


def check_options_agree(opts: DcpOptions, timeout_s: Optional[float] = None) -> None:
    """Raise DcpAgreementError on every rank whose options differ from another rank's.

    A no-op without an initialized process group or with a world of one. Waits at most
    `timeout_s` (env DCP_AGREEMENT_TIMEOUT_S, default 120) for the other ranks to reach
    the same compile.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "fake":  # one process standing in for a world (graph tests): no peers
        return
    import json

    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    index = next(_CHECKS)
    prefix = f"dcp_pass/agreement/{index}/"
    store.set(prefix + str(rank), json.dumps(fingerprint(opts)))
    keys = [prefix + str(r) for r in range(world)]
    timeout = env.agreement_timeout_s() if timeout_s is None else timeout_s
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:  # the store raises a plain RuntimeError on timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise DcpAgreementError(
            f"dcp_pass: rank {rank} waited {timeout:.0f} s at its first compile with backend='dcp' (#{index}) "
            f"for rank(s) {missing}; every rank must compile the same model with backend='dcp' in the same "
            f"order (set {_TIMEOUT_ENV} to wait longer)"
        ) from exc
    prints = [json.loads(store.get(key)) for key in keys]
    lines = differences(prints)
    if lines:
        raise DcpAgreementError(
            "dcp_pass: the dcp options differ across ranks (every rank must pass the same options, or the "
            "ranks' collectives pair with the wrong peer and hang): " + "; ".join(lines)
        )
