"""The per-call feeder of a rewritten graph: the inputs the pass added, resolved for each call.

A rewritten graph takes, after its own inputs, this rank's cache shards, the other ranks'
gathered weight shards and (rewrites/positions.py) a static device buffer holding the step
position. One compiled graph serves every layer whose module shares its code (Dynamo passes
each layer's buffers as inputs), so each call looks its shards and weights up from the
tensors actually passed. The feeder holds no shard or weight itself: Dynamo keeps compiled
functions after ``torch._dynamo.reset()``, and whatever they hold strongly would outlive the
model.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dcp_pass.report import DcpReport
from dcp_pass.runtime.decode import step_count
from dcp_pass.runtime.decode.kernels.registry import collecting
from dcp_pass.state.guards import StripedCacheTensor
from dcp_pass.state.memory import unallocated
from dcp_pass.state.shards import AllocatedCache, install_allocated, local_for
from dcp_pass.state.store import LocalCache
from dcp_pass.state.weights import ExtraInput, WeightCheck, resolve_inputs

_STANDINS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # striped buffer -> its plain stand-in


def plain_inputs(args: Sequence[Any]) -> list:
    """`args` with every striped cache buffer replaced by a plain tensor of the same shape,
    stride, dtype and device and no memory (memory.unallocated): the rewritten graph never
    reads those inputs, and the inner compiler must not meet their guarding class."""
    out = list(args)
    for i, a in enumerate(out):
        if type(a) is StripedCacheTensor:
            standin = _STANDINS.get(a)
            if standin is None:
                standin = _STANDINS[a] = unallocated(a.shape, a.stride(), a.dtype, a.device)
            out[i] = standin
    return out


def has_striped(args: Sequence[Any]) -> bool:
    return any(type(a) is StripedCacheTensor for a in args)


class CallFeeder:
    """Calls `compiled` (a rewritten graph, compiled with the trailing inputs the pass added)
    with the model's inputs, feeding the trailing inputs per call.

    `caches`: (input index, example shard) of each cache buffer the graph reads; its shard is
    looked up (installed on first sight) from the buffer passed. `layers`: for each, the layer
    it identifies in the report (report.cache_layers).
    `weights`: the other ranks' weight shards, resolved from the weight passed; `checks`:
    parameters the graph uses for every rank's heads, checked unchanged per call.
    `allocations`: cache tensors the graph allocated. Every call gets new ones: a full-shape
    tensor without memory, passed after the graph's own inputs and returned where the graph
    returned the allocation, and its zeroed shard, passed after the other shards and installed
    as its stripe once the call has written it. No rank ever holds the full-size tensor.
    `allocation_layers`: for each, the layer it identifies in the report.
    `position` (rewrites/positions.py): the graph no longer takes the int step position: it is
    written into a static device buffer, the graph's last input, before each call, so the
    graph's inputs are the same objects at every step; `host_counts`: the graph's host-planned
    kernels (FlashInfer) are re-planned before each call.
    `attention_layers`: the graph's rewritten layers, in the order their attention calls run:
    the kernel choices of each call are kept under their sites for the report.
    """

    def __init__(
        self,
        compiled: Callable,
        report: DcpReport,
        caches: Sequence[tuple[int, LocalCache]],
        weights: Sequence[ExtraInput] = (),
        checks: Sequence[WeightCheck] = (),
        allocations: Sequence[AllocatedCache] = (),
        position: Any = None,
        host_counts: bool = False,
        layers: Optional[Sequence[Optional[str]]] = None,
        allocation_layers: Optional[Sequence[Optional[str]]] = None,
        attention_layers: Sequence[str] = (),
    ):
        self.compiled = compiled
        self.report = report
        layers = list(layers) if layers is not None else [None] * len(caches)
        # what each shard is looked up by: no shard itself (a feeder outlives the model)
        self.specs = [
            (index, entry.c, entry.rank, entry.name, entry.kind, entry.kv_format, layer)
            for (index, entry), layer in zip(caches, layers)
        ]
        self.weights = list(weights)
        self.checks = list(checks)
        self.allocations = list(allocations)
        self.allocation_layers = (
            list(allocation_layers) if allocation_layers is not None else [None] * len(self.allocations)
        )
        self.position = position
        self.plans = step_count.HostPlans() if host_counts else None
        self.sites = [report.site(layer) for layer in attention_layers]

    def __call__(self, *args):
        fresh = [a.make() for a in self.allocations]
        shells = [shell for shell, _ in fresh]
        if fresh and fresh[0][0].device.type == "cuda":
            for shell in shells:  # as a cache allocated eagerly is: later graphs keep their CUDA graphs
                torch._dynamo.mark_static_address(shell, guard=False)
        out = self._call_graph(args, shells, [entry.local for _, entry in fresh])
        for a, (shell, entry), layer in zip(self.allocations, fresh, self.allocation_layers):
            install_allocated(shell, entry)
            self.report.add_cache(
                shell, a.name, entry.full_nbytes, entry.local_nbytes, layer, renewed=True, token_rows=entry.token_rows
            )
        return _returning(out, self.allocations, shells) if self.allocations else out

    def _call_graph(self, args, shells, made_shards):
        shards = []
        for index, c, rank, name, kind, kv_format, layer in self.specs:
            buffer = args[index]
            entry = local_for(buffer, c, rank, name, kind, kv_format)
            if not self.report.knows(buffer):  # a layer first seen at run time (one graph, several layers)
                self.report.add_cache(
                    buffer,
                    name,
                    entry.full_nbytes,
                    entry.local_nbytes,
                    layer,
                    renewed=kind.installed_at_first_call,
                    token_rows=entry.token_rows,
                )
            shards.append(entry.local)
        for check in self.checks:
            check.check(args[check.index])
        replicas = resolve_inputs(self.weights, args)
        # Dynamo calls backends' results with positional args; so do we.
        shards += made_shards
        position = self.position
        with collecting(self.sites):
            if position is None:
                return self.compiled(*plain_inputs(args), *shells, *shards, *replicas)
            inputs = plain_inputs(position.call_args(args)) + shells
            if self.plans is None:
                return self.compiled(*inputs, *shards, *replicas, position.buffer)
            with step_count.step(self.plans, position.key_count(args)):
                return self.compiled(*inputs, *shards, *replicas, position.buffer)


def _returning(out, allocations, shells):
    """The graph's outputs with each allocated cache's full-shape tensor where the graph returns it."""
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    for a, shell in zip(allocations, shells):
        for i in a.outputs:
            flat[i] = shell
    if isinstance(out, (list, tuple)):
        return type(out)(flat)
    return flat[0]
