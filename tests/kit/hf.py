"""Hugging Face generate() under the dcp backend, for tests: one rank's run, graph capture,
per-rank cache bytes. Import only after `pytest.importorskip("transformers")`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

PROMPTS = torch.tensor([[3, 5, 7, 9, 11, 2], [1, 2, 3, 4, 6, 8]])
NEW_TOKENS = 10


def generate(model, prompts: torch.Tensor = PROMPTS, new_tokens: int = NEW_TOKENS, cache=None):
    """Greedy static-cache generate (a new StaticCache, or `cache`) with logits and the cache returned."""
    given = dict(cache_implementation="static") if cache is None else dict(cache=cache)
    with torch.no_grad():
        return model.generate(prompts, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **given)


def logits_error(out, ref) -> float:
    """Largest relative error of the step logits against the reference's."""
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out.logits, ref.logits))


def cache_tensors(cache) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each static layer's keys and values."""
    found = []
    for i, layer in enumerate(cache.layers):
        for attr in ("keys", "values"):
            t = getattr(layer, attr, None)
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                found.append((f"layers.{i}.{attr}", t))
    return found


def held_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(bytes of memory behind the tensor's own storage, bytes of its DCP shard's storage; 0 without one)."""
    from dcp_pass.state.memory import held_nbytes
    from dcp_pass.state.store import lookup_local_cache

    entry = lookup_local_cache(t)
    own = held_nbytes(t)
    return own, (entry.local.untyped_storage().nbytes() if entry is not None else 0)


class GraphKeeper:
    """A backend that keeps every graph it is given (run as captured), with the
    placeholders' sources: Dynamo drops their "grapharg" once the backend returns, and the
    matcher names caches by source. `graphs` is filled on `restore()`."""

    def __init__(self):
        self.graphs: list = []
        self._kept: list = []

    def __call__(self, gm, example_inputs):
        self._kept.append((gm, list(example_inputs), {n: n.meta["grapharg"] for n in gm.graph.nodes
                                                       if "grapharg" in n.meta}))
        return gm.forward

    def restore(self) -> list:
        for gm, _, sources in self._kept:
            for node, grapharg in sources.items():
                node.meta["grapharg"] = grapharg
        self.graphs = [(gm, inputs) for gm, inputs, _ in self._kept]
        return self.graphs


def capture_graphs(model, prompts: torch.Tensor = PROMPTS[:1], new_tokens: int = 3) -> list[tuple[fx.GraphModule, list]]:
    """Every graph (with its example inputs) Dynamo captures in a compiled static generate."""
    keeper = GraphKeeper()
    torch._dynamo.reset()
    model.compile(backend=keeper)
    try:
        generate(model, prompts, new_tokens)
    finally:
        torch._dynamo.reset()
    return keeper.restore()


class DecodeCall(torch.nn.Module):
    """`model(input_ids, cache=cache)` as a module of positional arguments (what
    `dcp_pass.testing.graph_stages` calls)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, cache):
        return self.model(input_ids=input_ids, cache=cache, use_cache=True).logits


def static_cache(model, batch: int, max_len: int):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def lines_between(code: str, first: str, last: str) -> str:
    """The lines of `code` from the first containing `first` to the next containing `last`."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    return "\n".join(line.strip() for line in lines[start:end + 1])


def summary_counts(report) -> dict[str, Any]:
    """Per graph: layers rewritten."""
    return [g.rewritten for g in report.graphs]
