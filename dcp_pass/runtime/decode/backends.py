"""The comm backends and attention backends of DCP, one table each.

Every chooser reads these tables: option validation (dcp_pass/options.py), plan
resolution (dcp_pass/backend.py), the rewrite's exchange (rewrites/attention.py),
the shard-local attention op (runtime/decode/ops.py), extend (runtime/compose/extend.py),
speculative verification (runtime/compose/speculative.py) and the benchmarks.

* ``COMM_BACKENDS``: name -> :class:`CommBackend` (head-sharded exchange, the method
  the replicated-heads exchange uses, what keeps it from running on given platform
  facts, description). Insertion order is the default's preference order. Defined in
  runtime/decode/comm.py beside the exchanges it names, re-exported here.
* ``ATTENTION_BACKENDS``: the names option 'attn_backend' takes -> :class:`AttentionBackend`
  (availability check, the kernels its chooser picks from, native LSE base, whether it runs
  under CUDA-graph capture and takes masks). ``"auto"`` is not an entry: it is resolved per
  call by :func:`resolve_attention_backend`. The kernels themselves are the registry's
  (kernels/registry.py: what each supports, what it costs, one chooser); :func:`attend` runs
  an :class:`~dcp_pass.runtime.decode.call.AttentionCall` on the kernel chosen for it.

The runtime never imports the rewrites: this module imports only runtime code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.comm import COMM_BACKENDS, DEFAULT_COMM_PREFERENCE, CommBackend, comm_backend_blockers  # noqa: F401
from dcp_pass.runtime.decode.kernels.registry import KERNELS, TRITON_KERNELS, Kernel, choose, mark_unusable

__all__ = [
    "CommBackend",
    "AttentionBackend",
    "AttentionBackendUnavailable",
    "COMM_BACKENDS",
    "ATTENTION_BACKENDS",
    "AUTO",
    "attend",
    "attend_with_kernel",
    "attention_backend_names",
    "attention_lse_base",
    "auto_kernels",
    "choose_kernel",
    "comm_backend_blockers",
    "resolve_attention_backend",
]


# --------------------------------------------------------------------------------------
# attention backends

AUTO = "auto"


class AttentionBackendUnavailable(ValueError):
    """An attention backend was asked for where it cannot run."""


@dataclass(frozen=True)
class AttentionBackend:
    """A name option 'attn_backend' takes: the kernels its chooser picks from
    (kernels/registry.py names, in preference order), with what the pass needs to know."""

    name: str
    # (device, dtype) -> None when it can run there, else the reason it cannot
    available: Callable[[torch.device, Optional[torch.dtype]], Optional[str]]
    kernels: Tuple[str, ...]
    lse_base: str  # the base its LSE comes in natively; the plan's default LSE base
    description: str
    # False: it cannot run inside CUDA-graph capture (the pass turns cudagraphs "auto" off)
    capturable: bool = True
    # True: it plans on the host from the key counts, so it runs inside capture only in a graph
    # whose count the backend holds and re-plans before each call (runtime/decode/step_count.py)
    plans_on_host: bool = False
    # False: it refuses an additive score mask (the pass refuses masked layers at compile)
    takes_mask: bool = True


def _triton_available(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs CUDA tensors, the model is on {device.type}"
    return None


def _torch_available(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    return None


def _flashinfer_available(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    from dcp_pass.runtime.decode.kernels.flashinfer_mla import flashinfer_unavailable

    return flashinfer_unavailable(device, dtype)


# Insertion order gives options.ATTN_BACKENDS (after "auto").
ATTENTION_BACKENDS: Dict[str, AttentionBackend] = {
    "triton": AttentionBackend(
        "triton", _triton_available, TRITON_KERNELS, "e",
        "the fastest Triton-family kernel for the call (MLA: Gluon, two-GEMM or split-KV; per-head keys and values: "
        "the per-head split-KV kernel; kernels/registry.py)",
    ),
    "flashinfer": AttentionBackend(
        "flashinfer", _flashinfer_available, ("flashinfer",), "2",
        "FlashInfer's BatchMLAPagedAttentionWrapper (runtime/decode/kernels/flashinfer_mla.py): "
        "host-side plan (captured in int-position decode graphs), no additive masks",
        capturable=False, plans_on_host=True, takes_mask=False,
    ),
    "torch": AttentionBackend(
        "torch", _torch_available, ("torch",), "e",
        "torch reference (runs everywhere; the fp32 checking mode)",
    ),
}

FALLBACK_ATTENTION = "torch"  # runs everywhere


def attention_backend_names() -> tuple:
    """Every name option 'attn_backend' accepts: "auto" then the table's names."""
    return (AUTO,) + tuple(ATTENTION_BACKENDS)


def _auto_choice(device: torch.device, dtype: Optional[torch.dtype], fp32_reference: bool) -> str:
    # fp32 caches are a checking mode: the Triton kernel runs them with IEEE fp32 dots on
    # tiles shrunk to fit shared memory (72.7 ms vs 6.5 ms per step for the 4-layer
    # V3-sized model, docs/performance.md), the reference's cuBLAS GEMMs are far faster
    if torch.device(device).type == "cuda" and not (fp32_reference and dtype == torch.float32):
        return "triton"
    return "torch"


def auto_kernels(entry: AttentionBackend) -> Tuple[str, ...]:
    """The kernels "auto" chooses from when it resolved to `entry`: on the Triton backend,
    FlashInfer's too (the registry offers it only where it plans without a sync and measured
    faster: kernels/flashinfer_mla.py offered / unmeasured, path_table.py)."""
    return entry.kernels + ("flashinfer",) if entry.name == "triton" else entry.kernels


def attention_lse_base(requested: str) -> str:
    """The native LSE base of `requested` ("auto": that of every backend auto can pick)."""
    if requested == AUTO:
        bases = {ATTENTION_BACKENDS[n].lse_base for n in ("triton", "torch")}
        assert len(bases) == 1, bases
        return bases.pop()
    return ATTENTION_BACKENDS[requested].lse_base


def resolve_attention_backend(
    requested: Optional[str],
    device: torch.device,
    dtype: Optional[torch.dtype] = None,
    *,
    strict: bool = True,
) -> AttentionBackend:
    """The attention backend that runs a call on `device` with cache dtype `dtype`.

    * ``"auto"``: Triton on CUDA for 16-bit caches, the torch reference for fp32 caches
      (a checking mode) and off CUDA: what the compiled op runs.
    * ``None``: Triton on CUDA whatever the dtype, the reference elsewhere: the default
      of the runtime features (extend, speculative verification), which have no fp32
      checking mode.
    * a table name: that backend; where it cannot run (or for an unknown name),
      ``strict`` raises :class:`AttentionBackendUnavailable` saying why, otherwise the
      reference runs.
    """
    if requested is None or requested == AUTO:
        return ATTENTION_BACKENDS[_auto_choice(device, dtype, fp32_reference=requested == AUTO)]
    if requested not in ATTENTION_BACKENDS:
        if not strict:
            return ATTENTION_BACKENDS[FALLBACK_ATTENTION]
        raise AttentionBackendUnavailable(
            f"unknown attention backend {requested!r}; valid names are "
            f"{', '.join(map(repr, attention_backend_names()))} (or None)")
    entry = ATTENTION_BACKENDS[requested]
    reason = entry.available(torch.device(device), dtype)
    if reason is None:
        return entry
    if strict:
        raise AttentionBackendUnavailable(f"attention backend {requested!r} {reason}")
    return ATTENTION_BACKENDS[FALLBACK_ATTENTION]


def choose_kernel(call: AttentionCall, backend: Optional[str] = AUTO, *, strict: bool = True,
                  config=None) -> Kernel:
    """The kernel that runs `call` for `backend`.

    `backend`: a name of :data:`ATTENTION_BACKENDS`, "auto" or None (as in
    :func:`resolve_attention_backend`: the backend's kernels, chosen by the registry, the
    torch reference where none takes the call), or a kernel name of ``registry.KERNELS``
    (that kernel). ``config`` (a kernel's config: MLAKernelConfig, WideConfig, GluonConfig)
    names the kernels it configures instead. A kernel or backend that cannot run the call
    raises :class:`AttentionBackendUnavailable` when ``strict``, else the reference runs.
    """
    shape = call.shape
    if config is not None or backend in KERNELS:
        names = tuple(config.kernels) if config is not None else (backend,)
        reasons = []
        for name in names:
            reason = KERNELS[name].supports(shape)
            if reason is None:
                return KERNELS[name]
            reasons.append(f"{name}: {reason}")
        if strict:
            raise AttentionBackendUnavailable(f"attention kernel {' / '.join(names)} cannot run this call "
                                              f"({shape.describe()}): " + "; ".join(reasons))
        return KERNELS[FALLBACK_ATTENTION]
    entry = resolve_attention_backend(backend, call.kv.device, call.kv.dtype, strict=strict)
    kernel = choose(shape, auto_kernels(entry) if backend == AUTO else entry.kernels)
    return kernel if kernel is not None else KERNELS[FALLBACK_ATTENTION]


def attend_with_kernel(call: AttentionCall, backend: Optional[str] = AUTO, out=None, lse_out=None, *,
                       strict: bool = True, config=None, num_splits: Optional[int] = None):
    """:func:`attend`, and the kernel that ran: ``((out, lse), kernel)``."""
    options = {k: v for k, v in (("config", config), ("num_splits", num_splits)) if v is not None}
    kernel = choose_kernel(call, backend, strict=strict, config=config)
    chosen = config is None and backend not in KERNELS
    while True:
        try:
            return kernel.run(call, out, lse_out, **options), kernel
        except Exception as e:  # noqa: BLE001 - a kernel this Triton cannot build: choose again
            if not (chosen and kernel.build_errors and isinstance(e, kernel.build_errors)):
                raise
            mark_unusable(kernel, e)
            kernel = choose_kernel(call, backend, strict=strict)


def attend(call: AttentionCall, backend: Optional[str] = AUTO, out=None, lse_out=None, *, strict: bool = True,
           config=None, num_splits: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shard-local attention of `call` on the kernel :func:`choose_kernel` picks:
    ``(out [B,S,H,v_dim] in q's dtype, lse [B,S,H])`` in the call's LSE base; ``out`` /
    ``lse_out`` receive them when given. A kernel the chooser picked that this Triton cannot
    build is dropped for the process (with a warning) and the chooser picks again."""
    return attend_with_kernel(call, backend, out, lse_out, strict=strict, config=config, num_splits=num_splits)[0]
