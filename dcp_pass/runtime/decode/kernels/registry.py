"""The registry of shard-local attention kernels, what each takes, and the one chooser that reads it.

Every kernel is an entry of :data:`KERNELS`: its name, its module, its timings' names in the
path table, and a frozen :class:`Capabilities` record of what it takes (devices, dtypes,
MLA latent caches or per-head keys and values, fp8 latents, masks, causal caps, page pools,
windows), what it gives (its native LSE base), how it runs (replayable, capturable, planned
on the host), which attention backend it belongs to, whether "auto" considers it and which
environment switch turns it off or forces it. Every "which kernels" decision outside this
file reads those records: the backends' kernel lists and LSE bases (``backends.py``), the
kernels that read an fp8 cache (``options.py``), what "auto" considers.

The kernel's module stays the last word on a call's details, from its
:class:`~dcp_pass.runtime.decode.call.CallShape`:

* ``supports(shape) -> None | reason``: it can run the call (else why not);
* ``offered(shape) -> None | reason`` (optional): the chooser considers it for this call
  (a kernel can run calls it was never measured on, or is slower on by design);
* ``unmeasured(shape) -> bool`` (optional, default True): whether the chooser takes it
  where no measured shape decides;
* ``unavailable(device, dtype) -> None | reason`` (where its capabilities say ``probed``):
  why it cannot run on a device at all (checked when a model compiles; otherwise its
  capabilities' devices say);
* ``run(call, out=None, lse_out=None, **options)``: the launch (options: ``num_splits``,
  ``config`` where the kernel has them).

:func:`select` is the chooser: for a call's shape and what was asked ("auto", a backend,
None for the runtime features' default) it returns a :class:`SelectionTrace`, the kernels
considered in registry order, each rejection with its reason (not what the call needs,
turned off by an environment switch, unusable here, not offered, slower by the path table),
and the winner with why. Among the kernels left: one an environment switch forces; else the
fastest measured nearest the call's shape (``path_table.py``, each entry's ``cost_key``);
else the first, in registry order, that takes unmeasured calls; else the fallback (the torch
reference, which runs every call). The trace of the most recent choice per call site (a
layer of a compiled model, or what was asked and the call elsewhere) is kept in
:data:`LAST_SELECTIONS` for the report.

A new kernel is one module with those functions, one entry here (its capabilities), its
tests (and, to be chosen by measurement, its timings in ``path_table.py``). Kernel modules
are imported when first used: importing the registry (options validation) imports no Triton.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, FrozenSet, Hashable, Iterable, Iterator, Optional, Sequence, Tuple

import torch

from dcp_pass import env
from dcp_pass.runtime.decode.call import CallShape

__all__ = [
    "Capabilities",
    "Kernel",
    "KERNELS",
    "TRITON_KERNELS",
    "UNUSABLE",
    "Rejection",
    "SelectionTrace",
    "LAST_SELECTIONS",
    "backend_kernels",
    "considered",
    "choose",
    "select",
    "select_named",
    "switched_off",
    "forced",
    "collecting",
    "record",
    "trace_for",
    "FALLBACK",
]

AUTO = "auto"
MLA = "mla"  # an MLA latent cache (fused with its rope columns, or beside them)
PER_HEAD = "per_head"  # per-head keys and values (GQA / MHA)
ROW_MASK = "row"  # one additive row per request, shared by every head and query token
FULL_MASK = "full"  # any other additive mask
FP8_E4M3 = torch.float8_e4m3fn
TRITON_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
# the caches "auto" sends to the fast kernels: fp32 caches are a checking mode, run by the
# reference (the Triton kernels run them with IEEE fp32 dots on tiles shrunk to fit shared
# memory: 72.7 ms vs 6.5 ms per step for the 4-layer V3-sized model, docs/performance.md)
FAST_DTYPES = frozenset({torch.bfloat16, torch.float16, FP8_E4M3})


@dataclass(frozen=True)
class Capabilities:
    """What a kernel takes and gives, as the chooser reads it (the module's ``supports``
    then judges the call's sizes, alignments and platform)."""

    backend: str  # the attention backend (option 'attn_backend') whose chooser picks among it
    layouts: FrozenSet[str]  # MLA and / or PER_HEAD
    devices: Optional[FrozenSet[str]] = frozenset({"cuda"})  # device types of its tensors (None: every one)
    dtypes: Optional[FrozenSet[torch.dtype]] = TRITON_DTYPES  # cache dtypes of 16/32-bit calls (None: every one)
    fp8_cache: bool = False  # an fp8 e4m3 latent with per-block scales
    masks: FrozenSet[str] = frozenset({ROW_MASK, FULL_MASK})  # the kinds of additive mask it takes
    causal: bool = True  # causal caps (query positions)
    paged: bool = False  # page pools with a page table
    windows: bool = False  # a window start (kv_start) with device key counts
    lse_base: str = "e"  # the base its LSE comes in natively
    # its calls only allocate, take views and launch Triton kernels through kernels.common.launch,
    # so the op may replay them (runtime/decode/replay.py). A kernel that launches anything else (a
    # C++ extension, a library call) must stay False: a replay would silently skip what the
    # recording cannot see.
    replayable: bool = False
    capturable: bool = True  # it runs inside CUDA-graph capture
    plans_on_host: bool = False  # it plans on the host from the key counts (runtime/decode/step_count.py)
    # "always": "auto" and the runtime features' default (None) consider it; "measured": "auto"
    # only, and only where the path table times it faster; "": neither
    auto: str = ""
    auto_dtypes: Optional[FrozenSet[torch.dtype]] = None  # the cache dtypes "auto" considers it for (None: every)
    fallback: bool = False  # it runs every call: what every chooser falls back to
    # its module's unavailable(device, dtype) says where it can run (a library that may be
    # missing); else its devices do (without importing the module: no Triton at validation)
    probed: bool = False
    switch: str = ""  # the environment variable whose "0" turns it off
    forceable: bool = False  # and whose "1" sends it every call it can run

    def reason(self, shape: CallShape, devices: bool = True) -> Optional[str]:
        """Why a call of this shape is not one this kernel takes (None: it is); `devices`:
        False leaves the device to the module's supports (a CPU call under Triton's
        interpreter, when a kernel is asked for by name)."""
        if devices and self.devices is not None and shape.device not in self.devices:
            devices = "/".join(sorted(d.upper() for d in self.devices))
            return f"needs {devices} tensors, the call's are on {shape.device}"
        if shape.per_head and PER_HEAD not in self.layouts:
            return "reads MLA latent caches, not per-head keys and values"
        if not shape.per_head and MLA not in self.layouts:
            return "reads per-head keys and values, not an MLA latent cache"
        if shape.kv_quant and not self.fp8_cache:
            return f"reads 16-bit caches, not an {shape.kv_quant} latent"
        if not shape.kv_quant and self.dtypes is not None and shape.dtype not in self.dtypes:
            if not self.dtypes:
                return "reads fp8_e4m3 latent caches only"
            taken = "/".join(sorted(_dtype_name(d) for d in self.dtypes))
            return f"takes {taken} caches, not {_dtype_name(shape.dtype)}"
        if shape.mask != "none" and shape.mask not in self.masks:
            return "takes no additive mask" if not self.masks else "takes a mask only as one row per request"
        if shape.causal and not self.causal:
            return "takes no causal cap"
        if shape.paged and not self.paged:
            return "reads contiguous caches, not page pools"
        if shape.offset_lens and not self.windows:
            return "takes no window start with device key counts"
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str  # kernels/<module>.py: supports, run (and optionally offered, unmeasured, unavailable)
    cost_key: Optional[str]  # its name in path_table.MEASURED / CALL_COST for 16-bit caches (None: never timed)
    description: str
    caps: Capabilities
    # kernels the chooser stops offering together once one of them fails to build here
    group: str = ""
    # its name in path_table.MEASURED for fp8 latent caches (timed on fp8 rows: a kernel's
    # speed on them is not its speed on bf16 rows)
    fp8_cost_key: Optional[str] = None

    @property
    def replayable(self) -> bool:
        return self.caps.replayable

    def cost_key_for(self, shape: CallShape) -> Optional[str]:
        """The path table's name for this kernel's timings on calls like `shape`."""
        return self.fp8_cost_key if shape.kv_quant else self.cost_key

    def impl(self):
        return importlib.import_module(f"dcp_pass.runtime.decode.kernels.{self.module}")

    def supports(self, shape: CallShape) -> Optional[str]:
        return self.impl().supports(shape)

    def offered(self, shape: CallShape) -> Optional[str]:
        fn = getattr(self.impl(), "offered", None)
        return fn(shape) if fn is not None else None

    def unmeasured(self, shape: CallShape) -> bool:
        fn = getattr(self.impl(), "unmeasured", None)
        return fn(shape) if fn is not None else True

    def unavailable(self, device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """Why this kernel cannot run on `device` at all (with caches of `dtype`, when given)."""
        if self.caps.probed:
            return self.impl().unavailable(device, dtype)
        devices = self.caps.devices
        if devices is not None and torch.device(device).type not in devices:
            return f"needs {'/'.join(sorted(devices)).upper()} tensors, the model is on {torch.device(device).type}"
        return None

    def run(self, call, out=None, lse_out=None, **options):
        return self.impl().run(call, out, lse_out, **options)

    @property
    def build_errors(self) -> tuple:
        """What this kernel raises where the installed Triton cannot build or launch it."""
        return getattr(self.impl(), "BUILD_ERRORS", ())


_TRITON = Capabilities("triton", frozenset({MLA}), replayable=True, auto="always", auto_dtypes=FAST_DTYPES)


def _triton(**changes) -> Capabilities:
    """The Triton family's record: the "triton" backend, replayable, considered by "auto" for
    16-bit and fp8 caches (fp32 caches there are the reference's checking mode)."""
    return dataclasses.replace(_TRITON, **changes)


_GLUON = _triton(dtypes=frozenset({torch.bfloat16}), masks=frozenset({ROW_MASK}), switch="DCP_MLA_GLUON")
_GLUON_FP8 = _triton(dtypes=frozenset(), fp8_cache=True, masks=frozenset({ROW_MASK}), switch="DCP_MLA_GLUON")

# Registry order is the chooser's preference among kernels that tie (the role-split and
# lock-step Gluon forms share their timings) or where nothing measured decides.
KERNELS: Dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel(
            "gluon_seesaw",
            "gluon.seesaw",
            "seesaw",
            "seesaw one-read Gluon kernel: two warpgroups take turns scoring the tiles of a pair and each holds "
            "half the output (Hopper, bf16 512 + 64, a mask row per request, causal caps)",
            _GLUON,
            group="gluon",
        ),
        Kernel(
            "gluon_roles",
            "gluon.roles",
            "gluon",
            "role-split one-read Gluon kernel, a scorer and a loader warpgroup (Hopper, bf16 512 + 64, "
            "a mask row per request, causal caps; on Triton 3.6 the calls the seesaw form measured no faster on)",
            _GLUON,
            group="gluon",
        ),
        Kernel(
            "gluon_lock_step",
            "gluon.lock_step",
            "gluon",
            "lock-step one-read Gluon kernel (Hopper, bf16 512 + 64, a mask row per request, causal caps; the "
            "calls whose row strides the warp-specialised forms cannot copy, and Tritons other than 3.6)",
            _GLUON,
            group="gluon",
        ),
        Kernel(
            "gluon_fp8",
            "gluon.fp8",
            None,
            "role-split one-read Gluon kernel for an fp8 e4m3 latent cache, dequantised to bf16 by the loader "
            "warpgroup (Hopper, 512 + 64, a mask row per request, causal caps)",
            _GLUON_FP8,
            group="gluon_fp8",
            fp8_cost_key="gluon_fp8",
        ),
        Kernel(
            "gluon_fp8_narrow",
            "gluon.fp8_narrow",
            None,
            "narrow-row Gluon kernel for an fp8 e4m3 latent cache: keys as the wgmma's 64 rows, up to 16 query "
            "rows as its N, the e4m3 bytes converted to f16 exactly and the block scales applied to the small "
            "tiles (Hopper, 512 + 64, a mask row per request, causal caps)",
            _GLUON_FP8,
            group="gluon_fp8",
            fp8_cost_key="gluon_fp8_narrow",
        ),
        Kernel(
            "wide",
            "mla_wide",
            "wide",
            "two-GEMM Triton kernel for wide head blocks (contiguous caches)",
            _triton(fp8_cache=True, switch="DCP_MLA_WIDE", forceable=True),
            fp8_cost_key="wide_fp8",
        ),
        Kernel(
            "split",
            "mla_attention",
            "split",
            "split-KV flash-decoding Triton kernel (any Triton layout, paged too)",
            _triton(fp8_cache=True, paged=True),
            fp8_cost_key="split_fp8",
        ),
        Kernel(
            "per_head",
            "per_head_attention",
            "per_head",
            "split-KV flash-decoding Triton kernel for per-head keys and values (GQA / MHA): each K / V tile read "
            "once for every query head of its group",
            _triton(layouts=frozenset({PER_HEAD}), windows=True),
        ),
        Kernel(
            "flashinfer",
            "flashinfer_mla",
            "flashinfer",
            "FlashInfer's BatchMLAPagedAttentionWrapper: host-side plan, no additive masks",
            Capabilities(
                "flashinfer",
                frozenset({MLA}),
                dtypes=frozenset({torch.bfloat16, torch.float16}),
                masks=frozenset(),
                paged=True,
                lse_base="2",
                capturable=False,
                plans_on_host=True,
                probed=True,
                auto="measured",
                auto_dtypes=frozenset({torch.bfloat16, torch.float16}),
            ),
        ),
        Kernel(
            "torch",
            "reference",
            None,
            "torch reference (runs everywhere; the fp32 checking mode)",
            Capabilities(
                "torch",
                frozenset({MLA, PER_HEAD}),
                devices=None,
                dtypes=None,
                fp8_cache=True,
                paged=True,
                windows=True,
                auto="always",
                fallback=True,
            ),
        ),
    )
}

FALLBACK = next(k for k in KERNELS.values() if k.caps.fallback)  # runs every call


def backend_kernels(backend: str) -> Tuple[str, ...]:
    """The kernels of attention backend `backend`, in registry order."""
    return tuple(name for name, k in KERNELS.items() if k.caps.backend == backend)


def considered(request: Optional[str]) -> Tuple[str, ...]:
    """The kernels a chooser for `request` considers before it looks at a call, in registry
    order: "auto" (every kernel "auto" considers), None (the runtime features' default: those
    it considers always), or a backend's name (its kernels); the fallback last in every case."""
    if request == AUTO:
        names = tuple(n for n, k in KERNELS.items() if k.caps.auto)
    elif request is None:
        names = tuple(n for n, k in KERNELS.items() if k.caps.auto == "always")
    else:
        names = backend_kernels(request)
    return tuple(n for n in names if n != FALLBACK.name) + (FALLBACK.name,)


# what the "triton" backend chooses from
TRITON_KERNELS = backend_kernels("triton")

# group -> why its kernels are no longer offered in this process (they failed to build here);
# the same Triton on every rank makes the same decision
UNUSABLE: Dict[str, str] = {}


def switched_off(kernel: Kernel) -> Optional[str]:
    """Why an environment switch keeps the chooser from offering `kernel` (None: none does)."""
    if kernel.caps.switch and env.read(kernel.caps.switch) == "0":
        return f"{kernel.caps.switch}=0"
    return None


def forced() -> Optional[str]:
    """The kernel an environment switch sends every call to that it supports (its switch set to 1)."""
    return next((n for n, k in KERNELS.items() if k.caps.forceable and env.read(k.caps.switch) == "1"), None)


# --------------------------------------------------------------------------------------
# the chooser and its trace
# --------------------------------------------------------------------------------------
UNSUPPORTED = "unsupported"
SWITCHED_OFF = "switched off"
UNUSABLE_HERE = "unusable here"
NOT_OFFERED = "not offered"
SLOWER = "slower"
NOT_CHOSEN = "not chosen"


@dataclass(frozen=True)
class Rejection:
    kernel: str
    kind: str  # UNSUPPORTED, SWITCHED_OFF, UNUSABLE_HERE, NOT_OFFERED, SLOWER, NOT_CHOSEN
    reason: str

    @property
    def text(self) -> str:
        """The reason as the report reads it."""
        if self.kind == NOT_OFFERED:
            return f"not offered: {self.reason}"
        if self.kind == SWITCHED_OFF:
            return f"switched off by {self.reason}"
        if self.kind == UNUSABLE_HERE:
            return f"unusable here ({self.reason})"
        if self.kind == SLOWER:
            return f"slower {self.reason}"
        return self.reason


@dataclass(frozen=True)
class SelectionTrace:
    """One choice of a kernel: what was asked, for which call, the kernels considered (in
    registry order), why each of the others was rejected, the winner and why it won. Plain
    strings: a trace holds no tensors."""

    request: str  # "auto", a backend's name, "default" (None), or the kernel names asked for
    call: str  # the call's shape, CallShape.describe()
    candidates: Tuple[str, ...]
    rejections: Tuple[Rejection, ...]
    winner: str
    why: str

    @property
    def kernel(self) -> Kernel:
        return KERNELS[self.winner]

    def line(self) -> str:
        """One line: the winner, why, and the others grouped by their reason:
        ``torch (auto: fallback, no other kernel takes the call; gluon_seesaw, ...: needs CUDA tensors, ...)``."""
        groups: Dict[str, list] = {}
        for r in self.rejections:
            groups.setdefault(r.text, []).append(r.kernel)
        parts = [f"{self.request}: {self.why}"] + [f"{', '.join(names)}: {reason}" for reason, names in groups.items()]
        return f"{self.winner} ({'; '.join(parts)})"


def _screen(kernel: Kernel, shape: CallShape, request: Optional[str], devices: bool = True) -> Optional[Rejection]:
    """Why `kernel` is not a candidate for this call (None: it is), in the order the checks run:
    its capabilities (`devices`: its devices too), "auto"'s dtypes, this process's build
    failures, the environment switches, its module's supports and offered."""
    reason = kernel.caps.reason(shape, devices)
    if reason is not None:
        return Rejection(kernel.name, UNSUPPORTED, reason)
    if request == AUTO and kernel.caps.auto_dtypes is not None and shape.dtype not in kernel.caps.auto_dtypes:
        return Rejection(
            kernel.name,
            NOT_OFFERED,
            f"'auto' leaves {_dtype_name(shape.dtype)} caches to the reference (the checking mode)",
        )
    group = kernel.group or kernel.name
    if group in UNUSABLE:
        return Rejection(kernel.name, UNUSABLE_HERE, UNUSABLE[group])
    reason = switched_off(kernel)
    if reason is not None:
        return Rejection(kernel.name, SWITCHED_OFF, reason)
    reason = kernel.supports(shape)
    if reason is not None:
        return Rejection(kernel.name, UNSUPPORTED, reason)
    reason = kernel.offered(shape)
    if reason is not None:
        return Rejection(kernel.name, NOT_OFFERED, reason)
    return None


def _select(
    shape: CallShape, names: Sequence[str], request: Optional[str], label: str, devices: bool = True
) -> SelectionTrace:
    from .path_table import fastest

    pool = [KERNELS[n] for n in KERNELS if n in names and n != FALLBACK.name]
    rejections: list = []
    cands: list = []
    for k in pool:
        rejection = _screen(k, shape, request, devices)
        if rejection is None:
            cands.append(k)
        else:
            rejections.append(rejection)
    candidates = tuple(k.name for k in pool) + ((FALLBACK.name,) if FALLBACK.name in names else ())

    def done(winner: Kernel, why: str, losers: Iterable[Rejection] = ()) -> SelectionTrace:
        rest = tuple(rejections) + tuple(losers)
        if winner is not FALLBACK and FALLBACK.name in names:
            rest += (Rejection(FALLBACK.name, NOT_CHOSEN, "fallback"),)
        return SelectionTrace(label, shape.describe(), candidates, rest, winner.name, why)

    name = forced()
    if name is not None and name in names:
        k = KERNELS[name]
        if k.caps.reason(shape, devices) is None and k.supports(shape) is None:
            return done(
                k,
                f"forced by {k.caps.switch}=1",
                [Rejection(c.name, NOT_CHOSEN, f"{k.caps.switch}=1") for c in cands if c is not k],
            )
    keys = tuple(dict.fromkeys(k.cost_key_for(shape) for k in cands if k.cost_key_for(shape)))
    best = fastest(shape.rows, shape.batch, shape.keys, keys, shape.kind) if len(keys) >= 2 else None
    if best is not None:
        winner = next(k for k in cands if k.cost_key_for(shape) == best)
        where = f"{shape.rows} rows, B={shape.batch}, {shape.keys} keys, {shape.kind}"

        def loser(k: Kernel) -> Rejection:
            key = k.cost_key_for(shape)
            if key == best:  # the same timings (the role-split and lock-step forms)
                return Rejection(k.name, NOT_CHOSEN, f"timed as {winner.name}, which comes first")
            return Rejection(k.name, SLOWER, "by the path table") if key else Rejection(k.name, NOT_CHOSEN, "not timed")

        return done(winner, f"fastest in the path table nearest {where}", [loser(k) for k in cands if k is not winner])
    first = next((k for k in cands if k.unmeasured(shape)), None)
    if first is not None:
        why = "the only candidate" if len(cands) == 1 else "first in registry order where nothing measured decides"
        at = cands.index(first)
        return done(
            first,
            why,
            [
                Rejection(
                    k.name,
                    NOT_CHOSEN,
                    "taken only where measured faster" if i < at else f"after {first.name} in registry order",
                )
                for i, k in enumerate(cands)
                if k is not first
            ],
        )
    losers = [Rejection(k.name, NOT_CHOSEN, "taken only where measured faster") for k in cands]
    if FALLBACK.name not in names:
        return SelectionTrace(label, shape.describe(), candidates, tuple(rejections) + tuple(losers), "", "none")
    why = "runs every call" if len(names) == 1 else "fallback, no other kernel takes the call"
    return done(FALLBACK, why, losers)


_MEMO: "OrderedDict[Hashable, SelectionTrace]" = OrderedDict()
_MEMO_SIZE = 512


def select(shape: CallShape, request: Optional[str] = AUTO) -> SelectionTrace:
    """The kernel that runs a call of this shape for `request` ("auto", a backend's name, or
    None: the runtime features' default), with the trace of the choice.

    Remembered per shape, request, environment switches, unusable groups and path table: the
    op chooses on every call, and a decode step's calls repeat their shapes.
    """
    from . import path_table

    switches = tuple(env.read(v) for v in dict.fromkeys(k.caps.switch for k in KERNELS.values() if k.caps.switch))
    key = (shape, request, switches, tuple(UNUSABLE.items()), id(path_table.MEASURED))
    trace = _MEMO.get(key)
    if trace is None:
        trace = _select(shape, considered(request), request, "default" if request is None else request)
        _MEMO[key] = trace
        if len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return trace


def select_named(shape: CallShape, names: Sequence[str]) -> SelectionTrace:
    """The first of the kernels asked for by name (a kernel's name, or a config's kernels) that
    can run the call (its module's supports only), else the fallback."""
    rejections: list = []
    for name in names:
        reason = KERNELS[name].supports(shape)
        if reason is None:
            before = ", ".join(names[: names.index(name)])
            why = f"asked for, after {before}" if before else "asked for by name"
            return SelectionTrace(" / ".join(names), shape.describe(), tuple(names), tuple(rejections), name, why)
        rejections.append(Rejection(name, UNSUPPORTED, reason))
    return SelectionTrace(
        " / ".join(names),
        shape.describe(),
        tuple(names) + (FALLBACK.name,),
        tuple(rejections),
        FALLBACK.name,
        "fallback, no kernel asked for takes the call",
    )


def candidates(shape: CallShape, names: Iterable[str]) -> list:
    """The kernels of `names` the chooser considers for `shape`, in registry order (judged as
    in :func:`choose`)."""
    names = tuple(names)
    return [
        KERNELS[n]
        for n in KERNELS
        if n in names and n != FALLBACK.name and _screen(KERNELS[n], shape, None, devices=False) is None
    ]


def choose(shape: CallShape, names: Sequence[str]) -> Optional[Kernel]:
    """The kernel among `names` that :func:`select`'s rules pick for `shape` (a forced one, the
    fastest measured, the first that takes unmeasured calls), or None when none takes it
    (the fallback only when it is one of `names`). Kernels asked for by name are judged where
    the call is (their supports decide the device: Triton's interpreter runs CPU calls)."""
    trace = _select(shape, tuple(names), None, " / ".join(names), devices=False)
    return KERNELS[trace.winner] if trace.winner else None


# --------------------------------------------------------------------------------------
# the most recent choice per call site, for the report
# --------------------------------------------------------------------------------------
# a site -> the trace of its most recent choice. A site is a layer of a compiled model (the
# per-call feeder collects the choices of one graph call, whose attention calls run in its
# layers' order, and keeps them under its layers' sites), else what was asked and the call.
# Bounded, plain strings only: the oldest sites go first.
LAST_SELECTIONS: "OrderedDict[Hashable, SelectionTrace]" = OrderedDict()
_SITES_SIZE = 4096
_COLLECTING: list = []  # the collectors of the graph calls running now (innermost last)


def _keep(site: Hashable, trace: SelectionTrace) -> None:
    if LAST_SELECTIONS.get(site) is not trace:
        LAST_SELECTIONS[site] = trace
        LAST_SELECTIONS.move_to_end(site)
        if len(LAST_SELECTIONS) > _SITES_SIZE:
            LAST_SELECTIONS.popitem(last=False)


def record(trace: SelectionTrace) -> None:
    """A call ran on `trace`'s winner: the running graph call collects it, else it is kept
    under what was asked and the call's description."""
    if _COLLECTING:
        _COLLECTING[-1].append(trace)
    else:
        _keep((trace.request, trace.call), trace)


@contextmanager
def collecting(sites: Sequence[Hashable]) -> Iterator[None]:
    """Around one call of a compiled graph whose attention calls are `sites`' (its rewritten
    layers, in the order they run): their choices are kept under those sites. A call whose
    attention ran no chooser (replayed launches, a CUDA graph) or a different number of times
    keeps the earlier choices."""
    traces: list = []
    _COLLECTING.append(traces)
    try:
        yield
    finally:
        _COLLECTING.pop()
    if traces and len(traces) == len(sites):
        for site, trace in zip(sites, traces):
            _keep(site, trace)


def trace_for(site: Hashable) -> Optional[SelectionTrace]:
    """The most recent choice of `site` (None: no call of it has run)."""
    return LAST_SELECTIONS.get(site)


def mark_unusable(kernel: Kernel, error: BaseException) -> None:
    """`kernel` failed to build or launch here: the chooser stops offering its group, with a warning."""
    reason = f"{type(error).__name__}: {str(error).splitlines()[-1] if str(error) else ''}"
    UNUSABLE[kernel.group or kernel.name] = reason
    try:
        import triton

        version = triton.__version__
    except Exception:  # pragma: no cover
        version = "?"
    warnings.warn(
        f"dcp_pass: the {kernel.name} attention kernel is not usable with Triton {version} ({reason}); "
        f"choosing among the others instead",
        RuntimeWarning,
        stacklevel=3,
    )
