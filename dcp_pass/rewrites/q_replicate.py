"""Compile-time replication of the query projection (SPEC section 3).

Placeholder: every layer uses the query all-gather until replication lands.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx


class QueryReplicator:
    def __init__(self, gm: fx.GraphModule, values: dict[str, Any], plan, requested: Optional[bool]):
        self.plan = plan
        self.requested = requested

    def queries_for(self, match) -> tuple[Optional[tuple], str]:
        if not self.plan.head_sharded:
            return None, "local (all heads on every rank)"
        return None, "all-gather"

    def finalize(self) -> None:
        pass
