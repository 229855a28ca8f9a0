"""The registry of shard-local attention kernels, and the one chooser that reads it.

Every kernel is an entry of :data:`KERNELS` that names its module; the module says, from a
call's :class:`~dcp_pass.runtime.decode.call.CallShape`, whether it can run the call and,
if so, whether the chooser should consider it:

* ``supports(shape) -> None | reason``: it can run the call (else why not);
* ``offered(shape) -> None | reason`` (optional): the chooser considers it for this call
  (a kernel can run calls it was never measured on, or is slower on by design);
* ``unmeasured(shape) -> bool`` (optional, default True): whether the chooser takes it
  where no measured shape decides;
* ``run(call, out=None, lse_out=None, **options)``: the launch (options: ``num_splits``,
  ``config`` where the kernel has them).

:func:`choose` picks among the kernels of a backend (``backends.py`` names the families:
"triton" is the Gluon forms, the two-GEMM and the split kernel for MLA calls, the per-head kernel for
GQA / MHA calls): those that support the
call and are offered, the fastest measured nearest its shape (``path_table.py``, each
entry's ``cost_key``), else the first, in registry order, that takes unmeasured calls.
The ``DCP_MLA_WIDE`` / ``DCP_MLA_GLUON`` switches (``dcp_pass/env.py``) turn kernels off or
force one.

A new kernel is one module with those functions, one entry here, its tests (and, to be
chosen by measurement, its timings in ``path_table.py``). Kernel modules are imported when
first used: importing the registry (options validation) imports no Triton.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

from dcp_pass import env
from dcp_pass.runtime.decode.call import CallShape

__all__ = ["Kernel", "KERNELS", "TRITON_KERNELS", "UNUSABLE", "choose", "switched_off", "forced"]


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str  # kernels/<module>.py: supports, run (and optionally offered, unmeasured)
    cost_key: Optional[str]  # its name in path_table.MEASURED / CALL_COST for 16-bit caches (None: never timed)
    description: str
    # True: its calls only allocate, take views and launch Triton kernels through
    # kernels.common.launch, so the op may replay them (runtime/decode/replay.py). A kernel
    # that launches anything else (a C++ extension, a library call) must stay False: a
    # replay would silently skip what the recording cannot see.
    replayable: bool = False
    # kernels the chooser stops offering together once one of them fails to build here
    group: str = ""
    # its name in path_table.MEASURED for fp8 latent caches (timed on fp8 rows: a kernel's
    # speed on them is not its speed on bf16 rows)
    fp8_cost_key: Optional[str] = None

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

    def run(self, call, out=None, lse_out=None, **options):
        return self.impl().run(call, out, lse_out, **options)

    @property
    def build_errors(self) -> tuple:
        """What this kernel raises where the installed Triton cannot build or launch it."""
        return getattr(self.impl(), "BUILD_ERRORS", ())


# Registry order is the chooser's preference among kernels that tie (the role-split and
# lock-step Gluon forms share their timings) or where nothing measured decides.
KERNELS: Dict[str, Kernel] = {k.name: k for k in (
    Kernel("gluon_seesaw", "mla_gluon_seesaw", "seesaw",
           "seesaw one-read Gluon kernel: two warpgroups take turns scoring the tiles of a pair and each holds "
           "half the output (Hopper, bf16 512 + 64, a mask row per request, causal caps)", replayable=True,
           group="gluon"),
    Kernel("gluon_roles", "mla_gluon_roles", "gluon",
           "role-split one-read Gluon kernel, a scorer and a loader warpgroup (Hopper, bf16 512 + 64, "
           "a mask row per request, causal caps; on Triton 3.6 the calls the seesaw form measured no faster on)",
           replayable=True, group="gluon"),
    Kernel("gluon_lock_step", "mla_gluon", "gluon",
           "lock-step one-read Gluon kernel (Hopper, bf16 512 + 64, a mask row per request, causal caps; the "
           "calls whose row strides the warp-specialised forms cannot copy, and Tritons other than 3.6)",
           replayable=True, group="gluon"),
    Kernel("gluon_fp8", "mla_gluon_fp8", None,
           "role-split one-read Gluon kernel for an fp8 e4m3 latent cache, dequantised to bf16 by the loader "
           "warpgroup (Hopper, 512 + 64, a mask row per request, causal caps)", replayable=True, group="gluon_fp8",
           fp8_cost_key="gluon_fp8"),
    Kernel("gluon_fp8_narrow", "mla_gluon_fp8_narrow", None,
           "narrow-row Gluon kernel for an fp8 e4m3 latent cache: keys as the wgmma's 64 rows, up to 16 query "
           "rows as its N, the e4m3 bytes converted to f16 exactly and the block scales applied to the small "
           "tiles (Hopper, 512 + 64, a mask row per request, causal caps)", replayable=True, group="gluon_fp8",
           fp8_cost_key="gluon_fp8_narrow"),
    Kernel("wide", "mla_wide", "wide", "two-GEMM Triton kernel for wide head blocks (contiguous caches)",
           replayable=True, fp8_cost_key="wide_fp8"),
    Kernel("split", "mla_attention", "split", "split-KV flash-decoding Triton kernel (any Triton layout, paged too)",
           replayable=True, fp8_cost_key="split_fp8"),
    Kernel("per_head", "per_head_attention", "per_head",
           "split-KV flash-decoding Triton kernel for per-head keys and values (GQA / MHA): each K / V tile read "
           "once for every query head of its group", replayable=True),
    Kernel("flashinfer", "flashinfer_mla", "flashinfer",
           "FlashInfer's BatchMLAPagedAttentionWrapper: host-side plan, no additive masks"),
    Kernel("torch", "reference", None, "torch reference (runs everywhere; the fp32 checking mode)"),
)}

# what the "triton" backend chooses from
TRITON_KERNELS = ("gluon_seesaw", "gluon_roles", "gluon_lock_step", "gluon_fp8", "gluon_fp8_narrow", "wide", "split",
                  "per_head")

# group -> why its kernels are no longer offered in this process (they failed to build here);
# the same Triton on every rank makes the same decision
UNUSABLE: Dict[str, str] = {}


def switched_off(kernel: Kernel) -> Optional[str]:
    """Why an environment switch keeps the chooser from offering `kernel` (None: none does)."""
    if kernel.name == "wide" and env.mla_wide() == "0":
        return "DCP_MLA_WIDE=0"
    if kernel.group in ("gluon", "gluon_fp8") and env.mla_gluon() == "0":
        return "DCP_MLA_GLUON=0"
    return None


def forced() -> Optional[str]:
    """The kernel an environment switch sends every call to that it supports (DCP_MLA_WIDE=1)."""
    return "wide" if env.mla_wide() == "1" else None


def candidates(shape: CallShape, names: Iterable[str]) -> list:
    """The kernels of `names` the chooser considers for `shape`, in registry order."""
    out = []
    for name in KERNELS:
        if name not in names:
            continue
        k = KERNELS[name]
        if k.group in UNUSABLE or switched_off(k) is not None:
            continue
        if k.supports(shape) is None and k.offered(shape) is None:
            out.append(k)
    return out


def choose(shape: CallShape, names: Sequence[str]) -> Optional[Kernel]:
    """The kernel of `names` that runs a call of this shape, or None when none takes it.

    A forced kernel (DCP_MLA_WIDE=1) wherever it can run; else, among the candidates, the
    fastest at the measured shape nearest this one for this kind of call (path_table.fastest
    over their cost keys for this cache dtype, ties to registry order); where no measured
    shape decides, the first candidate that takes unmeasured calls.
    """
    from .path_table import fastest

    name = forced()
    if name in names and KERNELS[name].supports(shape) is None:
        return KERNELS[name]
    cands = candidates(shape, names)
    keys = tuple(dict.fromkeys(k.cost_key_for(shape) for k in cands if k.cost_key_for(shape)))
    best = fastest(shape.rows, shape.batch, shape.keys, keys, shape.kind) if len(keys) >= 2 else None
    if best is not None:
        return next(k for k in cands if k.cost_key_for(shape) == best)
    return next((k for k in cands if k.unmeasured(shape)), None)


def mark_unusable(kernel: Kernel, error: BaseException) -> None:
    """`kernel` failed to build or launch here: the chooser stops offering its group, with a warning."""
    reason = f"{type(error).__name__}: {str(error).splitlines()[-1] if str(error) else ''}"
    UNUSABLE[kernel.group or kernel.name] = reason
    try:
        import triton

        version = triton.__version__
    except Exception:  # pragma: no cover
        version = "?"
    warnings.warn(f"dcp_pass: the {kernel.name} attention kernel is not usable with Triton {version} ({reason}); "
                  f"choosing among the others instead", RuntimeWarning, stacklevel=3)

