"""This rank's shards of the model's cache tensors: made, installed, and looked up per call.

The model's full-size cache buffer stays a module buffer (so Dynamo's guards and the
model code are untouched), but its storage is released: the backend owns a compacted
shard `[max_batch, ceil(max_seq / c) + 1, D]` per rank (one spare row), keyed by the
buffer object and reused by every later recompile. The graph takes the shard as a
trailing static input, resolved per call from the buffer passed (`feeder.CallFeeder`).

A buffer built under `dcp_pass.deferred_caches()` never had full-size storage: it is
created without memory (`memory.unallocated`) and gets only its shard.
"""

from __future__ import annotations

import re
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dcp_pass.report import log
from dcp_pass.runtime.decode import kv_format as fp8
from dcp_pass.runtime.decode import layout
from dcp_pass.state.guards import StripedCacheTensor, guard, mark_striped, modules_on_stack, owners_of
from dcp_pass.state.memory import storage_nbytes, unallocated
from dcp_pass.state.store import (
    DEFERRED,
    PENDING,
    RING_ROWS,
    STRIPED,
    DcpCacheError,
    LocalCache,
    ShardKind,
    describe,
    is_deferred,
    is_released,
    lookup_local_cache,
)


def shard_for(buffer: torch.Tensor, c: int, rank: int, name: str, kind: ShardKind, kv_format: str = "") -> LocalCache:
    """This rank's shard of `buffer`: the one installed earlier, or a new copy (nothing released yet).

    `kv_format` (a packed fp8 layout's spec): the shard is allocated as packed fp8 rows
    directly (a deferred buffer never has any other storage) and rows already written are
    quantised into it.
    """
    entry = lookup_local_cache(buffer) or PENDING.get(buffer)
    if entry is None:
        if kv_format and not kind.takes_fp8_rows:
            raise DcpCacheError(
                f"cache {name}: kv_cache_dtype fp8 takes caches with rows by position, not a "
                f"{kind.name} pool; pass kv_cache_dtype=None"
            )
        return kind.make(buffer, c, rank, name, fp8.Fp8Layout.parse(kv_format) if kv_format else None)
    if (entry.c, entry.rank) != (c, rank):
        raise DcpCacheError(
            f"cache {name} is already striped with dcp_size={entry.c}, rank {entry.rank}; "
            f"it cannot be recompiled with dcp_size={c}, rank {rank}"
        )
    if entry.kv_format != kv_format and kv_format:
        raise DcpCacheError(
            f"cache {name} is already striped as {entry.kv_format or str(entry.local.dtype)} rows (an earlier "
            f"compile or dcp_pass.materialize); it cannot be read as {kv_format}: let the first compile with "
            f"kv_cache_dtype='fp8_e4m3' stripe it"
        )
    return entry


def flat_shard(
    buffer: torch.Tensor, c: int, rank: int, name: str, packed: Optional[fp8.Fp8Layout] = None
) -> LocalCache:
    """A new shard of a cache with rows by position: the rank's rows in the buffer's dtype, or,
    with a `packed` fp8 layout, as packed rows (uint8 [..., row_bytes]); rows already written
    are copied (quantised) into it."""
    if packed is not None and buffer.shape[-1] != packed.columns:
        raise DcpCacheError(
            f"cache {name} has {buffer.shape[-1]} columns; its fp8 layout {packed.spec()} stores {packed.columns}"
        )
    axis = 1 if buffer.dim() == 3 or buffer.shape[1] != 1 else 2  # the position axis (cache_reads.cache_layout)
    tokens = buffer.shape[axis]
    # One spare row: a windowed write (symbolic start) may touch row (start + n) // c,
    # one past the last owned row when max_seq is a multiple of c. Never read.
    shape = list(buffer.shape)
    shape[axis] = layout.local_capacity(tokens, c) + 1
    if packed is not None:
        shape[-1] = packed.row_bytes
    local = torch.zeros(shape, dtype=torch.uint8 if packed is not None else buffer.dtype, device=buffer.device)
    if buffer not in DEFERRED:  # a deferred buffer has no rows yet: its shard starts zeroed
        owned = buffer.detach()[(slice(None),) * axis + (slice(rank, None, c),)]  # keeps rows already written
        local.narrow(axis, 0, owned.shape[axis]).copy_(fp8.pack(owned, packed) if packed is not None else owned)
    full_nbytes = buffer.numel() * buffer.element_size()
    return LocalCache(local, tokens, c, rank, full_nbytes, name, FLAT, kv_format=packed.spec() if packed else "")


# a module buffer [batch, position, feature] (or with a head axis of size 1): rows by position
FLAT = ShardKind(
    "flat", flat_shard, takes_fp8_rows=True, batch_reorderable=True, resettable=False, installed_at_first_call=False
)


def paged_shard(buffer: torch.Tensor, c: int, rank: int, name: str, packed: None = None) -> LocalCache:
    """Slots v % c == rank of a paged pool `[pages, P, D]` (rewrites/cache_kinds/paged.py), compacted
    ([pages * P / c + 1, D]; the last slot is spare)."""
    pages, page, width = buffer.shape
    if page % c:
        raise DcpCacheError(
            f"paged cache {name} has pages of {page} slots, not a multiple of dcp_size={c}: a page cannot be split "
            f"evenly across the DCP ranks; use a page size that is a multiple of {c}"
        )
    local = torch.zeros((pages * (page // c) + 1, width), dtype=buffer.dtype, device=buffer.device)
    if not is_deferred(buffer):
        owned = buffer.detach().reshape(-1, width)[rank::c]
        local[: owned.shape[0]] = owned
    return LocalCache(local, pages * page, c, rank, buffer.numel() * buffer.element_size(), name, PAGED)


# a pool of pages [pages, P, D] read through a block table (its axis 0 is pages, not the batch)
PAGED = ShardKind(
    "paged", paged_shard, takes_fp8_rows=False, batch_reorderable=False, resettable=False, installed_at_first_call=False
)


def ring_entries_shard(buffer: torch.Tensor, c: int, rank: int, name: str, packed: None = None) -> LocalCache:
    """This rank's shard of a buffer `[batch, ring + entries, D]` that holds a window ring and
    then compressed entries (rewrites/cache_kinds/ring_entries.py): the ring whole (bounded, the
    same on every rank), then entries e % c == rank compacted, plus one spare row. Rows already
    written are kept."""
    ring = RING_ROWS.get(buffer)
    if ring is None:
        raise DcpCacheError(
            f"cache {name}: no graph has shown the size of its window ring, so it cannot be split "
            f"into the ring and its striped entries"
        )
    batch, rows, width = buffer.shape
    entries = rows - ring
    local = torch.zeros(
        (batch, ring + layout.local_capacity(entries, c) + 1, width), dtype=buffer.dtype, device=buffer.device
    )
    if not is_released(buffer):
        whole = buffer.detach()
        local[:, :ring] = whole[:, :ring]
        owned = whole[:, ring + rank :: c]
        local[:, ring : ring + owned.shape[1]] = owned
    full_nbytes = batch * entries * width * buffer.element_size()  # the ring is kept whole: not counted
    return LocalCache(local, entries, c, rank, full_nbytes, name, RING_ENTRIES, ring_rows=ring)


# a window ring then compressed entries [batch, ring + entries, D] (DeepSeek-V4's attention buffer)
RING_ENTRIES = ShardKind(
    "ring_entries",
    ring_entries_shard,
    takes_fp8_rows=False,
    batch_reorderable=True,
    resettable=False,
    installed_at_first_call=False,
)


STATIC_CACHE_POSITION_AXIS = 2  # of a static cache tensor [batch, kv heads, position, feature]


def static_cache_shard(buffer: torch.Tensor, c: int, rank: int, name: str, packed: None = None) -> LocalCache:
    """This rank's rows of a Hugging Face static cache tensor (rewrites/cache_kinds/static_cache.py):
    positions p % c == rank, compacted along the position axis, plus one spare row (written
    by tokens the rank does not own)."""
    axis = STATIC_CACHE_POSITION_AXIS
    tokens = buffer.shape[axis]
    shape = list(buffer.shape)
    shape[axis] = layout.local_capacity(tokens, c) + 1
    local = torch.zeros(shape, dtype=buffer.dtype, device=buffer.device)
    if not is_released(buffer):  # keeps the rows written so far (the prefill's)
        owned = buffer.detach()[:, :, rank::c]
        local[:, :, : owned.shape[axis]].copy_(owned)
    return LocalCache(local, tokens, c, rank, buffer.numel() * buffer.element_size(), name, STATIC_CACHE)


# a Hugging Face static cache tensor [batch, kv heads, position, feature], held by a Cache object
# made anew for every generate and zeroed by Cache.reset()
STATIC_CACHE = ShardKind(
    "static_cache",
    static_cache_shard,
    takes_fp8_rows=False,
    batch_reorderable=True,
    resettable=True,
    installed_at_first_call=True,
)


def install(buffer: torch.Tensor, entry: LocalCache) -> None:
    """Make `entry` the owner of `buffer`'s rows and release the full-size storage (once)."""
    if lookup_local_cache(buffer) is entry:
        return
    if DEFERRED.pop(buffer, None) is not None:  # never had full-size storage; guarded since defer()
        STRIPED[buffer] = entry
        mark_striped(buffer)
        return
    if owns_storage(buffer):
        # Shape, stride and dtype stay, so Dynamo's guards on the buffer still pass.
        buffer.untyped_storage().resize_(0)
    elif _striped_cover_storage(buffer):
        # Striped cache buffers (latent and rotary caches carved out of one allocation) hold
        # every byte of it: release it, so that any other view of it (a pool's) fails at its
        # next use instead of writing rows no graph reads any more.
        buffer.untyped_storage().resize_(0)
        log.info(
            "dcp_pass: %s and the caches sharing its allocation are striped: the allocation is released", entry.name
        )
    else:
        # The storage also backs tensors the pass has not striped (yet): releasing it would
        # destroy them. Keep it; only this buffer's rows move to the shard.
        log.warning(
            "dcp_pass: %s shares its storage with other tensors, so its full-size memory is kept; "
            "a write through another view of that storage does not reach this rank's shard",
            entry.name,
        )
        entry.full_nbytes = entry.local_nbytes  # report no saving that did not happen
    STRIPED[buffer] = entry
    # A kind installed at first call is a graph input held by a Cache object, never a module
    # buffer: there is no owner to find, and the gc scan would cost each generation's first step.
    guard(buffer, [] if entry.kind.installed_at_first_call else owners_of(buffer))
    mark_striped(buffer)


# a shared storage's address -> weak references to the striped cache buffers that live in it
_SHARING: dict[int, list] = {}


def _striped_cover_storage(buffer: torch.Tensor) -> bool:
    """Record `buffer` (about to be striped) in its shared storage; whether the striped buffers
    in it, `buffer` included, now account for all of its bytes (they do not overlap: a
    model's caches are distinct tensors). Dead buffers, and buffers whose storage moved, are
    not counted: an address can be reused."""
    storage = buffer.untyped_storage()
    key = storage.data_ptr()
    held = [
        ref
        for ref in _SHARING.get(key, ())
        if (t := ref()) is not None and t is not buffer and t.untyped_storage().data_ptr() == key
    ]
    held.append(weakref.ref(buffer))
    nbytes = sum(t.numel() * t.element_size() for t in (ref() for ref in held))
    if nbytes >= storage.nbytes():
        _SHARING.pop(key, None)
        return True
    _SHARING[key] = held
    return False


def owns_storage(buffer: torch.Tensor) -> bool:
    """Whether `buffer` is the whole of its storage (so releasing it frees nothing else)."""
    storage = buffer.untyped_storage()
    return buffer.storage_offset() == 0 and storage.nbytes() == buffer.numel() * buffer.element_size()


def local_for(buffer: torch.Tensor, c: int, rank: int, name: str, kind: ShardKind, kv_format: str = "") -> LocalCache:
    """The shard to pass for `buffer` on this call; installs one on first sight.

    One compiled graph serves every layer whose module shares the code (Dynamo passes
    each layer's buffers as inputs), so the shard is looked up per call, by buffer.
    """
    entry = lookup_local_cache(buffer)
    if entry is None:
        entry = PENDING.pop(buffer, None) or shard_for(buffer, c, rank, name, kind, kv_format)
        install(buffer, entry)
    return entry


def install_at_first_call(buffer: torch.Tensor, entry: LocalCache) -> None:
    """Keep `entry` for `buffer` until the compiled graph's first call installs it (local_for)."""
    if lookup_local_cache(buffer) is None:
        PENDING[buffer] = entry


@dataclass(frozen=True)
class AllocatedCache:
    """A cache tensor that the graph allocated (rewrites/allocation.py), made by the backend
    for every call instead: `make` gives the full-shape tensor the graph returns in its place,
    without memory, and this rank's zeroed shard of it (`local_capacity + 1` positions: the
    spare row, as for every shard)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    axis: int  # the position axis
    c: int
    rank: int
    name: str
    kind: ShardKind
    outputs: tuple[int, ...]  # where the graph's output returns the tensor

    @classmethod
    def of(
        cls,
        example: torch.Tensor,
        axis: int,
        c: int,
        rank: int,
        name: str,
        kind: ShardKind,
        outputs: tuple[int, ...] = (),
    ) -> "AllocatedCache":
        return cls(
            tuple(int(s) for s in example.shape),
            tuple(int(s) for s in example.stride()),
            example.dtype,
            example.device,
            axis,
            c,
            rank,
            name,
            kind,
            outputs,
        )

    def shell(self) -> torch.Tensor:
        return unallocated(self.shape, self.stride, self.dtype, self.device)

    def shard(self) -> LocalCache:
        tokens = self.shape[self.axis]
        shape = list(self.shape)
        shape[self.axis] = layout.local_capacity(tokens, self.c) + 1
        local = torch.zeros(shape, dtype=self.dtype, device=self.device)
        full = storage_nbytes(self.shape, self.stride, self.dtype.itemsize)
        return LocalCache(local, tokens, self.c, self.rank, full, self.name, self.kind)

    def make(self) -> tuple[torch.Tensor, LocalCache]:
        return self.shell(), self.shard()


def install_allocated(shell: torch.Tensor, entry: LocalCache) -> None:
    """Make `entry` the stripe of `shell`, a full-shape tensor that never had memory (AllocatedCache)."""
    STRIPED[shell] = entry
    guard(shell, [])  # held by a cache object, not a module: no owner to guard
    mark_striped(shell)


# a cache striped with another layer's, as its sibling -> (that cache, weakly; its name in its graph)
_STRIPED_WITH: WeakIdKeyDictionary = WeakIdKeyDictionary()


def stripe_sibling(buffer: torch.Tensor, name: str, owner: torch.Tensor, c: int, rank: int, entry: LocalCache) -> None:
    """Stripe `buffer`, the sibling cache `name` of the cache `owner` (its shard: `entry`), with it."""
    local_for(buffer, c, rank, name, entry.kind, entry.kv_format)
    _STRIPED_WITH[buffer] = (weakref.ref(owner), entry.name)


def striped_with_note(buffers: Sequence[Any]) -> str:
    """For an error about released `buffers` that a graph reads as they are: how the first
    one striped as a sibling came to be striped, and what tells its block apart ("" if none)."""
    for buffer in buffers:
        found = _STRIPED_WITH.get(buffer) if isinstance(buffer, torch.Tensor) else None
        if found is not None:
            owner, owner_name = found
            name, _ = describe(buffer)
            owner_name = _path_on_stack(owner(), sys._getframe(1)) or owner_name
            return (
                f"; {name} was striped with {owner_name}, whose graph its block was expected to run (Dynamo's "
                f"guards on the two blocks agree), but its attention takes another form here: a block that picks "
                f"its attention from a value it is passed (a window size) cannot be told apart by its module; keep "
                f"that value as an attribute of the block (self.window = ...)"
            )
    return ""


def _path_on_stack(buffer: Optional[torch.Tensor], frame) -> Optional[str]:
    """`layers.1.kv_cache`: where `buffer` sits in the modules the calling frames run."""
    if buffer is None:
        return None
    for root in modules_on_stack(frame).values():
        place = _place_of(buffer, dict(root.named_modules()))
        if place is not None:
            path, key = place
            return f"{path}.{key}" if path else key
    return None


def _place_of(buffer: torch.Tensor, paths: dict[str, torch.nn.Module]) -> Optional[tuple[str, str]]:
    """(module path, buffer key) of the first module of `paths` that holds `buffer`, or None."""
    for path, module in paths.items():
        key = next((k for k, b in module._buffers.items() if b is buffer), None)
        if key is not None:
            return path, key
    return None


def sibling_buffers(
    buffer: torch.Tensor, source: Optional[str] = None, graph_inputs: Sequence[Any] = ()
) -> list[tuple[torch.Tensor, str]]:
    """The buffers that play `buffer`'s part in the other layers and will run the graph being
    compiled: the same attribute of every module of its owner's class (in the modules the
    calling frames run), of the same shape, dtype and device, not yet striped.

    One compiled graph serves every layer of a model whose blocks share their code; its
    guards check the class of each buffer it takes, so every layer's caches must be
    striped together, before the first call that passes them (else each layer's first
    call would compile the graph again).

    Left out: a buffer the graph takes itself (`graph_inputs`: the graph decided for it,
    striped where it rewrote that layer, else kept whole), and a sibling whose block would
    fail this graph's guards as Dynamo recorded them while tracing (`source`: the buffer's
    source name, e.g. `L['self']._buffers['kv_cache']`): its cache's module differs from the
    owner's where the graph looked (attributes, submodules, weights), or its block holds
    another plain value where the graph read one (a sliding-window block's `self.window`
    beside a full block's None). That block runs another graph, which decides for its layer:
    striping its cache here would take the whole cache from a layer that graph may keep.
    Without Dynamo's record (the pass run outside Dynamo) every sibling counts.
    """
    owners = owners_of(buffer)
    names = {(type(m), key) for m in owners for key, b in m._buffers.items() if b is buffer}
    if not names:
        return []
    taken = {id(t) for t in graph_inputs if isinstance(t, torch.Tensor)}
    guards = _traced_guards()
    match = _BUFFER_SOURCE.match(source or "")
    found: dict[int, tuple[torch.Tensor, str]] = {}
    for root in modules_on_stack(sys._getframe(1)).values():
        paths = dict(root.named_modules())
        runs_the_graph = _runs_the_graph(buffer, match, guards, paths)
        for path, module in paths.items():
            for cls, key in names:
                other = module._buffers.get(key) if type(module) is cls else None
                if (
                    other is not None
                    and other is not buffer
                    and id(other) not in taken
                    and not is_released(other)
                    and other.shape == buffer.shape
                    and other.dtype == buffer.dtype
                    and other.device == buffer.device
                    and runs_the_graph(path)
                ):
                    found.setdefault(id(other), (other, f"{path}.{key}" if path else key))
    return list(found.values())


@dataclass(frozen=True)
class _GuardedScope:
    """The module whose frame Dynamo traced (the graph's root module, e.g. a block), seen
    from the owner of the buffer being striped (the module holding it), and the guards
    recorded under the root."""

    expression: str  # the root's source name in the guards, e.g. L['self']
    owner_expression: str  # the owner's, e.g. L['self']._modules['attn']
    below: str  # the owner's module path under the root ("" when the owner is the root itself)
    root_path: str
    guards: tuple[tuple[str, str], ...]  # (source name, guard kind) under the root
    paths: dict[str, torch.nn.Module]  # module path -> module, in the stack root searched

    def runs_the_graph(self, path: str) -> bool:
        """Whether a call of the graph can pass the buffer of the module at `path`: its
        counterpart of the traced root agrees with the owner's root on every guard of the
        owner's module and everything under it (its attributes, submodules, weights), and on
        the plain values (flags, sizes: a block's `window`) read anywhere under the root.
        A root that differs only in the structure around the owner (an MoE where the owner's
        block has an MLP) takes another graph too, but one that runs the same attention:
        its cache is striped with the owner's, as the layers of a shared graph are."""
        root_path = _above(path, self.below)
        if root_path is None or root_path == self.root_path or root_path not in self.paths:
            # no counterpart, or the traced root itself: the graph runs that module without
            # taking this buffer, so no call of it passes the buffer
            return False
        mine, theirs = self.paths[self.root_path], self.paths[root_path]
        for name, kind in self.guards:
            # the name read from the root, e.g. `root.window` for L['self'].window: Dynamo's
            # source names are Python expressions
            read = "root" + name[len(self.expression) :]
            in_owner = _under(name, self.owner_expression)
            try:
                owner_value = eval(read, {"root": mine})
            except Exception:  # noqa: BLE001 - a name this evaluation cannot read: no verdict from it
                continue
            if not in_owner and not isinstance(owner_value, _PLAIN):
                continue
            try:
                their_value = eval(read, {"root": theirs})
            except Exception:  # noqa: BLE001 - the counterpart lacks what the graph reads
                if in_owner:
                    return False
                continue
            if in_owner and not _guard_agrees(kind, owner_value, their_value):
                return False
            if not in_owner and not (type(owner_value) is type(their_value) and owner_value == their_value):
                return False
        return True


_PLAIN = (type(None), bool, int, float, str)


# `<root>._modules['a']._modules['b']._buffers['kv_cache']`: a buffer of a module under the frame's root
_BUFFER_SOURCE = re.compile(r"^(?P<root>.*?)(?P<below>(?:\._modules\['[^']+'\])*)\._buffers\['[^']+'\]$")


def _runs_the_graph(
    buffer: torch.Tensor,
    source: Optional["re.Match[str]"],
    guards: Optional[list[tuple[str, str]]],
    paths: dict[str, torch.nn.Module],
) -> Callable[[str], bool]:
    """Whether the graph being compiled will be called with the sibling buffer of the module
    at a path of `paths` (one stack root's modules): judged against the traced root of
    `buffer`'s graph, found from the buffer's parsed source name. Without Dynamo's record
    of this trace, or a source of another shape, every sibling counts; where the owner is
    not among `paths`, none."""
    if guards is None or source is None:
        return lambda path: True
    expression = source.group("root")
    below = ".".join(re.findall(r"\['([^']+)'\]", source.group("below")))
    place = _place_of(buffer, paths)
    owner_path = place[0] if place is not None else None
    root_path = _above(owner_path, below) if owner_path is not None else None
    if root_path is None or root_path not in paths:
        return lambda path: False
    under = tuple((name, kind) for name, kind in guards if _under(name, expression))
    owner_expression = source.group(0)[: source.group(0).rindex("._buffers[")]
    return _GuardedScope(expression, owner_expression, below, root_path, under, paths).runs_the_graph


def _under(name: str, expression: str) -> bool:
    """Whether the source name `name` is `expression` or reached from it."""
    return name == expression or name.startswith(expression + ".") or name.startswith(expression + "[")


def _above(path: str, below: str) -> Optional[str]:
    """The path of the module `below` (a relative module path) is under, for the module at
    `path`; None if `path` does not end with `below`."""
    if not below:
        return path
    if path == below:
        return ""
    return path[: -len(below) - 1] if path.endswith("." + below) else None


def _plain_class(value: Any) -> type:
    # the owner's caches are striped already (or about to be, with the sibling's)
    return torch.Tensor if type(value) is StripedCacheTensor else type(value)


def _guard_agrees(kind: str, mine: Any, theirs: Any) -> bool:
    """Whether the counterpart's value `theirs` passes a guard of `kind` that the owner's
    value `mine` passes (compared as Dynamo compares it; a kind not known here: no verdict)."""
    try:
        if kind == "TENSOR_MATCH":
            return (
                isinstance(theirs, torch.Tensor)
                and _plain_class(mine) is _plain_class(theirs)
                and (mine.dtype, mine.device, mine.shape, mine.stride(), mine.requires_grad)
                == (theirs.dtype, theirs.device, theirs.shape, theirs.stride(), theirs.requires_grad)
            )
        if kind == "TYPE_MATCH":
            return _plain_class(mine) is _plain_class(theirs)
        if kind in ("EQUALS_MATCH", "CONSTANT_MATCH"):
            return type(mine) is type(theirs) and bool(mine == theirs)
        if "KEYS" in kind:
            return list(mine.keys()) == list(theirs.keys())
        if "LENGTH" in kind:
            return len(mine) == len(theirs)
        if kind.endswith("_MATCH"):
            return mine is theirs  # ID_MATCH, NONE_MATCH, BOOL_MATCH, FUNCTION_MATCH, CLOSURE_MATCH, ...
    except Exception:  # noqa: BLE001 - values that do not compare: not the same graph
        return False
    return True


def _traced_guards() -> Optional[list[tuple[str, str]]]:
    """(source name, guard kind) of every guard Dynamo has recorded for the frame it traces
    now (its tracing context; read at compile time, before Dynamo builds its guard
    function); None outside a Dynamo trace. Reads Dynamo internals."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    guards = getattr(getattr(context, "guards_context", None), "dynamo_guards", None)
    if guards is None:
        return None
    out = []
    for recorded in guards:
        try:
            out.append((recorded.name, recorded.create_fn_name()))
        except Exception:  # noqa: BLE001 - a guard without a name (global state): not about a module
            continue
    return out
