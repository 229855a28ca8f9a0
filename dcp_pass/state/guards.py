"""The guards of cache tensors without full-size data (striped by DCP, or deferred).

A buffer without full-size data must not be read outside a DCP graph. Ordinary
operations that would (deepcopy, pickling, `Module.to`/`.half()`/..., eager calls of the
owning module, another backend compiling it, state_dict save/load) raise `DcpCacheError`
naming the buffer instead of copying garbage or crashing; see `guard` below. A striped
buffer's class becomes `StripedCacheTensor`, which refuses eager torch calls on its data.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dcp_pass import dynamo_frames
from dcp_pass.state.memory import back, unallocated
from dcp_pass.state.store import (
    DEFERRED,
    STRIPED,
    DcpCacheError,
    DeferredCache,
    LocalCache,
    describe,
    is_released,
    lookup_local_cache,
)


class StripedCacheTensor(torch.Tensor):
    """The class a cache buffer takes once DCP has striped it.

    Two things follow from the class alone. Dynamo guards on the type of every tensor a
    graph takes, so every graph compiled while the buffer was an ordinary tensor (a
    write-only prefill graph, say) fails its guards and is compiled again, this time by a
    pass that sees the buffer striped: no compiled graph ever writes or reads the released
    storage. And any eager torch call that would read or write its data raises
    `DcpCacheError` naming it (its metadata stays readable: shape, dtype, device, ...),
    except `zero_()` on a resettable kind (ShardKind.resettable), which zeroes this rank's
    shard (a Hugging Face cache reset between generations).
    While Dynamo traces, calls pass through as on a plain tensor (the pass rewrites them).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("__repr__", "__str__", "__format__") and args and not kwargs.get("_plain"):
            with torch._C.DisableTorchFunctionSubclass():
                t = args[0]
                name, _ = describe(t)
                return f"<cache buffer {name} striped by dcp_pass: shape {tuple(t.shape)}, {t.dtype}, {t.device}>"
        if torch.compiler.is_compiling() or _is_metadata(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        touched = next((a for a in _tensors_in(args, kwargs) if type(a) is StripedCacheTensor), None)
        what = getattr(func, "__name__", str(func))
        entry = lookup_local_cache(touched) if touched is not None else None
        if what == "zero_" and args and args[0] is touched and entry is not None and entry.kind.resettable:
            # a cache reset (Hugging Face's Cache.reset() between generations) clears this rank's rows
            entry.local.zero_()
            return touched
        if what in ("index_select", "index_copy_") and args and args[0] is touched and entry is not None:
            return _reorder_batch(what, touched, entry, args, kwargs)
        name, why = describe(touched) if touched is not None else ("?", "?")
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
    name, _ = describe(touched)
    where = (
        f"dcp_pass: eager code called {what} on cache buffer {name} (striped by DCP): only reorders of "
        f"the batch axis (dim 0) by an integer index"
    )
    if (
        not entry.kind.batch_reorderable
        or not isinstance(dim, int)
        or dim not in (0, -touched.dim())
        or not isinstance(index, torch.Tensor)
        or index.dim() != 1
        or index.is_floating_point()
    ):
        raise DcpCacheError(f"{where} run on its shard; call the compiled model for anything else")
    index = index.to(entry.local.device)
    if what == "index_select":
        if index.shape[0] != touched.shape[0]:
            raise DcpCacheError(
                f"{where} that keep the batch size ({touched.shape[0]}) run on its shard; this one "
                f"selects {index.shape[0]} rows"
            )
        entry.local.copy_(entry.local.index_select(0, index))
        return touched
    other = lookup_local_cache(source) if isinstance(source, torch.Tensor) else None
    if other is None or other.local.shape[1:] != entry.local.shape[1:] or other.kv_format != entry.kv_format:
        raise DcpCacheError(f"{where}, from another cache striped the same way, run on its shard")
    entry.local.index_copy_(0, index, other.local)
    return touched


_METADATA_CALLS = {
    "size",
    "dim",
    "stride",
    "storage_offset",
    "numel",
    "element_size",
    "is_contiguous",
    "untyped_storage",
    "data_ptr",
    "__len__",
    "__hash__",
    "is_floating_point",
    "is_complex",
    "get_device",
    "nelement",
    "__reduce_ex__",
    "__deepcopy__",
    "__setstate__",
    "requires_grad_",
    "_is_view",
    "__dlpack_device__",
    "is_inference",
    "is_pinned",
    "is_shared",
    "is_signed",
    "is_set_to",
    "_is_zerotensor",
    "is_conj",
    "is_neg",
    "_nnz",
}
_METADATA_PROPERTIES = {
    "shape",
    "dtype",
    "device",
    "ndim",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "requires_grad",
    "layout",
    "names",
    "grad_fn",
    "is_leaf",
    "grad",
    "is_sparse",
    "is_quantized",
    "_base",
    "itemsize",
    "nbytes",
    "is_nested",
    "__class__",
    "__dict__",
    "_version",
    "is_mps",
    "is_xpu",
    "is_mkldnn",
    "is_vulkan",
    "is_ipu",
    "is_xla",
    "is_mtia",
    "is_maia",
    "is_sparse_csr",
}


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


def mark_striped(buffer: torch.Tensor) -> None:
    if type(buffer) is torch.Tensor:
        buffer.__class__ = StripedCacheTensor


def defer(buffer: torch.Tensor, name: str, fill: Optional[float], owner: torch.nn.Module) -> None:
    """Register an `unallocated` buffer as a deferred cache of `owner`."""
    DEFERRED[buffer] = DeferredCache(name, fill, type(owner).__name__)
    guard(buffer, [owner])


def materialize_full(buffer: torch.Tensor) -> None:
    """Allocate a deferred buffer in full (dcp_size=1: no striping); it becomes an ordinary buffer."""
    info = DEFERRED.pop(buffer)
    back(buffer, info.fill)
    for attr in _GUARDED_ATTRS:
        buffer.__dict__.pop(attr, None)


def _deferred_like(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    new = unallocated(t.shape, t.stride(), dtype, device)
    DEFERRED[new] = DEFERRED[t]
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


def _refuse(ref, what: str, *args: Any, **kwargs: Any):
    buffer = ref()
    name, why = describe(buffer)
    fix = (
        "Build the model without dcp_pass.deferred_caches() to do this"
        if buffer in DEFERRED
        else "Do it before compiling the model with backend='dcp', or build a new model"
    )
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
    if buffer in DEFERRED:
        return _deferred_like(buffer, out.dtype, out.device)
    return _refuse(ref, f"convert (.{method}) the")


def _deepcopy(ref, memo):
    buffer = ref()
    if buffer in DEFERRED:
        memo[id(buffer)] = _deferred_like(buffer, buffer.dtype, buffer.device)
        return memo[id(buffer)]
    return _refuse(ref, "deep-copy the")


def guard(buffer: torch.Tensor, owners: list) -> None:
    """Make every ordinary path that would read `buffer`'s missing data raise `DcpCacheError`."""
    ref = weakref.ref(buffer)  # no reference cycle: a deleted model frees its buffers at once
    for method in _CONVERSIONS:
        setattr(buffer, method, functools.partial(_convert, ref, method))
    setattr(buffer, "__deepcopy__", functools.partial(_deepcopy, ref))
    setattr(buffer, "__reduce_ex__", functools.partial(_refuse, ref, "pickle (torch.save) the"))
    setattr(buffer, "share_memory_", functools.partial(_refuse, ref, "share_memory_() the"))
    for module in owners:
        _guard_owner(module)


_KNOWN_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # buffer -> [weakref to the module holding it]


def owners_of(buffer: torch.Tensor) -> list:
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


def modules_on_stack(frame) -> dict[int, torch.nn.Module]:
    """The modules whose methods run in `frame` and the frames that called it, by id."""
    roots = {}
    while frame is not None:
        owner = frame.f_locals.get("self") if _is_module_method(frame) else None
        if isinstance(owner, torch.nn.Module):
            roots[id(owner)] = owner
        frame = frame.f_back
    return roots


def _learn_owners_from_stack() -> None:
    roots = modules_on_stack(sys._getframe(1))
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
        owners += [
            m
            for m in gc.get_referrers(*instance_dicts)
            if isinstance(m, torch.nn.Module) and any(m.__dict__ is d for d in instance_dicts)
        ]
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
    callback = dynamo_frames.eval_frame_callback()
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
    described = [describe(b) for b in buffers]
    names = ", ".join(name for name, _ in described)
    msg = (
        f"dcp_pass: {type(module).__name__} ran eagerly, but its cache buffer(s) {names} hold no full-size "
        f"data ({described[0][1]}). It can only run inside a graph compiled with backend='dcp'. Either the "
        f"original module was called instead of the one torch.compile returned, or Dynamo fell back to eager "
        f"for this frame (recompile limit reached: see TORCH_LOGS=recompiles and raise "
        f"torch._dynamo.config.recompile_limit; or a compile error hidden by suppress_errors)."
    )
    if any(b in DEFERRED for b in buffers):
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
        fn = dynamo_frames.tracing_compiler_fn()
    except Exception:  # noqa: BLE001 - internals moved: do not guess
        return None, None
    name, options = None, None
    seen: list[Any] = []
    while fn is not None and not any(fn is s for s in seen):
        seen.append(fn)
        if isinstance(fn, backend_class):
            return "dcp", _striping_size(getattr(fn, "options"))  # a DcpBackend's (fn is not None here)
        if fn is entry:
            return "dcp", _striping_size(DcpOptions.from_mapping(options))
        name = getattr(fn, "compiler_name", name)
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and kwargs.get("options") is not None:
            options = kwargs["options"]
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    if isinstance(name, str) and name != "dcp" and name in dynamo_frames.registered_backends():
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
        for buffer, info in list(DEFERRED.items()):
            if info.owner == owner:
                materialize_full(buffer)
    elif kind == "other" and (len(STRIPED) or len(DEFERRED)):
        described = [describe(b) for b in (*STRIPED.keys(), *DEFERRED.keys())]
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
