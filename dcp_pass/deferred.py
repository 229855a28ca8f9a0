"""Build a model whose KV caches never exist at full size.

    with dcp_pass.deferred_caches():
        model = Transformer(args)
    model = torch.compile(model, backend="dcp", options={"dcp_size": 2})

Inside the context, large `torch.zeros` / `torch.empty` results start as `unallocated`
tensors: full shape, stride, dtype and device (what Dynamo guards and the model code
slices), no memory. One that the module registers with
`register_buffer(name, t, persistent=False)` (the reference style for KV caches) stays
that way and becomes a deferred cache: the first DCP compile (or `materialize`) gives it
only this rank's stripe. Any other such tensor (a weight, a persistent buffer) gets its
memory, zeroed for `torch.zeros`, before its first use or when the context exits, so the
rest of the model is built exactly as without the context.

A deferred cache whose module runs eagerly, or that is pickled, saved or compiled by
another backend, raises `DcpCacheError` naming it (state/guards.py, `guard`); one that
a DCP graph reads outside an attention the pass rewrites is refused by the pass. Moving
or deep-copying the model keeps it deferred (there is nothing to copy). Code that reads
the tensor object itself (`buf.sum()`) is not intercepted: it reads a null storage.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from dcp_pass.state import guards, memory, shards
from dcp_pass.state.store import DcpCacheError, describe, is_deferred

_FACTORIES = {torch.zeros: 0.0, torch.empty: None}  # factory -> fill
# Calls that read only metadata: they leave a tensor without memory (nn.Linear's init reads
# weight.shape before it writes the weight, and we read storages to find our tensors).
_METADATA = {
    getattr(torch.Tensor, m)
    for m in (
        "untyped_storage",
        "size",
        "dim",
        "stride",
        "numel",
        "element_size",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
    )
}
_METADATA |= {
    getattr(torch.Tensor, p).__get__
    for p in ("shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_cuda", "is_meta", "grad_fn", "is_leaf")
}


class _DeferMode(TorchFunctionMode):
    """Creates large zeros/empty tensors without memory and backs them on first use."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes = min_bytes
        # Keyed by the `_cdata` of the storage each tensor made here starts on (kept alive
        # here, so the key stays unique). Keyed by storage, not tensor:
        # `nn.Parameter(torch.empty(...))` keeps only an alias of the tensor made.
        self.pending: dict[int, tuple[torch.UntypedStorage, Optional[float]]] = {}  # shell, fill
        self.backed: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}  # shell, memory

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and "out" not in kwargs:
            made = self._unallocated(func, args, kwargs)
            if made is not None:
                return made
        if func not in _METADATA:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self._back(leaf)
        return func(*args, **kwargs)

    def _unallocated(self, func, args, kwargs) -> Optional[torch.Tensor]:
        device = torch.device(kwargs.get("device") or torch.get_default_device())
        if device.type == "meta" or kwargs.get("requires_grad") or kwargs.get("pin_memory"):
            return None
        meta = func(*args, **{**kwargs, "device": "meta"})  # shape, dtype, stride as the call asks
        nbytes = meta.numel() * meta.element_size()
        if meta.layout != torch.strided or nbytes == 0 or nbytes < self.min_bytes:
            return None
        t = memory.unallocated(meta.shape, meta.stride(), meta.dtype, device)
        shell = t.untyped_storage()
        self.pending[shell._cdata] = (shell, _FACTORIES[func])
        return t

    def _back(self, t: torch.Tensor) -> None:
        """Before a torch call reads or writes `t`: move it onto memory if it is on one of our shells."""
        if is_deferred(t):
            name, _ = describe(t)
            raise DcpCacheError(
                f"dcp_pass: deferred cache buffer {name} was used while the model is built "
                f"under dcp_pass.deferred_caches(); it has no memory until DCP stripes it"
            )
        if (
            (self.pending or self.backed)
            and t.layout == torch.strided
            and t.device.type != "meta"
            and not memory.has_memory(t)
        ):
            backing = self._memory_for(t.untyped_storage()._cdata)
            if backing is not None:  # every alias that reaches a torch call moves onto the same memory
                memory.move_onto(t, backing)

    def _memory_for(self, key: int) -> Optional[torch.UntypedStorage]:
        """The memory of our shell `key` (allocated on first need), or None if it is not ours."""
        if key in self.pending:
            shell, fill = self.pending.pop(key)
            self.backed[key] = (shell, memory.new_backing(shell, fill))
        held = self.backed.get(key)
        return None if held is None else held[1]

    def claim(self, t: torch.Tensor) -> tuple[bool, Optional[float]]:
        """Whether `t` is one of ours, still without memory (it stops being pending), and its fill."""
        held = self.pending.pop(t.untyped_storage()._cdata, None)
        return (False, None) if held is None else (True, held[1])

    def back_all(self) -> None:
        """At exit: every tensor still on one of our shells (but deferred caches) gets its memory."""
        # Each shell is referenced here once; more means a tensor still uses it.
        live = {
            key: entry for key, entry in {**self.pending, **self.backed}.items() if torch._C._storage_Use_Count(key) > 1
        }
        if live:
            for alias in memory.aliases_of(live):
                if is_deferred(alias):
                    continue
                backing = self._memory_for(alias.untyped_storage()._cdata)
                if backing is not None:  # an alias of one of our shells: it has memory now
                    memory.move_onto(alias, backing)
        self.pending.clear()
        self.backed.clear()


@contextlib.contextmanager
def deferred_caches(min_bytes: int = 1 << 20) -> Iterator[None]:
    """Build models inside this context so that their KV caches are never allocated at full size.

    Applies to `torch.zeros` / `torch.empty` results of at least `min_bytes` that a module
    registers with `register_buffer(..., persistent=False)`. Not thread-safe: it patches
    `nn.Module.register_buffer` while it is active.
    """
    mode = _DeferMode(min_bytes)
    original = torch.nn.Module.register_buffer

    def register_buffer(
        module: torch.nn.Module, name: str, tensor: Optional[torch.Tensor], persistent: bool = True
    ) -> None:
        original(module, name, tensor, persistent)
        if tensor is not None and not persistent:
            ours, fill = mode.claim(tensor)
            if ours:
                guards.defer(tensor, f"{type(module).__name__}.{name}", fill, module)

    setattr(torch.nn.Module, "register_buffer", register_buffer)
    try:
        with mode:
            yield
    finally:
        setattr(torch.nn.Module, "register_buffer", original)
        mode.back_all()


def materialize(
    model: torch.nn.Module, dcp_size: int, rank: Optional[int] = None, device: Any = None
) -> torch.nn.Module:
    """Give every deferred cache of `model` its storage now, instead of at the first DCP compile.

    dcp_size > 1: only this rank's stripe (the shard the DCP backend will use; `rank` is
    the DCP rank, as the backend's topology computes it). dcp_size == 1: the full buffer,
    zeroed, so the model runs as if built without `deferred_caches`. `device` first moves
    the model (deferred caches move without memory).
    """
    if device is not None:
        model.to(device)
    if dcp_size > 1 and rank is None:
        raise ValueError("materialize: pass rank= (this process's DCP rank) when dcp_size > 1")
    for name, buffer in model.named_buffers():
        if not is_deferred(buffer):
            continue
        if dcp_size == 1:
            guards.materialize_full(buffer)
        else:
            assert rank is not None  # refused above when dcp_size > 1
            shards.install(buffer, shards.shard_for(buffer, dcp_size, rank, name, shards.FLAT))
    return model
