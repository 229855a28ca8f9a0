"""Run an attention call again without its Python: record once per signature, replay after.

Without CUDA graphs every decode step pays the op's host time, and on the H200 machines
that was 0.3-0.6 ms per attention call (benchmarks/probe_launch.py): backend choice,
operand checks, config, strides, Triton's per-launch argument binding, and three small
torch ops for the local key counts, around some tens of microseconds of GPU work.

For one input signature (shapes, strides, dtypes, device, pointer alignment, scalars) that
Python always does the same thing: it allocates the same buffers and launches the same
compiled kernels on the same grids with the same integers, every tensor argument a fixed
byte offset into an input or into one of the new buffers. So the first call of a
signature runs the Python path while watching it (aten ops through a dispatch mode,
launches through `kernels.common.launch`) and keeps, when that is all it did, a
`Replay`: later calls allocate the buffers and call each compiled kernel's launcher
directly, with the pointers filled in.

Any other torch op in the watched call (a copy, arithmetic, a read of a device value)
means the call depends on data, and the signature is marked not replayable: it runs the
Python path every time, exactly as before. So does any call while Triton launch hooks
are set (a profiler), and every call with DCP_REPLAY=0.

A host TMA descriptor argument (Triton's ``TensorDescriptor``: the narrow fp8 kernel's cache
tiles) names its tensor by object, and Triton's launcher reads that tensor's address at each
launch. The signature holds no addresses, so every layer of a model shares one recording:
replaying the recorded descriptor would make each layer read the first layer's cache. A
replay therefore rebases each descriptor on the new call's tensor (the same byte offset, as
for a pointer argument); any other argument that is neither a tensor, a descriptor nor a
plain number, string or dtype makes the signature not replayable.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcp_pass import env

aten = torch.ops.aten
_ALLOCATING = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
_MAX_SIGNATURES = 512  # a decode run has a handful; this only bounds a pathological caller
_NOT_REPLAYABLE = object()


class _Watch(TorchDispatchMode):
    """Keeps the tensors that allocating ops return and the name of any op that is not a view."""

    def __init__(self):
        super().__init__()
        self.buffers: list[torch.Tensor] = []
        self.other: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATING:
            self.buffers.append(out)
        elif not func.is_view:
            self.other.append(str(func))
        return out


class _Address:
    """A descriptor's base at replay: Triton's launcher reads only the address (``data_ptr``)
    of a host descriptor's base (its dtype only when binding, which a replay skips). Holding an
    int rather than a tensor keeps a replay from holding any call's cache alive."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype):
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


_REBASED_PER_LAUNCH = 1024  # descriptors kept per launch: one per cache a model has (its layers)


def _descriptor_base(value) -> Optional[torch.Tensor]:
    """The tensor a host TMA descriptor reads (Triton's and Gluon's ``TensorDescriptor`` name it
    ``base``), or None when `value` is not a descriptor."""
    base = getattr(value, "base", None)
    return base if isinstance(base, torch.Tensor) and hasattr(value, "block_shape") else None


def _rebased(descriptor, address: int):
    """`descriptor` over the same shape, strides and box, at `address` (no validation: the
    recorded call's descriptor passed it, and the signature fixes alignment and strides)."""
    moved = copy.copy(descriptor)
    object.__setattr__(moved, "base", _Address(address, descriptor.base.dtype))
    return moved


_PLAIN = (bool, int, float, str, type(None), torch.dtype)  # parameters a replay may pass as recorded


@dataclass(frozen=True)
class _Launch:
    run: Callable  # the compiled kernel's launcher
    function: Any
    packed_metadata: Any
    grid: tuple
    template: tuple  # every kernel parameter in order, pointers and descriptors as 0
    pointers: tuple  # (position, from an input?, index, byte offset)
    # (position, from an input?, index, byte offset of its base, descriptor on an `_Address`)
    descriptors: tuple = ()
    rebased: dict = field(default_factory=dict, compare=False)  # (position, address) -> descriptor

    def descriptor_at(self, position: int, descriptor, address: int):
        """The recorded `descriptor` moved to `address`, made once per address (a model's caches
        keep theirs for the whole run)."""
        key = (position, address)
        moved = self.rebased.get(key)
        if moved is None:
            if len(self.rebased) >= _REBASED_PER_LAUNCH:
                self.rebased.clear()
            moved = self.rebased[key] = _rebased(descriptor, address)
        return moved


_ARENA_ALIGN = 256  # bytes; Triton specialises pointers on 16-byte alignment


@dataclass(frozen=True)
class Replay:
    outputs: tuple  # (shape, stride, dtype) of each returned tensor: allocated one by one
    arena_nbytes: int  # every other buffer of the call (scratch) lives in one allocation
    layout: tuple  # per recorded buffer: (True, output index) or (False, byte offset in the arena)
    launches: tuple
    device: torch.device

    def __call__(self, inputs: Sequence[Optional[torch.Tensor]]):
        device = self.device
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in self.outputs]
        # freed when this returns, like the Python path's scratch: stream-ordered reuse only
        arena = torch.empty(self.arena_nbytes, dtype=torch.uint8, device=device) if self.arena_nbytes else None
        base = arena.data_ptr() if arena is not None else 0
        in_ptrs = [0 if t is None else t.data_ptr() for t in inputs]
        buf_ptrs = [outs[x].data_ptr() if is_out else base + x for is_out, x in self.layout]
        stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
        for k in self.launches:
            args = list(k.template)
            for pos, from_input, index, offset in k.pointers:
                args[pos] = (in_ptrs if from_input else buf_ptrs)[index] + offset
            for pos, from_input, index, offset, descriptor in k.descriptors:
                args[pos] = k.descriptor_at(pos, descriptor, (in_ptrs if from_input else buf_ptrs)[index] + offset)
            k.run(k.grid[0], k.grid[1], k.grid[2], stream, k.function, k.packed_metadata, None, None, None, *args)
        return tuple(outs)


_HOOK_HOLDER: list = []  # the object Triton keeps its launch hooks on (found once)


def _hooks_set() -> bool:
    """Whether Triton launch hooks are on (a profiler): then only Triton's own launch path calls them."""
    if not _HOOK_HOLDER:
        try:
            from triton import knobs

            _HOOK_HOLDER.append(knobs.runtime)
        except (ImportError, AttributeError):
            from triton.compiler.compiler import CompiledKernel

            _HOOK_HOLDER.append(CompiledKernel)
    holder = _HOOK_HOLDER[0]
    hooks = (getattr(holder, "launch_enter_hook", None), getattr(holder, "launch_exit_hook", None))
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _all_parameters(jit_fn, args: tuple, options: dict) -> Optional[list]:
    """Every parameter of the kernel in order, as Triton's binder hands them to the launcher."""
    import inspect

    sig = getattr(jit_fn, "signature", None) or inspect.signature(jit_fn.fn)
    bound = sig.bind(*args, **{k: v for k, v in options.items() if k in sig.parameters})
    bound.apply_defaults()
    return list(bound.arguments.values())


def _source(t: torch.Tensor, inputs, buffers) -> Optional[tuple]:
    """(from an input?, index, byte offset) of a kernel's tensor argument, or None if it comes from elsewhere."""
    storage = t.untyped_storage().data_ptr()
    for from_input, pool in ((True, inputs), (False, buffers)):
        for i, src in enumerate(pool):
            if src is not None and src.untyped_storage().data_ptr() == storage:
                return from_input, i, t.data_ptr() - src.data_ptr()
    return None


def build_replay(inputs: Sequence[Optional[torch.Tensor]], buffers: list, launches: list, result) -> Optional[Replay]:
    """A `Replay` of a watched call, or None when it cannot be replayed exactly."""
    if not buffers or not launches or not isinstance(result, tuple):
        return None
    present = [t for t in inputs if t is not None]
    storages = [t.untyped_storage().data_ptr() for t in present]
    if len(set(storages)) != len(storages):  # inputs sharing memory: an argument's source would be ambiguous
        return None
    made = []
    for jit_fn, compiled, grid, args, options in launches:
        if compiled is None or not hasattr(compiled, "run"):
            return None  # interpreter, or an unexpected Triton: run the Python path
        params = _all_parameters(jit_fn, args, options)
        template, pointers, descriptors = [], [], []
        for pos, value in enumerate(params):
            if isinstance(value, torch.Tensor):
                src = _source(value, inputs, buffers)
                if src is None:
                    return None
                pointers.append((pos, *src))
                template.append(0)
            elif (base := _descriptor_base(value)) is not None:
                src = _source(base, inputs, buffers)
                if src is None:
                    return None
                descriptors.append((pos, *src, _rebased(value, base.data_ptr())))
                template.append(0)
            elif isinstance(value, _PLAIN):
                template.append(value)
            else:  # an object that may name memory of this call (a list of tensors, ...): run the Python path
                return None
        grid = tuple(grid) + (1,) * (3 - len(grid))
        made.append(
            _Launch(
                compiled.run,
                compiled.function,
                compiled.packed_metadata,
                grid,
                tuple(template),
                tuple(pointers),
                tuple(descriptors),
            )
        )
    outputs = []
    for out in result:  # each result must be one whole buffer (the mode hands back other Python objects)
        index = next(
            (
                i
                for i, b in enumerate(buffers)
                if b.data_ptr() == out.data_ptr()
                and b.shape == out.shape
                and b.stride() == out.stride()
                and b.dtype == out.dtype
            ),
            None,
        )
        if index is None or index in outputs:
            return None
        outputs.append(index)
    layout, arena = [], 0
    for i, b in enumerate(buffers):
        if i in outputs:
            layout.append((True, outputs.index(i)))
        else:
            layout.append((False, arena))
            arena += -(-b.untyped_storage().nbytes() // _ARENA_ALIGN) * _ARENA_ALIGN
    device = present[0].device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return Replay(
        tuple((tuple(buffers[i].shape), tuple(buffers[i].stride()), buffers[i].dtype) for i in outputs),
        arena,
        tuple(layout),
        tuple(made),
        device,
    )


_REPLAYS: dict = {}


def signature(*parts: Any, tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    """A cache key: the scalars as given, and each tensor's metadata and pointer alignment."""
    return parts + tuple(
        None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15) for t in tensors
    )


def run(key: tuple, inputs: Sequence[Optional[torch.Tensor]], call: Callable[[], tuple]) -> tuple:
    """The op's result over `inputs`: `call()`'s, or its replay for this `key`.

    `call()` runs the op's Python path and returns (result, replayable): whether what ran
    may be replayed at all (the attention backend table's `replayable`; launches the
    recording cannot see would be skipped by a replay).
    """
    if not env.replay_enabled():  # read per call: tests and benchmarks flip it
        return call()[0]
    replay = _REPLAYS.get(key)
    if replay is not None and replay is not _NOT_REPLAYABLE and not _hooks_set():
        return replay(inputs)
    if replay is _NOT_REPLAYABLE or _hooks_set():
        return call()[0]
    from dcp_pass.runtime.decode.kernels.common import recording_launches  # imports Triton: not at module import

    watch = _Watch()
    with recording_launches() as launches, watch:
        result, replayable = call()
    made = None if watch.other or not replayable else build_replay(inputs, watch.buffers, launches, result)
    if len(_REPLAYS) >= _MAX_SIGNATURES:
        _REPLAYS.clear()
    _REPLAYS[key] = made if made is not None else _NOT_REPLAYABLE
    return result
