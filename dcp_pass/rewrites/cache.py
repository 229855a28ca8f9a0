"""The rank-local cache storage: shards, their installation, and the guards of released buffers.

The model's full-size cache buffer stays a module buffer (so Dynamo's guards and the
model code are untouched), but its storage is released: the backend owns a compacted
shard `[max_batch, ceil(max_seq / c) + 1, D]` per rank (one spare row), keyed by the
buffer object and reused by every later recompile. The graph takes the shard as a
trailing static input, resolved per call from the buffer passed (see backend.py).

A buffer built under `dcp_pass.deferred_caches()` never had full-size storage: it is
created without memory (`unallocated`) and gets only its shard.

A buffer without full-size data must not be read outside a DCP graph. Ordinary
operations that would (deepcopy, pickling, `Module.to`/`.half()`/..., eager calls of the
owning module, another backend compiling it, state_dict save/load) raise `DcpCacheError`
naming the buffer instead of copying garbage or crashing; see `guard` below.

The rewrite of a cache write into a striped write is `cache_reads.rewrite_write` (also
importable from here).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from dcp_pass.report import log
from dcp_pass.rewrites import fx_util
from dcp_pass.rewrites.cache_reads import (
    CacheAccess,
    rewrite_write,  # noqa: F401 - the striped write, kept importable from here
)
from dcp_pass.runtime.decode import kv_format as fp8
from dcp_pass.runtime.decode import layout


class DcpCacheError(RuntimeError):
    """A cache buffer has no full-size data (striped by DCP, or deferred) and was used as if it had."""


@dataclass
class LocalCache:
    """This rank's shard of one model cache buffer."""

    local: torch.Tensor
    virtual_capacity: int  # positions of the original buffer (its dim 1)
    c: int
    rank: int
    full_nbytes: int
    name: str
    kind: str = "flat"  # "flat": rows by position; "paged": a pool's slots (rewrites/recognisers/paged.py)
    # "" (the buffer's dtype) or a packed fp8 layout's spec (runtime/decode/kv_format.py): then
    # `local` is uint8 [..., row_bytes], one packed row per owned position
    kv_format: str = ""

    @property
    def local_nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


@dataclass
class DeferredCache:
    """A cache buffer created without storage by `dcp_pass.deferred_caches()`."""

    name: str
    fill: Optional[float]  # 0.0 for torch.zeros, None for torch.empty
    owner: str  # class name of the module that registered it


# Keyed weakly by the buffer object: when a model is deleted its shards go with it.
_LOCAL_CACHES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_DEFERRED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def lookup_local_cache(buffer: torch.Tensor) -> Optional[LocalCache]:
    return _LOCAL_CACHES.get(buffer)


def is_deferred(buffer: torch.Tensor) -> bool:
    return buffer in _DEFERRED


def is_released(buffer: torch.Tensor) -> bool:
    """Whether `buffer` has no full-size data (striped, or deferred and not materialized)."""
    return buffer in _LOCAL_CACHES or buffer in _DEFERRED


# kind -> (buffer, c, rank, name) -> LocalCache, for cache layouts other than "flat"
SHARD_MAKERS: dict[str, Any] = {}
# kinds whose striped tensors take an eager zero_() (a reset of the cache object that holds
# them, outside any graph) by zeroing the rank's shard; any other eager use raises
RESETTABLE: set[str] = set()
# kinds of shards whose axis 0 is the batch (a paged pool's is its pages): StripedCache applies
# batch reorders (beam search) to them. "static_cache": a Hugging Face static cache tensor
# [batch, kv heads, position, feature] (recognisers/per_head.py's KIND)
BATCH_REORDERABLE: set[str] = {"flat", "static_cache"}


def shard_for(buffer: torch.Tensor, c: int, rank: int, name: str, kind: str = "flat",
              kv_format: str = "") -> LocalCache:
    """This rank's shard of `buffer`: the one installed earlier, or a new copy (nothing released yet).

    `kv_format` (a packed fp8 layout's spec): the shard is allocated as packed fp8 rows
    directly (a deferred buffer never has any other storage) and rows already written are
    quantised into it.
    """
    entry = lookup_local_cache(buffer) or _PENDING.get(buffer)
    if entry is None and kind != "flat":
        if kv_format:
            raise DcpCacheError(f"cache {name}: kv_cache_dtype fp8 takes caches with rows by position, not a "
                                f"{kind} pool; pass kv_cache_dtype=None")
        return SHARD_MAKERS[kind](buffer, c, rank, name)
    if entry is not None:
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
    return _flat_shard(buffer, c, rank, name, fp8.Fp8Layout.parse(kv_format) if kv_format else None)


def _flat_shard(buffer: torch.Tensor, c: int, rank: int, name: str,
                packed: Optional[fp8.Fp8Layout] = None) -> LocalCache:
    """A new shard of a cache with rows by position: the rank's rows in the buffer's dtype, or,
    with a `packed` fp8 layout, as packed rows (uint8 [..., row_bytes]); rows already written
    are copied (quantised) into it."""
    if packed is not None and buffer.shape[-1] != packed.columns:
        raise DcpCacheError(f"cache {name} has {buffer.shape[-1]} columns; its fp8 layout {packed.spec()} stores "
                            f"{packed.columns}")
    axis = 1 if buffer.dim() == 3 or buffer.shape[1] != 1 else 2  # the position axis (cache_reads.cache_layout)
    tokens = buffer.shape[axis]
    # One spare row: a windowed write (symbolic start) may touch row (start + n) // c,
    # one past the last owned row when max_seq is a multiple of c. Never read.
    shape = list(buffer.shape)
    shape[axis] = layout.local_capacity(tokens, c) + 1
    if packed is not None:
        shape[-1] = packed.row_bytes
    local = torch.zeros(shape, dtype=torch.uint8 if packed is not None else buffer.dtype, device=buffer.device)
    if buffer not in _DEFERRED:  # a deferred buffer has no rows yet: its shard starts zeroed
        owned = buffer.detach()[(slice(None),) * axis + (slice(rank, None, c),)]  # keeps rows already written
        local.narrow(axis, 0, owned.shape[axis]).copy_(fp8.pack(owned, packed) if packed is not None else owned)
    full_nbytes = buffer.numel() * buffer.element_size()
    return LocalCache(local, tokens, c, rank, full_nbytes, name, kv_format=packed.spec() if packed is not None else "")


class StripedCache(torch.Tensor):
    """The class a cache buffer takes once DCP has striped it.

    Two things follow from the class alone. Dynamo guards on the type of every tensor a
    graph takes, so every graph compiled while the buffer was an ordinary tensor (a
    write-only prefill graph, say) fails its guards and is compiled again, this time by a
    pass that sees the buffer striped: no compiled graph ever writes or reads the released
    storage. And any eager torch call that would read or write its data raises
    `DcpCacheError` naming it (its metadata stays readable: shape, dtype, device, ...),
    except `zero_()` on the kinds in RESETTABLE, which zeroes this rank's shard (a Hugging Face
    cache reset between generations).
    While Dynamo traces, calls pass through as on a plain tensor (the pass rewrites them).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("__repr__", "__str__", "__format__") and args and not kwargs.get("_plain"):
            with torch._C.DisableTorchFunctionSubclass():
                t = args[0]
                name, _ = _describe(t)
                return f"<cache buffer {name} striped by dcp_pass: shape {tuple(t.shape)}, {t.dtype}, {t.device}>"
        if torch.compiler.is_compiling() or _is_metadata(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        touched = next((a for a in _tensors_in(args, kwargs) if type(a) is StripedCache), None)
        what = getattr(func, "__name__", str(func))
        entry = lookup_local_cache(touched) if touched is not None else None
        if what == "zero_" and args and args[0] is touched and entry is not None and entry.kind in RESETTABLE:
            # a cache reset (Hugging Face's Cache.reset() between generations) clears this rank's rows
            entry.local.zero_()
            return touched
        if what in ("index_select", "index_copy_") and args and args[0] is touched and entry is not None:
            return _reorder_batch(what, touched, entry, args, kwargs)
        name, why = _describe(touched) if touched is not None else ("?", "?")
        raise DcpCacheError(
            f"dcp_pass: eager code called {what} on cache buffer {name}, but {why}. Only graphs compiled "
            f"with backend='dcp' can read or write it; call the compiled model (a graph break inside the "
            f"attention, or model code between graphs, must not touch the cache)"
        )


def _reorder_batch(what: str, touched: torch.Tensor, entry: LocalCache, args, kwargs) -> torch.Tensor:
    """`cache.index_select(0, rows)` / `cache.index_copy_(0, rows, other)` along the batch axis
    (beam search reorders its beams so), applied to this rank's shard: the batch axis is not
    striped, so each rank moves its own rows of every request. `index_select` keeps the batch
    size and reorders in place, returning the cache itself (a static cache keeps its address;
    the caller replaces the cache by the result). Anything else raises DcpCacheError."""
    names = ("dim", "index", "source") if what == "index_copy_" else ("dim", "index")
    given = dict(zip(names, args[1:]))
    given.update({k: v for k, v in kwargs.items() if k in names})
    dim, index, source = given.get("dim"), given.get("index"), given.get("source")
    name, _ = _describe(touched)
    where = (f"dcp_pass: eager code called {what} on cache buffer {name} (striped by DCP): only reorders of "
             f"the batch axis (dim 0) by an integer index")
    if entry.kind not in BATCH_REORDERABLE or not isinstance(dim, int) or dim not in (0, -touched.dim()) \
            or not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
        raise DcpCacheError(f"{where} run on its shard; call the compiled model for anything else")
    index = index.to(entry.local.device)
    if what == "index_select":
        if index.shape[0] != touched.shape[0]:
            raise DcpCacheError(f"{where} that keep the batch size ({touched.shape[0]}) run on its shard; this one "
                                f"selects {index.shape[0]} rows")
        entry.local.copy_(entry.local.index_select(0, index))
        return touched
    other = lookup_local_cache(source) if isinstance(source, torch.Tensor) else None
    if other is None or other.local.shape[1:] != entry.local.shape[1:] or other.kv_format != entry.kv_format:
        raise DcpCacheError(f"{where}, from another cache striped the same way, run on its shard")
    entry.local.index_copy_(0, index, other.local)
    return touched


_METADATA_CALLS = {"size", "dim", "stride", "storage_offset", "numel", "element_size", "is_contiguous",
                   "untyped_storage", "data_ptr", "__len__", "__hash__",
                   "is_floating_point", "is_complex", "get_device", "nelement", "__reduce_ex__", "__deepcopy__",
                   "__setstate__", "requires_grad_", "_is_view", "__dlpack_device__", "is_inference", "is_pinned",
                   "is_shared", "is_signed", "is_set_to", "_is_zerotensor", "is_conj", "is_neg", "_nnz"}
_METADATA_PROPERTIES = {"shape", "dtype", "device", "ndim", "is_cuda", "is_cpu", "is_meta", "requires_grad",
                        "layout", "names", "grad_fn", "is_leaf", "grad", "is_sparse", "is_quantized", "_base",
                        "itemsize", "nbytes", "is_nested", "__class__", "__dict__", "_version", "is_mps", "is_xpu",
                        "is_mkldnn", "is_vulkan", "is_ipu", "is_xla", "is_mtia", "is_maia", "is_sparse_csr"}


def _is_metadata(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of the tensor
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
    return name in _METADATA_CALLS


def _tensors_in(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _mark_striped(buffer: torch.Tensor) -> None:
    if type(buffer) is torch.Tensor:
        buffer.__class__ = StripedCache


def install(buffer: torch.Tensor, entry: LocalCache) -> None:
    """Make `entry` the owner of `buffer`'s rows and release the full-size storage (once)."""
    if lookup_local_cache(buffer) is entry:
        return
    if _DEFERRED.pop(buffer, None) is not None:  # never had full-size storage; guarded since defer()
        _LOCAL_CACHES[buffer] = entry
        _mark_striped(buffer)
        return
    if owns_storage(buffer):
        # Shape, stride and dtype stay, so Dynamo's guards on the buffer still pass.
        buffer.untyped_storage().resize_(0)
    elif _striped_cover_storage(buffer):
        # Striped cache buffers (latent and rotary caches carved out of one allocation) hold
        # every byte of it: release it, so that any other view of it (a pool's) fails at its
        # next use instead of writing rows no graph reads any more.
        buffer.untyped_storage().resize_(0)
        log.info("dcp_pass: %s and the caches sharing its allocation are striped: the allocation is released",
                 entry.name)
    else:
        # The storage also backs tensors the pass has not striped (yet): releasing it would
        # destroy them. Keep it; only this buffer's rows move to the shard.
        log.warning("dcp_pass: %s shares its storage with other tensors, so its full-size memory is kept; "
                    "a write through another view of that storage does not reach this rank's shard",
                    entry.name)
        entry.full_nbytes = entry.local_nbytes  # report no saving that did not happen
    _LOCAL_CACHES[buffer] = entry
    # A kind installed at first call is a graph input held by a Cache object, never a module
    # buffer: there is no owner to find, and the gc scan would cost each generation's first step.
    guard(buffer, [] if entry.kind in INSTALLED_AT_FIRST_CALL else _owners_of(buffer))
    _mark_striped(buffer)


# a shared storage's address -> weak references to the striped cache buffers that live in it
_SHARING: dict[int, list] = {}


def _striped_cover_storage(buffer: torch.Tensor) -> bool:
    """Record `buffer` (about to be striped) in its shared storage; whether the striped buffers
    in it, `buffer` included, now account for all of its bytes (they do not overlap: a
    model's caches are distinct tensors). Dead buffers, and buffers whose storage moved, are
    not counted: an address can be reused."""
    storage = buffer.untyped_storage()
    key = storage.data_ptr()
    held = [ref for ref in _SHARING.get(key, ()) if (t := ref()) is not None and t is not buffer
            and t.untyped_storage().data_ptr() == key]
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


def local_for(buffer: torch.Tensor, c: int, rank: int, name: str, kind: str = "flat",
              kv_format: str = "") -> LocalCache:
    """The shard to pass for `buffer` on this call; installs one on first sight.

    One compiled graph serves every layer whose module shares the code (Dynamo passes
    each layer's buffers as inputs), so the shard is looked up per call, by buffer.
    """
    entry = lookup_local_cache(buffer)
    if entry is None:
        entry = _PENDING.pop(buffer, None) or shard_for(buffer, c, rank, name, kind, kv_format)
        install(buffer, entry)
    return entry


def fp8_layout_of(match, values: dict) -> "fp8.Fp8Layout":
    """The packed fp8 layout of the cache buffer holding `match`'s values (latent), or
    :class:`Fp8Refused` saying why its cache cannot be stored as fp8.

    The latent is the value columns [0, L); rotary columns are packed into the row when
    the rotary keys are read from the same buffer at [L, width) (a fused cache), and the
    buffer must hold nothing else.
    """
    from dcp_pass.rewrites.attention import ordered_terms

    read = match.value_cache
    if read.kind != "flat":
        raise Fp8Refused(f"its cache is a {read.kind} pool; kv_cache_dtype fp8 takes caches with rows by position")
    buffer = values[read.buffer.name]
    width = buffer.shape[-1]
    if (read.feat or (0,))[0] != 0:
        raise Fp8Refused(f"its values start at column {read.feat[0]} of the cache, not 0")
    latent, rope = ordered_terms(match)
    if latent.cache.buffer is not read.buffer:
        raise Fp8Refused("its latent keys and values come from different caches")
    fused_term = rope is None and latent.cache.width == width and match.v_dim < width
    L = match.v_dim if fused_term else latent.cache.width
    if rope is not None and rope.cache.buffer is read.buffer:
        if (rope.cache.feat or (0, width)) != (L, width):
            raise Fp8Refused(f"its rotary keys are columns {rope.cache.feat} of the latent cache, not [{L}, {width})")
    elif not fused_term and L != width:
        raise Fp8Refused(f"its latent cache has {width} columns and the attention reads {L} of them")
    if match.v_dim > L or L % 4:
        raise Fp8Refused(f"{L} latent columns ({match.v_dim} values): fp8 needs values within the latent and a "
                         f"multiple of 4 latent columns")
    return fp8.Fp8Layout(L, width - L, buffer.dtype)


class Fp8Refused(Exception):
    """Why a layer's cache cannot be stored as fp8 (the message says so)."""


def fp8_packed_write(graph: fx.Graph, write: CacheAccess, entry: LocalCache) -> CacheAccess:
    """`write` as the striped write of an fp8 shard takes it: its value packed in the graph
    (kv_format.pack_columns, or the rotary columns' bytes), its columns the bytes of the row
    they fill. Fp8Refused for columns that are not the whole latent (a quantisation block
    needs every column of a row), the rotary columns, or both."""
    spec = fp8.Fp8Layout.parse(entry.kv_format)
    width = fx_util.node_value(write.value).shape[-1]
    feat_start = write.feat[0] if write.feat else 0
    cols = (feat_start, feat_start + width)
    with graph.inserting_before(write.node):
        if cols in ((0, spec.latent), (0, spec.columns)):
            packed = fx_util.call(graph, fp8.pack_columns, write.value, spec.latent, spec.rope, spec.rope_dtype,
                                  name="fp8_rows")
            offset = 0
        elif spec.rope and cols == (spec.latent, spec.columns):
            packed = fx_util.call(graph, fp8.rope_bytes_of, write.value, spec.rope_dtype, name="rope_bytes")
            offset = spec.rope_offset
        else:
            raise Fp8Refused(f"a write of columns [{cols[0]}, {cols[1]}) of {entry.name}: an fp8 cache is written "
                             f"whole latent rows (columns [0, {spec.latent})) or its rotary columns")
    fx_util.set_example_value(packed)
    nbytes = fx_util.node_value(packed).shape[-1]
    return dataclasses.replace(write, value=packed, feat=(offset, offset + nbytes))


# Kinds whose tensors are new objects for every generation (a Hugging Face Cache's): a graph
# compiled for them must guard on the plain tensor class they arrive with, else every new
# generation's first call would compile the graph again. Their shards are installed (storage
# released, class changed) at the graph's first call, after Dynamo has built its guards,
# instead of during the compile; the next call then compiles once for the striped class.
INSTALLED_AT_FIRST_CALL: set[str] = set()
_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()  # buffer -> its shard, made, not installed


def install_at_first_call(buffer: torch.Tensor, entry: LocalCache) -> None:
    """Keep `entry` for `buffer` until the compiled graph's first call installs it (local_for)."""
    if lookup_local_cache(buffer) is None:
        _PENDING[buffer] = entry


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
    kind: str
    outputs: tuple[int, ...]  # where the graph's output returns the tensor

    @classmethod
    def of(cls, example: torch.Tensor, axis: int, c: int, rank: int, name: str, kind: str,
           outputs: tuple[int, ...] = ()) -> "AllocatedCache":
        return cls(tuple(int(s) for s in example.shape), tuple(int(s) for s in example.stride()), example.dtype,
                   example.device, axis, c, rank, name, kind, outputs)

    def shell(self) -> torch.Tensor:
        return unallocated(self.shape, self.stride, self.dtype, self.device)

    def shard(self) -> LocalCache:
        tokens = self.shape[self.axis]
        shape = list(self.shape)
        shape[self.axis] = layout.local_capacity(tokens, self.c) + 1
        local = torch.zeros(shape, dtype=self.dtype, device=self.device)
        full = _storage_nbytes(self.shape, self.stride, self.dtype.itemsize)
        return LocalCache(local, tokens, self.c, self.rank, full, self.name, kind=self.kind)

    def make(self) -> tuple[torch.Tensor, LocalCache]:
        return self.shell(), self.shard()


def install_allocated(shell: torch.Tensor, entry: LocalCache) -> None:
    """Make `entry` the stripe of `shell`, a full-shape tensor that never had memory (AllocatedCache)."""
    _LOCAL_CACHES[shell] = entry
    guard(shell, [])  # held by a cache object, not a module: no owner to guard
    _mark_striped(shell)


# --------------------------------------------------------------------------- no memory behind


def _storage_nbytes(shape, stride, element_size: int, offset: int = 0) -> int:
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
    nbytes = _storage_nbytes(shape, stride, t.element_size())
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


def defer(buffer: torch.Tensor, name: str, fill: Optional[float], owner: torch.nn.Module) -> None:
    """Register an `unallocated` buffer as a deferred cache of `owner`."""
    _DEFERRED[buffer] = DeferredCache(name, fill, type(owner).__name__)
    guard(buffer, [owner])


def materialize_full(buffer: torch.Tensor) -> None:
    """Allocate a deferred buffer in full (dcp_size=1: no striping); it becomes an ordinary buffer."""
    info = _DEFERRED.pop(buffer)
    back(buffer, info.fill)
    for attr in _GUARDED_ATTRS:
        buffer.__dict__.pop(attr, None)


def _deferred_like(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    new = unallocated(t.shape, t.stride(), dtype, device)
    _DEFERRED[new] = _DEFERRED[t]
    guard(new, [])  # the owner's hooks are in place already
    return new


# --------------------------------------------------------------------------- guards
#
# Per-instance attributes on the buffer: copy.deepcopy and pickle look up `__deepcopy__`
# and `__reduce_ex__` on the instance, and Module._apply (`.to`, `.half()`, `.cuda()`, ...)
# calls `t.to(...)` etc. through instance attribute lookup. Dynamo itself sets instance
# attributes on buffers (`_dynamo_static_input_type`) and does not guard on them, so they
# cost no recompile. A deferred buffer converts and copies for free (there is nothing to
# copy); a striped one refuses anything but a no-op conversion.

_CONVERSIONS = ("to", "cuda", "cpu", "type", "float", "double", "half", "bfloat16")
_GUARDED_ATTRS = _CONVERSIONS + ("__deepcopy__", "__reduce_ex__", "share_memory_")


def _describe(buffer: torch.Tensor) -> tuple[str, str]:
    """(name, why it has no full-size data) for messages."""
    entry = _LOCAL_CACHES.get(buffer)
    if entry is not None:
        return entry.name, (f"DCP striped it (dcp_size={entry.c}): this rank keeps only positions p with "
                            f"p % {entry.c} == {entry.rank} and its full-size storage was released")
    info = _DEFERRED.get(buffer)
    if info is not None:
        return info.name, "it was built under dcp_pass.deferred_caches() and was never allocated"
    return "?", "?"


def _refuse(ref, what: str, *args: Any, **kwargs: Any):
    buffer = ref()
    name, why = _describe(buffer)
    fix = ("Build the model without dcp_pass.deferred_caches() to do this" if buffer in _DEFERRED else
           "Do it before compiling the model with backend='dcp', or build a new model")
    raise DcpCacheError(f"dcp_pass: cannot {what} cache buffer {name}: {why}. {fix}.")


def _convert(ref, method: str, *args: Any, **kwargs: Any):
    buffer = ref()
    # What the conversion does, learnt on an empty tensor of the same dtype and device.
    probe = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    out = getattr(torch.Tensor, method)(probe, *args, **kwargs)
    if not isinstance(out, torch.Tensor):  # t.type() with no argument: the type name
        return out
    if out is probe:  # a no-op conversion returns the tensor itself
        return buffer
    if buffer in _DEFERRED:
        return _deferred_like(buffer, out.dtype, out.device)
    return _refuse(ref, f"convert (.{method}) the")


def _deepcopy(ref, memo):
    buffer = ref()
    if buffer in _DEFERRED:
        memo[id(buffer)] = _deferred_like(buffer, buffer.dtype, buffer.device)
        return memo[id(buffer)]
    return _refuse(ref, "deep-copy the")


def guard(buffer: torch.Tensor, owners: list) -> None:
    """Make every ordinary path that would read `buffer`'s missing data raise `DcpCacheError`."""
    ref = weakref.ref(buffer)  # no reference cycle: a deleted model frees its buffers at once
    for method in _CONVERSIONS:
        setattr(buffer, method, functools.partial(_convert, ref, method))
    buffer.__deepcopy__ = functools.partial(_deepcopy, ref)
    buffer.__reduce_ex__ = functools.partial(_refuse, ref, "pickle (torch.save) the")
    buffer.share_memory_ = functools.partial(_refuse, ref, "share_memory_() the")
    for module in owners:
        _guard_owner(module)


_KNOWN_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # buffer -> [weakref to the module holding it]


def _owners_of(buffer: torch.Tensor) -> list:
    """Modules holding `buffer` in their `_buffers` (the backend is handed tensors, not modules).

    Learnt from the modules the calling frames run (`self` of each frame up the stack:
    the model, so every layer, also those a shared graph first meets at run time);
    failing that, from gc referrers (a heap scan: ~30 ms per 400k objects, per buffer).
    """
    if buffer not in _KNOWN_OWNERS:
        _learn_owners_from_stack()
    if buffer not in _KNOWN_OWNERS:
        return _owners_by_gc(buffer)
    return [m for m in (ref() for ref in _KNOWN_OWNERS[buffer]) if m is not None]


def _is_module_method(frame) -> bool:
    """Whether `frame` runs a method of an nn.Module class, known without reading its locals.

    Before Python 3.13 `frame.f_locals` leaves a snapshot of every local on the frame until
    it returns: read on a user's driver method it would keep what the driver later deletes
    (a loaded checkpoint, say) alive. A module method's frame is part of the call in progress.
    """
    code = frame.f_code
    if code.co_argcount == 0 or code.co_varnames[0] != "self":
        return False
    owner = frame.f_globals.get(getattr(code, "co_qualname", "").split(".")[0])
    return isinstance(owner, type) and issubclass(owner, torch.nn.Module)


def _modules_on_stack(frame) -> dict[int, torch.nn.Module]:
    """The modules whose methods run in `frame` and the frames that called it, by id."""
    roots = {}
    while frame is not None:
        owner = frame.f_locals.get("self") if _is_module_method(frame) else None
        if isinstance(owner, torch.nn.Module):
            roots[id(owner)] = owner
        frame = frame.f_back
    return roots


def _learn_owners_from_stack() -> None:
    roots = _modules_on_stack(sys._getframe(1))
    seen: set[int] = set()
    for root in roots.values():
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for b in module._buffers.values():
                if b is not None:
                    refs = _KNOWN_OWNERS.setdefault(b, [])
                    if not any(ref() is module for ref in refs):
                        refs.append(weakref.ref(module))


def sibling_buffers(buffer: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """The buffers that play `buffer`'s part in the other layers: the same attribute of every
    module of its owner's class (in the modules the calling frames run), of the same shape,
    dtype and device, not yet striped.

    One compiled graph serves every layer of a model whose blocks share their code; its
    guards check the class of each buffer it takes, so every layer's caches must be
    striped together, before the first call that passes them (else each layer's first
    call would compile the graph again).
    """
    owners = _owners_of(buffer)
    names = {(type(m), key) for m in owners for key, b in m._buffers.items() if b is buffer}
    if not names:
        return []
    roots = _modules_on_stack(sys._getframe(1))
    found: dict[int, tuple[torch.Tensor, str]] = {}
    for root in roots.values():
        for path, module in root.named_modules():
            for cls, key in names:
                other = module._buffers.get(key) if type(module) is cls else None
                if (other is not None and other is not buffer and not is_released(other)
                        and other.shape == buffer.shape and other.dtype == buffer.dtype
                        and other.device == buffer.device):
                    found.setdefault(id(other), (other, f"{path}.{key}" if path else key))
    return list(found.values())


def _owners_by_gc(buffer: torch.Tensor) -> list:
    dicts = [d for d in gc.get_referrers(buffer) if isinstance(d, dict)]
    if not dicts:
        return []
    owners, instance_dicts = [], []
    for r in gc.get_referrers(*dicts):
        if isinstance(r, torch.nn.Module) and any(r.__dict__.get("_buffers") is d for d in dicts):
            owners.append(r)
        elif isinstance(r, dict) and any(r.get("_buffers") is d for d in dicts):
            instance_dicts.append(r)  # a module whose __dict__ is a separate dict object
    if instance_dicts:
        owners += [m for m in gc.get_referrers(*instance_dicts)
                   if isinstance(m, torch.nn.Module) and any(m.__dict__ is d for d in instance_dicts)]
    return owners


def _guard_owner(module: torch.nn.Module) -> None:
    if _owner_pre_hook in module._forward_pre_hooks.values():
        return
    # With torch._dynamo.config.skip_nnmodule_hook_guards (default True) adding hooks after a
    # compile does not recompile; graphs traced later trace the hook, which adds no node.
    module.register_forward_pre_hook(_owner_pre_hook)
    # Public names since torch 2.4/2.5; the private ones take the same hooks.
    if hasattr(module, "register_state_dict_pre_hook"):  # before state_dict touches the buffers
        module.register_state_dict_pre_hook(_owner_state_dict_pre_hook)
    getattr(module, "register_state_dict_post_hook", module._register_state_dict_hook)(_owner_state_dict_hook)
    if hasattr(module, "register_load_state_dict_pre_hook"):
        module.register_load_state_dict_pre_hook(_owner_load_hook)
    else:
        module._register_load_state_dict_pre_hook(_owner_load_hook, with_module=True)


def _unbacked(module: torch.nn.Module) -> list[torch.Tensor]:
    return [b for b in module._buffers.values() if b is not None and is_released(b)]


def _inside_compiled_region() -> bool:
    """Whether Dynamo intercepts frames here (it will compile the forward this hook precedes).

    False in plain eager code and where Dynamo runs a frame without compiling it
    (recompile limit reached, or torch.compiler.disable).
    """
    callback = fx_util.eval_frame_callback()
    return callback not in (None, False, True)


def _owner_pre_hook(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        _check_tracing_backend(type(module).__name__)  # runs for real at trace time; no graph node
        return None
    if _inside_compiled_region():
        return None
    buffers = _unbacked(module)
    if not buffers:
        return None
    described = [_describe(b) for b in buffers]
    names = ", ".join(name for name, _ in described)
    msg = (f"dcp_pass: {type(module).__name__} ran eagerly, but its cache buffer(s) {names} hold no full-size "
           f"data ({described[0][1]}). It can only run inside a graph compiled with backend='dcp'. Either the "
           f"original module was called instead of the one torch.compile returned, or Dynamo fell back to eager "
           f"for this frame (recompile limit reached: see TORCH_LOGS=recompiles and raise "
           f"torch._dynamo.config.recompile_limit; or a compile error hidden by suppress_errors).")
    if any(b in _DEFERRED for b in buffers):
        msg += " To run it without DCP, call dcp_pass.materialize(model, dcp_size=1) first."
    raise DcpCacheError(msg)


# The DCP compilers, (the DcpBackend class, the dcp_backend entry function), registered by
# dcp_pass.backend when it loads. The guards recognise a DCP compile by them without
# importing the backend, which imports the rewrites: nothing can trace for a DCP backend
# before that module is loaded.
_DCP_COMPILERS: list = []


def register_dcp_compilers(backend_class: type, entry: Any) -> None:
    """Called once by dcp_pass.backend: the class and the function a DCP compile runs."""
    _DCP_COMPILERS[:] = [(backend_class, entry)]


def _tracing_backend() -> tuple[Optional[str], Any]:
    """The backend Dynamo is tracing for: ("dcp", dcp_size), ("other", name) or (None, None) if unknown.

    Walks Dynamo's wrappers of the compiler (WrapBackendDebug -> torch.compile's wrapper
    -> the backend). Only a backend registered under another name counts as "other", so a
    wrapper we do not know is never refused.
    """
    from dcp_pass.options import DcpOptions

    backend_class, entry = _DCP_COMPILERS[0] if _DCP_COMPILERS else (type(None), None)
    try:
        fn = fx_util.tracing_compiler_fn()
    except Exception:  # noqa: BLE001 - internals moved: do not guess
        return None, None
    name, options = None, None
    seen: list[Any] = []
    while fn is not None and not any(fn is s for s in seen):
        seen.append(fn)
        if isinstance(fn, backend_class):
            return "dcp", _striping_size(fn.options)
        if fn is entry:
            return "dcp", _striping_size(DcpOptions.from_mapping(options))
        name = getattr(fn, "compiler_name", name)
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and kwargs.get("options") is not None:
            options = kwargs["options"]
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    if isinstance(name, str) and name != "dcp" and name in fx_util.registered_backends():
        return "other", name
    return None, None


def _striping_size(options) -> int:
    """The DCP size the compile stripes caches with; 0 when dcp_size=1 still rewrites (fast_path):
    then the pass owns the caches (their first shard is the only storage they get, in the
    kv_cache_dtype asked for), as for dcp_size > 1."""
    return 0 if options.dcp_size == 1 and options.fast_path else options.dcp_size


@torch.compiler.assume_constant_result
def _check_tracing_backend(owner: str) -> bool:
    """At trace time: refuse a non-DCP backend; with dcp_size=1 give deferred buffers full storage.

    Raising here (real Python, run by Dynamo while it traces) fails that compile only;
    raising from traced code would make Dynamo skip the frame for the DCP compile too.
    It gets the owner's class name, not the module: the arguments of this call are
    guarded as constants, and a guard on the module's identity would recompile a shared
    Block graph for every layer. So it looks at every cache buffer of the process.
    """
    kind, detail = _tracing_backend()  # detail: dcp_size, or the other backend's name
    if kind == "dcp" and detail == 1:  # DCP off: the caches are ordinary full-size buffers
        for buffer, info in list(_DEFERRED.items()):
            if info.owner == owner:
                materialize_full(buffer)
    elif kind == "other" and (len(_LOCAL_CACHES) or len(_DEFERRED)):
        described = [_describe(b) for b in (*_LOCAL_CACHES.keys(), *_DEFERRED.keys())]
        names = ", ".join(n for n, _ in described[:4])
        names += f" and {len(described) - 4} more" if len(described) > 4 else ""
        raise DcpCacheError(
            f"dcp_pass: {owner} is being compiled with backend {detail!r}, but cache buffer(s) {names} hold no "
            f"full-size data ({described[0][1]}); only backend='dcp' can run them. Compile the model with "
            f"backend='dcp' and the same options."
        )
    return True


def _owner_state_dict_pre_hook(module, prefix, keep_vars) -> None:
    for key, buffer in module._buffers.items():
        if buffer is not None and key not in module._non_persistent_buffers_set and is_released(buffer):
            _refuse(weakref.ref(buffer), "save (state_dict) the")


def _owner_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    for key, buffer in module._buffers.items():
        if buffer is not None and prefix + key in state_dict and is_released(buffer):
            _refuse(weakref.ref(buffer), "save (state_dict) the")


def _owner_load_hook(module, state_dict, prefix, *args: Any) -> None:
    for key, buffer in module._buffers.items():
        if buffer is not None and prefix + key in state_dict and is_released(buffer):
            _refuse(weakref.ref(buffer), "load (load_state_dict) into the")


# --------------------------------------------------------------------------- graph


def local_cache_placeholder(graph: fx.Graph, index: int, example: torch.Tensor) -> fx.Node:
    """A new trailing graph input carrying the local shard of one cache buffer."""
    return fx_util.static_placeholder(graph, f"dcp_local_cache_{index}", example)
