"""Runtime pieces of DCP, in two halves.

``decode/``: the decode path the rewritten graph calls (layout math and allocators, merge,
collectives, the backend tables, the attention operands, op and kernels).
``compose/``: compositions built on the striped cache (KV transfer, host tier, extend,
speculative verification); they import the decode half, never the other way round.

Nothing in here knows about FX graphs: the rewrites emit calls into these modules.

The modules' paths of the release before the split (``dcp_pass.runtime.layout``,
``dcp_pass.runtime.kernels.mla_attention``, ...) still import, for one release, with a
DeprecationWarning naming the new path: they are the same module objects.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old name under dcp_pass.runtime -> its path now (a package's submodules follow it)
MOVED = {
    "layout": "decode.layout",
    "merge": "decode.merge",
    "merge_checks": "decode.merge_checks",
    "comm": "decode.comm",
    "backends": "decode.backends",
    "ops": "decode.ops",
    "kernels": "decode.kernels",
    "transfer": "compose.transfer",
    "host_tier": "compose.host_tier",
    "extend": "compose.extend",
    "speculative": "compose.speculative",
}

_PREFIX = __name__ + "."


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}; the old path is kept for one release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass  # imported at its own path already


class _MovedModules(importlib.abc.MetaPathFinder):
    """Finds the old paths (first on sys.meta_path: a submodule of an old package path must not
    be found again, as a second copy, through the package's __path__)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_PREFIX):
            return None
        top, dot, rest = fullname[len(_PREFIX):].partition(".")
        if top not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(_PREFIX + MOVED[top] + dot + rest))


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
