"""Tensors with no memory behind them, and moving tensors onto memory.

A cache built under `dcp_pass.deferred_caches()`, the stand-in the compiled graph takes for
a striped buffer, and the full-shape tensor of a cache a graph allocates all have the full
buffer's shape, stride, dtype and device (what Dynamo fakeifies and guards) and no memory.
"""

from __future__ import annotations

import gc
from typing import Any, Optional

import torch


def storage_nbytes(shape, stride, element_size: int, offset: int = 0) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))) * element_size


def unallocated(shape, stride, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of this shape, stride, dtype and device with no memory behind it; allocates nothing.

    `set_` checks that the storage is big enough for the shape, so the tensor sits on a
    non-owning, non-resizable storage of the full byte size whose pointer is null: what
    Dynamo fakeifies and guards (shape, stride, dtype, device) is the full buffer's, and
    nothing can ever be read through it. It gets memory only by moving onto a new storage
    (`back`). One mechanism on every torch >= 2.11: 2.11 has no way to give a storage a
    pointer in place (`UntypedStorage._swap_data_ptr_` came later), so none is used.
    """
    t = torch.empty(0, dtype=dtype, device=device)
    nbytes = storage_nbytes(shape, stride, t.element_size())
    shell = torch._C._construct_storage_from_data_pointer(0, t.device, nbytes)
    t.set_(shell, 0, tuple(shape), tuple(stride))
    return t


def has_memory(t: torch.Tensor) -> bool:
    """False for an `unallocated` tensor (and every other alias of its storage)."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return True  # nothing to back
    try:
        return storage.data_ptr() != 0
    except RuntimeError:  # torch refuses the pointer of a null storage that claims bytes: ours
        return False


def held_nbytes(t: torch.Tensor) -> int:
    """Bytes of memory behind `t`'s storage: 0 for an `unallocated` one."""
    return t.untyped_storage().nbytes() if has_memory(t) else 0


def new_backing(shell: torch.UntypedStorage, fill: Optional[float]) -> torch.UntypedStorage:
    """Memory for the tensors of `shell` (an `unallocated` storage), filled if asked."""
    storage = torch.UntypedStorage(shell.nbytes(), device=shell.device)
    if fill is not None:
        assert fill == 0.0, fill  # torch.zeros; torch.empty has no fill
        storage.fill_(0)  # type: ignore[attr-defined]  # torch's stubs omit UntypedStorage.fill_
    return storage


def move_onto(t: torch.Tensor, storage: torch.UntypedStorage) -> None:
    """Point `t` (same object, shape, stride and offset) at `storage`."""
    with torch.no_grad():
        torch.Tensor.set_(t, storage, t.storage_offset(), t.shape, t.stride())


def aliases_of(shells: dict[int, Any]) -> list[torch.Tensor]:
    """Every live tensor whose storage is one of `shells` (keyed by `_cdata`).

    A scan of the garbage collector's objects: used only when a shell still has users we
    do not know (an alias made without a torch call we see, e.g. `nn.Parameter(t)` never
    touched before the model is built), once per construction.
    """
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no __class__ lookups
            try:
                if obj.untyped_storage()._cdata in shells:
                    found.append(obj)
            except (RuntimeError, NotImplementedError):  # fake, functional or other storage-less tensors
                continue
    return found


def back(t: torch.Tensor, fill: Optional[float]) -> None:
    """Give an `unallocated` tensor, and every other tensor on its storage, memory (filled if asked)."""
    shell = t.untyped_storage()
    storage = new_backing(shell, fill)
    move_onto(t, storage)
    # Left: the Python storage object `shell` itself (1); anything more is another alias.
    if torch._C._storage_Use_Count(shell._cdata) > 1:
        for alias in aliases_of({shell._cdata: shell}):
            move_onto(alias, storage)
