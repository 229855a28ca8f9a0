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
  (a name and a description; its kernels, availability, native LSE base, whether it runs
  under CUDA-graph capture and takes masks are read from the kernels' registry entries,
  which name their backend). ``"auto"`` is not an entry: the registry's chooser considers
  the kernels whose entries say so. The kernels themselves are the registry's
  (kernels/registry.py: what each takes, what it costs, one chooser with a trace);
  :func:`attend` runs an :class:`~dcp_pass.runtime.decode.call.AttentionCall` on the kernel
  chosen for it and keeps the choice's trace for the report.

The runtime never imports the rewrites: this module imports only runtime code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.comm import COMM_BACKENDS, DEFAULT_COMM_PREFERENCE, CommBackend, comm_backend_blockers  # noqa: F401
from dcp_pass.runtime.decode.kernels.registry import (
    FALLBACK,
    KERNELS,
    Kernel,
    SelectionTrace,
    backend_kernels,
    considered,
    mark_unusable,
    record,
    select,
    select_named,
)

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
    "choose_kernel",
    "fp8_backends",
    "select_kernel",
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
    """A name option 'attn_backend' takes, and what the pass needs to know of it: all read from
    its kernels' registry entries (kernels/registry.py), which name the backend they belong to."""

    name: str
    description: str

    @property
    def kernels(self) -> Tuple[str, ...]:
        """The kernels its chooser picks from, in registry order."""
        return backend_kernels(self.name)

    def _one(self, field: str):
        values = {getattr(KERNELS[n].caps, field) for n in self.kernels}
        assert len(values) == 1, (self.name, field, values)
        return values.pop()

    @property
    def lse_base(self) -> str:
        """The base its LSE comes in natively; the plan's default LSE base."""
        return self._one("lse_base")

    @property
    def capturable(self) -> bool:
        """False: it cannot run inside CUDA-graph capture (the pass turns cudagraphs "auto" off)."""
        return all(KERNELS[n].caps.capturable for n in self.kernels)

    @property
    def plans_on_host(self) -> bool:
        """True: it plans on the host from the key counts, so it runs inside capture only in a
        graph whose count the backend holds and re-plans before each call (runtime/decode/step_count.py)."""
        return any(KERNELS[n].caps.plans_on_host for n in self.kernels)

    @property
    def takes_mask(self) -> bool:
        """False: it refuses an additive score mask (the pass refuses masked layers at compile)."""
        return any(KERNELS[n].caps.masks for n in self.kernels)

    def available(self, device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """None when one of its kernels can run on `device` (with caches of `dtype`), else why not."""
        reasons = [KERNELS[n].unavailable(device, dtype) for n in self.kernels]
        return None if any(r is None for r in reasons) else reasons[0]


# Insertion order gives options.ATTN_BACKENDS (after "auto").
ATTENTION_BACKENDS: Dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(
            "triton",
            "the fastest Triton-family kernel for the call (MLA: Gluon, two-GEMM or split-KV; "
            "per-head keys and values: the per-head split-KV kernel; kernels/registry.py)",
        ),
        AttentionBackend(
            "flashinfer",
            "FlashInfer's BatchMLAPagedAttentionWrapper (runtime/decode/kernels/"
            "flashinfer_mla.py): host-side plan (captured in int-position decode graphs), no "
            "additive masks",
        ),
        AttentionBackend("torch", "torch reference (runs everywhere; the fp32 checking mode)"),
    )
}


def attention_backend_names() -> tuple:
    """Every name option 'attn_backend' accepts: "auto" then the table's names."""
    return (AUTO,) + tuple(ATTENTION_BACKENDS)


def fp8_backends() -> Tuple[str, ...]:
    """The backends with a kernel that reads an fp8 latent cache (option 'kv_cache_dtype')."""
    return tuple(b for b in ATTENTION_BACKENDS if any(KERNELS[n].caps.fp8_cache for n in backend_kernels(b)))


def attention_lse_base(requested: str) -> str:
    """The native LSE base of `requested` ("auto": that of every kernel "auto" considers always;
    those it takes only where measured faster convert theirs)."""
    if requested == AUTO:
        bases = {KERNELS[n].caps.lse_base for n in considered(None)}
        assert len(bases) == 1, bases
        return bases.pop()
    return ATTENTION_BACKENDS[requested].lse_base


def _auto_backend(device: torch.device, dtype: Optional[torch.dtype], requested: Optional[str]) -> AttentionBackend:
    """The backend of the first kernel "auto" (or None) considers that can run on `device`
    with caches of `dtype` ("auto" only: one it considers for that dtype)."""
    device_type = torch.device(device).type
    for name in considered(None):
        caps = KERNELS[name].caps
        if caps.devices is not None and device_type not in caps.devices:
            continue
        if requested == AUTO and dtype is not None and caps.auto_dtypes is not None and dtype not in caps.auto_dtypes:
            continue
        return ATTENTION_BACKENDS[caps.backend]
    return ATTENTION_BACKENDS[FALLBACK.caps.backend]


def resolve_attention_backend(
    requested: Optional[str],
    device: torch.device,
    dtype: Optional[torch.dtype] = None,
    *,
    strict: bool = True,
) -> AttentionBackend:
    """The attention backend that runs a call on `device` with cache dtype `dtype`.

    * ``"auto"``: the backend of the first kernel "auto" considers for the device and dtype
      (Triton on CUDA for 16-bit and fp8 caches, the torch reference for fp32 caches, a
      checking mode, and off CUDA): what the compiled op runs.
    * ``None``: the same whatever the dtype (Triton on CUDA, the reference elsewhere): the
      default of the runtime features (extend, speculative verification), which have no fp32
      checking mode.
    * a table name: that backend; where it cannot run (or for an unknown name),
      ``strict`` raises :class:`AttentionBackendUnavailable` saying why, otherwise the
      reference runs.
    """
    if requested is None or requested == AUTO:
        return _auto_backend(device, dtype, requested)
    if requested not in ATTENTION_BACKENDS:
        if not strict:
            return ATTENTION_BACKENDS[FALLBACK.caps.backend]
        raise AttentionBackendUnavailable(
            f"unknown attention backend {requested!r}; valid names are "
            f"{', '.join(map(repr, attention_backend_names()))} (or None)"
        )
    entry = ATTENTION_BACKENDS[requested]
    reason = entry.available(torch.device(device), dtype)
    if reason is None:
        return entry
    if strict:
        raise AttentionBackendUnavailable(f"attention backend {requested!r} {reason}")
    return ATTENTION_BACKENDS[FALLBACK.caps.backend]


def select_kernel(
    call: AttentionCall, backend: Optional[str] = AUTO, *, strict: bool = True, config=None
) -> SelectionTrace:
    """The choice of the kernel that runs `call` for `backend`, with its trace.

    `backend`: a name of :data:`ATTENTION_BACKENDS`, "auto" or None (the registry's chooser,
    :func:`registry.select`, over the kernels it considers: a named backend that cannot run on
    the call's device runs the reference), or a kernel name of ``registry.KERNELS`` (that
    kernel). ``config`` (a kernel's config: MLAKernelConfig, WideConfig, GluonConfig) names the
    kernels it configures instead. A kernel or backend that cannot run the call raises
    :class:`AttentionBackendUnavailable` when ``strict``, else the reference runs.
    """
    shape = call.shape
    if config is not None or backend in KERNELS:
        names = tuple(config.kernels) if config is not None else (backend,)
        trace = select_named(shape, names)
        if strict and trace.winner not in names:
            raise AttentionBackendUnavailable(
                f"attention kernel {' / '.join(names)} cannot run this call ({shape.describe()}): "
                + "; ".join(f"{r.kernel}: {r.reason}" for r in trace.rejections)
            )
        return trace
    if backend is not None and backend != AUTO:
        entry = resolve_attention_backend(backend, call.kv.device, call.kv.dtype, strict=strict)
        backend = entry.name
    return select(shape, backend)


def choose_kernel(call: AttentionCall, backend: Optional[str] = AUTO, *, strict: bool = True, config=None) -> Kernel:
    """The kernel :func:`select_kernel` picks for `call`."""
    return select_kernel(call, backend, strict=strict, config=config).kernel


def attend_with_kernel(
    call: AttentionCall,
    backend: Optional[str] = AUTO,
    out=None,
    lse_out=None,
    *,
    strict: bool = True,
    config=None,
    num_splits: Optional[int] = None,
):
    """:func:`attend`, and the kernel that ran: ``((out, lse), kernel)``. The choice's trace is
    kept as the most recent of the call's site (registry.record: the layer, in a compiled graph)."""
    options = {k: v for k, v in (("config", config), ("num_splits", num_splits)) if v is not None}
    trace = select_kernel(call, backend, strict=strict, config=config)
    chosen = config is None and backend not in KERNELS
    while True:
        kernel = trace.kernel
        try:
            result = kernel.run(call, out, lse_out, **options)
        except Exception as e:  # noqa: BLE001 - a kernel this Triton cannot build: choose again
            if not (chosen and kernel.build_errors and isinstance(e, kernel.build_errors)):
                raise
            mark_unusable(kernel, e)
            trace = select_kernel(call, backend, strict=strict)
            continue
        record(trace)
        return result, kernel


def attend(
    call: AttentionCall,
    backend: Optional[str] = AUTO,
    out=None,
    lse_out=None,
    *,
    strict: bool = True,
    config=None,
    num_splits: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shard-local attention of `call` on the kernel :func:`select_kernel` picks:
    ``(out [B,S,H,v_dim] in q's dtype, lse [B,S,H])`` in the call's LSE base; ``out`` /
    ``lse_out`` receive them when given. A kernel the chooser picked that this Triton cannot
    build is dropped for the process (with a warning) and the chooser picks again."""
    return attend_with_kernel(call, backend, out, lse_out, strict=strict, config=config, num_splits=num_splits)[0]
