"""What the pass did to each graph: matches, rewrites, fallbacks with reasons, bytes per rank.

Logged through the logger "dcp_pass" (enable with DCP_LOGS=info or DCP_LOGS=debug).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

log = logging.getLogger("dcp_pass")


def _configure_from_env() -> None:
    """DCP_LOGS=info|debug switches the "dcp_pass" logger on, like TORCH_LOGS does for torch.

    (TORCH_LOGS itself is parsed when torch is imported and rejects names it does not
    know, so a third-party log cannot live there.)
    """
    level = os.environ.get("DCP_LOGS", "").strip().lower()
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


@dataclass
class DcpReport:
    """Accumulates over every graph the backend compiled (one report per backend instance)."""

    dcp_size: int = 1
    rank: int = 0
    graphs: list[GraphReport] = field(default_factory=list)
    caches: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # id -> (name, full, local) bytes

    def add_cache(self, key: int, name: str, full: int, local: int) -> None:
        self.caches.setdefault(key, (name, full, local))

    @property
    def kv_bytes_full(self) -> int:
        """Bytes the model's cache buffers would hold on this rank without DCP."""
        return sum(full for _, full, _ in self.caches.values())

    @property
    def kv_bytes_local(self) -> int:
        """Bytes this rank really holds for them with DCP."""
        return sum(local for _, _, local in self.caches.values())

    @property
    def layers_rewritten(self) -> int:
        return sum(g.rewritten for g in self.graphs)

    def summary(self) -> str:
        lines = [f"dcp_pass report: dcp_size={self.dcp_size} rank={self.rank}, {len(self.graphs)} graph(s)"]
        for g in self.graphs:
            head = f"  graph {g.graph_index}: {g.rewritten} MLA layer(s) rewritten"
            if g.unchanged_reason:
                head += f" (unchanged: {g.unchanged_reason})"
            lines.append(head)
            for layer in g.layers:
                lines.append(f"    {'rewrote' if layer.rewritten else 'kept   '} {layer.layer}: {layer.detail}")
            for where, reason in g.near_misses:
                lines.append(f"    near miss at {where}: {reason}")
            for note in g.notes:
                lines.append(f"    {note}")
        if self.caches:
            lines.append(
                f"  KV cache bytes on this rank: {self.kv_bytes_full} without DCP -> {self.kv_bytes_local} with DCP "
                f"({self.kv_bytes_full / max(self.kv_bytes_local, 1):.2f}x less)"
            )
            # their full-size storage is released (or, when shared, no longer written):
            # eager code outside compiled graphs must not read these buffers any more
            names = sorted({name for name, _, _ in self.caches.values()})
            lines.append(f"  striped, not to be read outside compiled graphs: {', '.join(names)}")
        return "\n".join(lines)
