"""What the pass did: matches, rewrites, fallbacks with reasons, bytes per rank.

`print(dcp_pass.last_report())` (or `str(report)`) is the overview: how many MLA layers
were rewritten (distinct layers, also when several share one compiled graph), the KV
cache bytes, and what happened to each graph, identical graphs grouped. `summary()`
lists every graph on its own.

Logged through the logger "dcp_pass" (enable with DCP_LOGS=info or DCP_LOGS=debug):
each graph's lines once, when it compiles.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

from dcp_pass import env

log = logging.getLogger("dcp_pass")
_REPORT_TOKENS = count()  # tells reports apart in the kernel choices kept per layer (run-time state)


def _configure_from_env() -> None:
    """DCP_LOGS=info|debug switches the "dcp_pass" logger on, like TORCH_LOGS does for torch.

    (TORCH_LOGS itself is parsed when torch is imported and rejects names it does not
    know, so a third-party log cannot live there.)
    """
    level = env.logs_level()
    if not level:
        return
    log.setLevel(logging.DEBUG if level in ("debug", "+dcp", "2") else logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[dcp_pass] %(message)s"))
        log.addHandler(handler)


_configure_from_env()


@dataclass
class LayerReport:
    layer: str
    rewritten: bool
    detail: str  # what was emitted, or why it fell back


@dataclass
class PassRecord:
    """One named pass of the pipeline on one graph: what it matched or did, and its notes."""

    name: str
    matched_count: int
    notes: list[str] = field(default_factory=list)


@dataclass
class GraphReport:
    graph_index: int
    layers: list[LayerReport] = field(default_factory=list)
    near_misses: list[tuple[str, str]] = field(default_factory=list)
    unchanged_reason: str = ""
    notes: list[str] = field(default_factory=list)  # other decisions (e.g. the step position)
    passes: list[PassRecord] = field(default_factory=list)  # the pipeline's passes, in order

    @property
    def rewritten(self) -> int:
        return sum(layer.rewritten for layer in self.layers)

    def reset(self) -> None:
        """Back to what a new report of this graph holds (a rewrite starting again writes it anew)."""
        self.__dict__.update(type(self)(self.graph_index).__dict__)

    def detail_lines(
        self, other_fields: bool = True, kernel_of: Optional[Callable[[LayerReport], str]] = None
    ) -> list[str]:
        """What happened in this graph, one line each (without the graph's head line);
        `other_fields`: also the fields added to GraphReport that this renderer does not name;
        `kernel_of`: what a rewritten layer's attention runs on, appended to its line."""
        lines = [
            f"{'rewrote' if layer.rewritten else 'kept   '} {layer.layer}: {layer.detail}"
            + (f"; {kernel_of(layer)}" if kernel_of is not None and layer.rewritten else "")
            for layer in self.layers
        ]
        lines += [f"near miss at {where}: {reason}" for where, reason in self.near_misses]
        lines += list(self.notes)
        if other_fields:
            if self.passes:
                lines.append("passes: " + ", ".join(f"{p.name} {p.matched_count}" for p in self.passes))
            for f in dataclasses.fields(self):
                if f.name not in _GRAPH_FIELDS_SHOWN:
                    lines += _field_lines(f.name, getattr(self, f.name))
        return lines

    def lines(self, other_fields: bool = True, kernel_of: Optional[Callable[[LayerReport], str]] = None) -> list[str]:
        """The graph's head line, then its details indented."""
        head = f"graph {self.graph_index}: {self.rewritten} MLA layer(s) rewritten"
        if self.unchanged_reason:
            head += f" (unchanged: {self.unchanged_reason})"
        return [head] + ["  " + line for line in self.detail_lines(other_fields, kernel_of)]


_GRAPH_FIELDS_SHOWN = {"graph_index", "layers", "near_misses", "unchanged_reason", "notes", "passes"}


def _field_lines(name: str, value: Any) -> list[str]:
    """A field of a report rendered without knowing it: nothing when empty, else one line,
    `name: value` (a list's items joined by commas, each item as `_item_text` reads)."""
    if value is None or value == "" or (isinstance(value, (list, tuple, dict, set)) and not value):
        return []
    if isinstance(value, dict):
        value = list(value.items())
    if isinstance(value, (list, tuple, set)):
        return [f"{name}: {', '.join(_item_text(item) for item in value)}"]
    return [f"{name}: {value}"]


def _item_text(item: Any) -> str:
    """A record (dataclass or tuple) as its parts separated by spaces, a list part in
    parentheses and an empty one left out: `PassRecord("complex_as_real", 0, ["off"])`
    reads `complex_as_real 0 (off)`."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        item = tuple(getattr(item, f.name) for f in dataclasses.fields(item))
    if not isinstance(item, tuple):
        return str(item)
    parts = []
    for part in item:
        if isinstance(part, (list, tuple, set)):
            if part:
                parts.append(f"({', '.join(map(str, part))})")
        else:
            parts.append(str(part))
    return " ".join(parts)


def cache_layers(graph: GraphReport, cache_names: Sequence[str]) -> list[Optional[str]]:
    """For each cache input of a rewritten graph, the name of the layer it identifies, or None.

    A layer is known at run time by one cache buffer: the first by name of those held by
    its module (the pass names a layer after the module of its caches; a cache outside
    any module names the layer itself). Layers that share one compiled graph (a Block
    compiled once, called per layer) then count once per buffer actually passed, and the
    same layer reached through two graphs counts once.
    """
    out: list[Optional[str]] = [None] * len(cache_names)
    order = sorted(range(len(cache_names)), key=lambda i: cache_names[i])
    for layer in graph.layers:
        if not layer.rewritten:
            continue
        mine = [i for i in order if out[i] is None and cache_names[i].rsplit(".", 1)[0] == layer.layer]
        if mine:
            out[mine[0]] = layer.layer
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ranges(indices: Iterable[int]) -> str:
    """[0, 3, 4, 5, 9] -> '0, 3-5, 9'."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(repr=False)
class DcpReport:
    """Accumulates over every graph the backend compiled (one report per backend instance)."""

    dcp_size: int = 1
    rank: int = 0
    graphs: list[GraphReport] = field(default_factory=list)
    # one entry per cache: its key (below) -> (name, full, local) bytes
    caches: dict[Hashable, tuple[str, int, int]] = field(default_factory=dict)
    # one entry per distinct rewritten MLA layer: the key of the cache buffer it is known by
    # (see cache_layers), or (graph index, name) for a layer whose caches are not under its
    # path, -> the layer's name
    layers_seen: dict[Hashable, str] = field(default_factory=dict)
    _keys: dict[int, Hashable] = field(default_factory=dict)  # a live buffer's id -> its cache's key
    # a cache's key -> the token rows it holds without DCP (requests x positions), where known
    token_rows: dict[Hashable, int] = field(default_factory=dict)
    token: int = field(default_factory=lambda: next(_REPORT_TOKENS))

    def site(self, layer: str) -> Hashable:
        """The key under which the runtime keeps the kernel choice of `layer`'s attention."""
        return ("report", self.token, layer)

    def kernel_line(self, layer: LayerReport) -> str:
        """Which kernel `layer`'s attention ran on at its most recent call and why (the chooser's
        trace), or that it is chosen at the first call."""
        from dcp_pass.runtime.decode.kernels.registry import trace_for

        trace = trace_for(self.site(layer.layer))
        return "kernel chosen at the first call" if trace is None else f"kernel {trace.line()}"

    def knows(self, buffer: Any) -> bool:
        """Whether `buffer` (alive) is recorded."""
        return id(buffer) in self._keys

    def add_cache(
        self,
        buffer: Any,
        name: str,
        full: int,
        local: int,
        layer: Optional[str] = None,
        renewed: bool = False,
        token_rows: Optional[int] = None,
    ) -> Optional[Hashable]:
        """Record a cache buffer (`layer`: the layer it identifies); its cache's key when the
        cache is new to the report, else None.

        A module's buffer is a cache of its own, keyed by the buffer. A `renewed` one, a
        tensor of a cache object made anew for every generate (a Hugging Face cache), is
        keyed by its name and layer: a later generate's tensor takes the earlier one's place
        instead of adding to the bytes. An entry outlives its buffer (the report still
        describes the caches once a generate has dropped them); a new buffer that reuses a
        dead one's id is new. `token_rows`: the token rows the buffer holds without DCP
        (requests x positions), for the bytes per token."""
        ident = id(buffer)
        if ident in self._keys:
            return None
        key = ("renewed", name, layer) if renewed else ("buffer", ident)
        known = key in self.caches  # a renewed cache's earlier tensor: this one takes its place
        self.caches[key] = (name, full, local)
        if token_rows:
            self.token_rows[key] = token_rows
        self._keys[ident] = key
        try:
            weakref.finalize(buffer, self._forget, ident, key)
        except TypeError:  # not weak-referenceable: its id stays taken
            pass
        if layer is not None and key not in self.layers_seen:
            self.layers_seen[key] = layer
            log.debug(
                "rank %d: MLA layer %s seen with new caches (%s so far)",
                self.rank,
                layer,
                _plural(len(self.layers_seen), "layer"),
            )
        return None if known else key

    def _forget(self, ident: int, key: Hashable) -> None:
        """A buffer died: its id may be reused; a module buffer's entry moves to a key no
        later buffer can have (a renewed cache's stays, for its successor to take)."""
        if self._keys.get(ident) == key:
            del self._keys[ident]
        if isinstance(key, tuple) and key[0] == "buffer":
            token = ("dead", object())
            if key in self.caches:
                self.caches[token] = self.caches.pop(key)
            if key in self.token_rows:
                self.token_rows[token] = self.token_rows.pop(key)
            if key in self.layers_seen:
                self.layers_seen[token] = self.layers_seen.pop(key)

    def layer_paths(self, model: Any) -> list[str]:
        """The module paths in `model` (an nn.Module, the one compiled) of the layers whose
        cache buffers this report recorded, in the model's order: where the report's own
        names are relative to the compiled graph (a block compiled once and called per
        layer names every layer `attn`), these tell the layers apart."""
        paths: list[str] = []
        for name, buffer in model.named_buffers(remove_duplicate=False):
            if self.knows(buffer):
                path = name.rpartition(".")[0]
                if path not in paths:
                    paths.append(path)
        return paths

    def add_uncached_layers(self, graph: GraphReport, cache_layer_names: Iterable[Optional[str]]) -> None:
        """Count the rewritten layers of `graph` that no cache identifies, by graph and name."""
        known = set(cache_layer_names)
        for layer in graph.layers:
            if layer.rewritten and layer.layer not in known:
                self.layers_seen.setdefault((graph.graph_index, layer.layer), layer.layer)

    @property
    def kv_bytes_full(self) -> int:
        """Bytes the model's cache buffers would hold on this rank without DCP."""
        return sum(full for _, full, _ in self.caches.values())

    @property
    def kv_bytes_local(self) -> int:
        """Bytes this rank really holds for them with DCP."""
        return sum(local for _, _, local in self.caches.values())

    @property
    def bytes_per_token_per_layer(self) -> Optional[tuple[float, float]]:
        """Striped cache bytes one token of context costs a layer, without DCP and on this rank
        with it (its shard, spare row included), averaged over the layers the caches belong to
        (a cache's layer: its name up to the last dot); None when no cache's token rows are
        known. Caches every rank keeps whole (an indexer's, a window's) are not counted."""
        per_layer: dict[str, list[float]] = {}
        for key, rows in self.token_rows.items():
            if key not in self.caches:
                continue
            name, full, local = self.caches[key]
            sums = per_layer.setdefault(name.rpartition(".")[0], [0.0, 0.0])
            sums[0] += full / rows
            sums[1] += local / rows
        if not per_layer:
            return None
        return (
            sum(f for f, _ in per_layer.values()) / len(per_layer),
            sum(loc for _, loc in per_layer.values()) / len(per_layer),
        )

    @property
    def layers_rewritten(self) -> int:
        """Distinct MLA layers rewritten: a layer reached through several graphs counts once,
        layers sharing one graph count each (told apart by their cache buffers)."""
        return len(self.layers_seen)

    @property
    def graph_rewrites(self) -> int:
        """Rewritten layers summed over graphs (a layer in two graphs counts twice)."""
        return sum(g.rewritten for g in self.graphs)

    def _cache_lines(self) -> list[str]:
        if not self.caches:
            return []
        # their full-size storage is released (or, when shared, no longer written):
        # eager code outside compiled graphs must not read these buffers any more
        names = sorted({name for name, _, _ in self.caches.values()})
        full, local = self.kv_bytes_full, max(self.kv_bytes_local, 1)
        # at dcp_size=1 (option fast_path) a shard's spare row makes it a little larger
        ratio = f"{full / local:.2f}x less" if full >= local else f"{local / max(full, 1):.2f}x more: no DCP"
        lines = [
            f"KV cache bytes on this rank: {self.kv_bytes_full} without DCP -> {self.kv_bytes_local} with DCP ({ratio})"
        ]
        per_token = self.bytes_per_token_per_layer
        if per_token is not None:
            lines.append(
                f"striped cache bytes per token per layer: {per_token[0]:.4g} without DCP -> "
                f"{per_token[1]:.4g} on this rank"
            )
        return lines + [f"striped, not to be read outside compiled graphs: {', '.join(names)}"]

    def summary(self) -> str:
        """Every graph on its own lines (a rewritten layer's ends with the kernel its attention
        ran on and why, once it has run), then the caches."""
        lines = [f"dcp_pass report: dcp_size={self.dcp_size} rank={self.rank}, {len(self.graphs)} graph(s)"]
        for g in self.graphs:
            lines += ["  " + line for line in g.lines(other_fields=False, kernel_of=self.kernel_line)]
        lines += ["  " + line for line in self._cache_lines()]
        return "\n".join(lines)

    def graph_log(self, graph: GraphReport, new_caches: Sequence[Hashable] = ()) -> str:
        """What one graph's compile adds to the report (logged once, when it compiles)."""
        own = graph.lines()
        lines = [f"rank {self.rank} {own[0]}"] + own[1:]
        if new_caches:
            full = sum(self.caches[k][1] for k in new_caches)
            local = sum(self.caches[k][2] for k in new_caches)
            names = ", ".join(sorted({self.caches[k][0] for k in new_caches}))
            lines.append(
                f"  striped {names}: {full} -> {local} bytes on this rank "
                f"(all caches so far: {self.kv_bytes_full} -> {self.kv_bytes_local})"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        layers = self.layers_rewritten
        used = [g for g in self.graphs if g.rewritten]
        head = (
            f"dcp_pass report (dcp_size={self.dcp_size}, rank {self.rank}): "
            f"{_plural(layers, 'MLA layer')} rewritten, in {len(used)} of {_plural(len(self.graphs), 'graph')}"
        )
        lines = [head]
        if self.layers_seen:
            counts = Counter(self.layers_seen.values())
            shown = [name if n == 1 else f"{name} x{n}" for name, n in counts.items()]
            more = f" and {len(shown) - 8} more" if len(shown) > 8 else ""
            lines.append(f"  layers: {', '.join(shown[:8])}{more}")
        lines += ["  " + line for line in self._cache_lines()]
        groups: dict[tuple[str, ...], list[int]] = {}
        for g in self.graphs:
            if g.unchanged_reason:
                body = (f"unchanged: {g.unchanged_reason}",) + tuple(g.detail_lines())
            else:
                body = tuple(g.detail_lines()) or ("nothing to rewrite",)
            groups.setdefault(body, []).append(g.graph_index)
        for body, indices in groups.items():
            where = f"graph {indices[0]}" if len(indices) == 1 else f"graphs {_ranges(indices)}"
            if len(body) == 1:
                lines.append(f"  {where}: {body[0]}")
            else:
                lines.append(f"  {where}:")
                lines += [f"    {line}" for line in body]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<DcpReport dcp_size={self.dcp_size} rank={self.rank}: {_plural(len(self.graphs), 'graph')}, "
            f"{_plural(self.layers_rewritten, 'MLA layer')} rewritten, {_plural(len(self.caches), 'cache')}>"
        )
