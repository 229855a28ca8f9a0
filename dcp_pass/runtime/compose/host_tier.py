"""Host-memory KV tier (L2 offload) for a striped DCP cache.

One widened logical page space spans the device pool (L1) and the host pool (L2):
the cache controller sees ``P * c`` virtual slots per page on both tiers, exactly
like the virtual allocator (docs/compositions.md, section 2). Each rank's device and host
buffers hold only its own ``P`` rows per page. Before a copy in either direction
both index lists keep the positions this rank owns (``i % c == rank``) and map them
to local rows ``i // c``. Transfers move whole widened pages, and every rank moves
its own shard on its own: there is no DCP collective, so ranks may offload and
reload at different times.

Device pools are flat ``[physical_slots, dim]`` tensors (physical slot ``v // c`` of
virtual slot ``v``), as written through the paged virtual allocator.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from dcp_pass.runtime.decode.layout import _check_rank, owner, physical

__all__ = ["HostTierError", "HostKVTier", "widened_page_indices", "local_rows"]


class HostTierError(ValueError):
    """A host-tier request that cannot be served (partial page, bad shape, ...)."""


Index = Union[torch.Tensor, Sequence[int]]


def _as_index(name: str, x: Index) -> torch.Tensor:
    t = torch.as_tensor(x).to("cpu")
    if t.dim() != 1:
        raise HostTierError(f"{name} must be a 1-D index list, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        return t.long()
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise HostTierError(f"{name} must hold integers, got {t.dtype}")
    t = t.long()
    if int(t.min()) < 0:
        raise HostTierError(f"{name} holds a negative index {int(t.min())}")
    return t


def _check_size(name: str, value) -> None:
    # bool is an int subclass: page_size=True would silently mean 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HostTierError(f"{name} must be an int >= 1, got {name}={value!r}")


def _check_no_duplicates(name: str, rows: torch.Tensor, width: int, what: str) -> None:
    """Destination rows of one copy must be distinct: index_copy_ keeps one of two writes."""
    if rows.numel() < 2:
        return
    values, counts = torch.unique(rows, return_counts=True)
    twice = values[counts > 1]
    if twice.numel():
        v = int(twice[0])
        raise HostTierError(
            f"{name} names {what} page {v // width} twice (virtual slot {v}): two source pages "
            f"would be copied into one destination page"
        )


def widened_page_indices(pages: Index, page_size: int, c: int) -> torch.Tensor:
    """All ``P * c`` virtual slot indices of each widened page, in page order."""
    _check_size("page_size", page_size)
    _check_size("c", c)
    pages = _as_index("pages", pages)
    width = page_size * c
    return (pages.unsqueeze(1) * width + torch.arange(width)).reshape(-1)


def _check_whole_pages(name: str, idx: torch.Tensor, width: int) -> None:
    if idx.numel() % width:
        raise HostTierError(
            f"{name} has {idx.numel()} slots, not a multiple of the widened page size "
            f"{width} (P*c): the host tier moves whole widened pages only"
        )
    chunks = idx.view(-1, width)
    starts = chunks[:, :1]
    bad = (starts % width != 0) | (chunks != starts + torch.arange(width)).any(dim=1, keepdim=True)
    if bool(bad.any()):
        k = int(torch.nonzero(bad.reshape(-1))[0])
        raise HostTierError(
            f"{name}: slots {k * width}..{(k + 1) * width - 1} of the list are not one whole "
            f"widened page of {width} slots (a partial or unaligned page), starting at "
            f"virtual slot {int(starts[k, 0])}"
        )


def local_rows(indices: torch.Tensor, c: int, rank: int) -> torch.Tensor:
    """Keep the virtual indices ``rank`` owns and map them to local rows ``i // c``."""
    _check_rank(c, rank)
    return physical(indices[owner(indices, c) == rank], c)


class HostKVTier:
    """This rank's host-side (L2) copy of a striped KV pool.

    ``num_host_pages`` widened pages of ``P * c`` virtual slots each; the buffer
    holds only this rank's ``P`` rows per page: ``[num_host_pages * P, dim]``.
    ``pin_memory="auto"`` pins the buffer when CUDA is available (async H2D/D2H).
    """

    def __init__(
        self,
        num_host_pages: int,
        page_size: int,
        c: int,
        rank: int,
        dim: int,
        dtype: torch.dtype = torch.bfloat16,
        pin_memory: Union[bool, str] = "auto",
    ) -> None:
        for name, v in (("num_host_pages", num_host_pages), ("page_size", page_size), ("c", c), ("dim", dim)):
            _check_size(f"HostKVTier: {name}", v)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < c:
            raise HostTierError(f"HostKVTier: rank must satisfy 0 <= rank < c={c}, got {rank!r}")
        if pin_memory == "auto":
            pin_memory = torch.cuda.is_available()
        elif not isinstance(pin_memory, bool):
            raise HostTierError(f"pin_memory must be True, False or 'auto', got {pin_memory!r}")
        self.num_host_pages = num_host_pages
        self.page_size = page_size
        self.c = c
        self.rank = rank
        self.dim = dim
        self.dtype = dtype
        self.buffer = torch.zeros(num_host_pages * page_size, dim, dtype=dtype, pin_memory=pin_memory)

    @property
    def widened_page_size(self) -> int:
        return self.page_size * self.c

    @property
    def virtual_capacity(self) -> int:
        """Host slots as the controller sees them: ``num_host_pages * P * c``."""
        return self.num_host_pages * self.widened_page_size

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _local_pairs(
        self, device_pool: torch.Tensor, device_indices: Index, host_indices: Index, unit: str, direction: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if unit not in ("page", "token"):
            raise HostTierError(f"unit must be 'page' or 'token', got {unit!r}")
        if device_pool.dim() != 2 or device_pool.shape[1] != self.dim:
            raise HostTierError(
                f"device pool must be [physical_slots, {self.dim}], got shape {tuple(device_pool.shape)}"
            )
        if device_pool.dtype != self.dtype:
            raise HostTierError(f"device pool dtype {device_pool.dtype} != host tier dtype {self.dtype}")
        if device_pool.element_size() == 1 and device_pool.dtype.is_floating_point:
            raise HostTierError(
                f"device pool of {device_pool.dtype}: an fp8 striped cache moves as its packed uint8 "
                f"rows (latent, scales and rope together; runtime/decode/kv_format.py), not as the "
                f"fp8 latent alone"
            )
        if unit == "page":
            dev = widened_page_indices(device_indices, self.page_size, self.c)
            host = widened_page_indices(host_indices, self.page_size, self.c)
        else:
            dev = _as_index("device_indices", device_indices)
            host = _as_index("host_indices", host_indices)
        if dev.numel() != host.numel():
            raise HostTierError(f"device and host index lists differ in length: {dev.numel()} vs {host.numel()}")
        width = self.widened_page_size
        _check_whole_pages("device_indices", dev, width)
        _check_whole_pages("host_indices", host, width)
        # the destination of the copy: host slots on offload, device slots on reload
        if direction == "offload":
            _check_no_duplicates("host_indices", host, width, "host")
        else:
            _check_no_duplicates("device_indices", dev, width, "device")
        if host.numel() and int(host.max()) >= self.virtual_capacity:
            raise HostTierError(
                f"host slot {int(host.max())} out of range: the host tier has {self.num_host_pages} "
                f"pages = {self.virtual_capacity} virtual slots"
            )
        # Both lists are whole aligned pages, so slot k of either page has the same
        # offset and the same owner: the two filters keep matching pairs.
        dev_rows = local_rows(dev, self.c, self.rank)
        host_rows = local_rows(host, self.c, self.rank)
        if dev_rows.numel() and int(dev_rows.max()) >= device_pool.shape[0]:
            raise HostTierError(
                f"device slot {int(dev.max())} maps to local row {int(dev_rows.max())}, beyond the "
                f"device pool's {device_pool.shape[0]} rows"
            )
        return dev_rows, host_rows

    def offload(
        self, device_pool: torch.Tensor, device_indices: Index, host_indices: Index, unit: str = "token"
    ) -> int:
        """Copy device (L1) -> host (L2). Returns the number of local rows copied.

        ``unit="token"``: both lists are widened virtual slot indices (whole pages of
        ``P*c`` consecutive, page-aligned slots); ``unit="page"``: widened page ids.
        """
        dev_rows, host_rows = self._local_pairs(device_pool, device_indices, host_indices, unit, "offload")
        if dev_rows.numel():
            rows = device_pool.index_select(0, dev_rows.to(device_pool.device))
            self.buffer.index_copy_(0, host_rows, rows.to("cpu"))
        return int(dev_rows.numel())

    def reload(self, device_pool: torch.Tensor, device_indices: Index, host_indices: Index, unit: str = "token") -> int:
        """Copy host (L2) -> device (L1) in place. Returns the number of local rows copied."""
        dev_rows, host_rows = self._local_pairs(device_pool, device_indices, host_indices, unit, "reload")
        if dev_rows.numel():
            rows = self.buffer.index_select(0, host_rows)
            device_pool.index_copy_(
                0,
                dev_rows.to(device_pool.device),
                rows.to(device_pool.device),
            )
        return int(dev_rows.numel())
