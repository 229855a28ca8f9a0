"""Graph-diff regression tests for your own model: what each pass does to each graph.

    from dcp_pass.testing import graph_stages

    stages = graph_stages(model, [(tokens[:, :4], 0), (tokens[:, 4:5], 4)], {"dcp_size": 2})
    # stages[i]["captured"]: graph i as Dynamo captured it; stages[i][name]: after pass `name`
    self.assertExpectedInline(stages[-1]["attention"], '''...''')

`graph_stages` compiles a copy of the model with backend "dcp" on an in-process fake
process group of the chosen size and rank (no real ranks, no data exchanged: shapes are
right, values are not), calls it with each argument tuple in turn (prefill, then decode
steps: each new kind of call may compile a new graph) and returns, for every graph
compiled, its code before the pass and after every named pass that ran
(`dcp_pass.rewrites.apply.DEFAULT_PASSES`). The code is `readable_code`: Dynamo's long
input names shortened (`l_self_modules_attn_buffers_kv_cache_` -> `attn_kv_cache`),
liveness comments and alias lines dropped, so it is stable from run to run and reads
like the model. The model you pass is left as it is: its caches are not striped.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx as fx

__all__ = ["graph_stages", "readable_code", "fake_process_group"]

_NAME = re.compile(r"\b[lL]_(\w+?)_\b")


def _short_name(m: re.Match) -> str:
    name = m.group(1)
    if name.startswith("self_"):
        name = re.sub(r"(?:modules|parameters|buffers)_", "", name[len("self_") :])
    return name


def readable_code(gm_or_code: Any) -> str:
    """A graph's Python code normalized for pinning (see the module docstring)."""
    if isinstance(gm_or_code, fx.GraphModule):  # from the graph: a pass may not have recompiled the module yet
        code = gm_or_code.graph.python_code(root_module="self").src
    else:
        code = str(gm_or_code)
    out = []
    for line in code.strip("\n").splitlines():
        line = line.rstrip()
        if not line:
            continue
        if line.startswith("def forward("):
            params = line[len("def forward(") : -2].split(", ")
            line = "def forward(" + ", ".join(p.split(" : ")[0] for p in params) + "):"
        elif re.fullmatch(r"\s+l_\w+_ = L_\w+_", line):
            continue
        line = re.sub(r";  [\w ,=]+ = None$", "", line)
        out.append(_NAME.sub(_short_name, line))
    return "\n".join(out)


class fake_process_group:
    """`with fake_process_group(c, rank):` an in-process process group of `c` ranks (torch's
    "fake" backend: collectives return right-shaped garbage), torn down on exit. Refuses
    to replace a process group that is already initialised."""

    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank = world_size, rank

    def __enter__(self):
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError(
                "graph_stages needs to create its own fake process group, but one is already "
                "initialised; call it from a process without torch.distributed set up"
            )
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return False


def graph_stages(
    model: torch.nn.Module,
    calls: Sequence[Sequence[Any]],
    options: Optional[Mapping[str, Any]] = None,
    *,
    rank: int = 0,
    inner: str = "eager",
) -> list[dict[str, str]]:
    """For every graph compiled while calling (a copy of) `model` with each argument tuple of
    `calls`: {"captured": code, <pass name>: code after that pass, ...}, in pipeline order.

    `options` are the backend's (dcp_size defaults to 2; tp_size to 1, a model whose heads
    are not sharded). Runs under torch.no_grad() on a fake group of dcp_size ranks as `rank`.
    """
    from dcp_pass.backend import DcpBackend

    opts = {"dcp_size": 2, "tp_size": 1, "inner": inner, **dict(options or {})}
    world = opts["dcp_size"] * max(1, opts.get("attn_dp_size", 1)) * max(1, opts["tp_size"] // opts["dcp_size"])
    world = max(world, opts["tp_size"], opts["dcp_size"])
    work = copy.deepcopy(model)
    stages: list[dict[str, str]] = []

    def observe(name: str, gm: fx.GraphModule) -> None:
        stages[-1][name] = readable_code(gm)

    backend = DcpBackend(opts)
    backend.observer = observe
    original_call = backend.__call__

    def record(gm, example_inputs, **kwargs):
        stages.append({"captured": readable_code(gm)})
        return original_call(gm, example_inputs, **kwargs)

    with fake_process_group(world, rank):
        run_compiled(work, record, calls)
    return stages


def run_compiled(model: torch.nn.Module, backend, calls: Sequence[Sequence[Any]]) -> None:
    """Compile `model` with `backend` and make each call of `calls` under no_grad, between two
    Dynamo resets (so neither earlier nor later compiles see this one's graphs)."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(model, backend=backend)
            for args in calls:
                compiled(*args)
    finally:
        torch._dynamo.reset()
